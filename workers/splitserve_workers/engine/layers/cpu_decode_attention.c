/* Paged decode attention for the CPU: one query token per sequence, read straight from the block
 * pool. layers/attention.py's torch path gathers every sequence's context out of the pool
 * (index_select) and then runs SDPA on the copy; at batch 32 that gather plus SDPA's per-head
 * overhead was ~40% of a bfloat16 decode step. Here each sequence's K/V rows are read once, in
 * pool order (a token's kv_heads x head_dim row is contiguous, so all heads are done per row),
 * and scores, softmax and the weighted sum of V stay in float32 (bf16/f16 inputs are widened
 * exactly; AVX512-BF16 dot products where the CPU has them).
 *
 * cpu_decode_attention.py compiles this file with the host's C compiler (-march=native) on first
 * use and calls it through ctypes (which releases the GIL, so batch slices can run on several
 * threads). No Python or torch headers: any C11 compiler will do (float16 caches need one with
 * _Float16, e.g. gcc >= 12 or clang >= 15 on x86-64; without it only float16 is left out).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define SPLITSERVE_MAX_HEADS 256
#define SPLITSERVE_MAX_HEAD_DIM 256

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };

#if defined(__FLT16_MAX__)
#define SPLITSERVE_HAVE_F16 1
#else
#define SPLITSERVE_HAVE_F16 0
#endif

int splitserve_decode_attention_abi(void) { return 1; }

/* Bit (1 << KV_*) set for each cache dtype this build takes. */
int splitserve_decode_attention_dtypes(void) {
    return (1 << KV_FLOAT32) | (1 << KV_BFLOAT16) | (SPLITSERVE_HAVE_F16 << KV_FLOAT16);
}

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* dot(q, k) over D elements of one dtype. */
static inline float dot_f32(const float *restrict q, const float *restrict k, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

static inline float dot_bf16(const uint16_t *restrict q, const uint16_t *restrict k, int D) {
#if defined(__AVX512BF16__)
    if (D % 32 == 0) {
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + d),
                                 (__m512bh)_mm512_loadu_si512(q + d));
        return _mm512_reduce_add_ps(a);
    }
#endif
    float s = 0.f;
    for (int d = 0; d < D; d++) s += from_bf16(q[d]) * from_bf16(k[d]);
    return s;
}

#if SPLITSERVE_HAVE_F16
static inline float dot_f16(const _Float16 *restrict q, const _Float16 *restrict k, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += (float)q[d] * (float)k[d];
    return s;
}
#endif

static inline void widen_f32(const float *restrict x, float *restrict y, int D) {
    memcpy(y, x, (size_t)D * sizeof(float));
}
static inline void widen_bf16(const uint16_t *restrict x, float *restrict y, int D) {
    for (int d = 0; d < D; d++) y[d] = from_bf16(x[d]);
}
#if SPLITSERVE_HAVE_F16
static inline void widen_f16(const _Float16 *restrict x, float *restrict y, int D) {
    for (int d = 0; d < D; d++) y[d] = (float)x[d];
}
#endif

/* The KV of a decode step comes from memory, not cache (the weights have swept it out since
 * the last step), and blocks are scattered over the pool, where the hardware prefetcher cannot
 * follow: while one block is read, the next one to be read is asked for, row by row. That took
 * a cold batch-32 layer from ~0.7 to ~0.45 ms here. */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)p + c, 0, 3);
}

/* One sequence, every query head: q [H, D], visible keys [start, L) of its block table.
 * sc: H * L floats of scratch; out: [H, D] float32; after: the first block the next sequence
 * will read (prefetched during the last one), or NULL. */
#define DEFINE_SEQUENCE(NAME, T, DOT, WIDEN)                                                      \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const T *restrict q, float scale, const T *restrict kc, const T *restrict vc,            \
        const int64_t *restrict table, int64_t start, int64_t L, int H, int kvH, int D, int bs,  \
        float *restrict sc, float *restrict out, const T *after) {                               \
        const int G = H / kvH;                                                                   \
        const int64_t row = (int64_t)kvH * D, row_bytes = row * (int64_t)sizeof(T);              \
        const int64_t first = start - start % bs;                                                \
        float vf[SPLITSERVE_MAX_HEAD_DIM];                                                       \
        for (int64_t t0 = first; t0 < L; t0 += bs) {                                             \
            const T *kb = kc + table[t0 / bs] * bs * row;                                        \
            const T *next = t0 + bs < L ? kc + table[t0 / bs + 1] * bs * row                     \
                                        : vc + table[first / bs] * bs * row;                     \
            int64_t lo = start > t0 ? start - t0 : 0, hi = L - t0 < bs ? L - t0 : bs;            \
            for (int64_t o = lo; o < hi; o++) {                                                  \
                const T *krow = kb + o * row;                                                    \
                prefetch_row(next + o * row, row_bytes);                                         \
                for (int h = 0; h < kvH; h++)                                                    \
                    for (int g = 0; g < G; g++) {                                                \
                        int hq = h * G + g;                                                      \
                        sc[hq * L + t0 + o] = DOT(q + hq * D, krow + h * D, D) * scale;          \
                    }                                                                            \
            }                                                                                    \
        }                                                                                        \
        for (int hq = 0; hq < H; hq++) {                                                         \
            float *r = sc + hq * L;                                                              \
            float m = r[start];                                                                  \
            for (int64_t t = start + 1; t < L; t++) m = r[t] > m ? r[t] : m;                     \
            float total = 0.f;                                                                   \
            for (int64_t t = start; t < L; t++) {                                                \
                float e = expf(r[t] - m);                                                        \
                r[t] = e;                                                                        \
                total += e;                                                                      \
            }                                                                                    \
            float inv = 1.f / total;                                                             \
            for (int64_t t = start; t < L; t++) r[t] *= inv;                                     \
        }                                                                                        \
        for (int i = 0; i < H * D; i++) out[i] = 0.f;                                            \
        for (int64_t t0 = first; t0 < L; t0 += bs) {                                             \
            const T *vb = vc + table[t0 / bs] * bs * row;                                        \
            const T *next = t0 + bs < L ? vc + table[t0 / bs + 1] * bs * row : after;            \
            int64_t lo = start > t0 ? start - t0 : 0, hi = L - t0 < bs ? L - t0 : bs;            \
            for (int64_t o = lo; o < hi; o++) {                                                  \
                const T *vrow = vb + o * row;                                                    \
                if (next) prefetch_row(next + o * row, row_bytes);                               \
                for (int h = 0; h < kvH; h++) {                                                  \
                    WIDEN(vrow + h * D, vf, D);                                                  \
                    for (int g = 0; g < G; g++) {                                                \
                        int hq = h * G + g;                                                      \
                        float p = sc[hq * L + t0 + o];                                           \
                        float *acc = out + hq * D;                                               \
                        for (int d = 0; d < D; d++) acc[d] += p * vf[d];                         \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_SEQUENCE(sequence_f32, float, dot_f32, widen_f32)
DEFINE_SEQUENCE(sequence_bf16, uint16_t, dot_bf16, widen_bf16)
#if SPLITSERVE_HAVE_F16
DEFINE_SEQUENCE(sequence_f16, _Float16, dot_f16, widen_f16)
#endif

/* Sequences [b_begin, b_end) of the batch; head_dim 64 and 128 get specialised loops (the
 * constant lets the compiler unroll them). */
#define DEFINE_BATCH(NAME, T, SEQ)                                                               \
    static void NAME(const T *q, float scale, const T *kc, const T *vc, const int64_t *tables,   \
                     int64_t table_stride, const int64_t *lens, const int64_t *starts,           \
                     int64_t b_begin, int64_t b_end, int H, int kvH, int D, int bs, float *sc,   \
                     float *out) {                                                               \
        for (int64_t b = b_begin; b < b_end; b++) {                                              \
            const T *qb = q + b * H * D;                                                         \
            const int64_t *tb = tables + b * table_stride;                                       \
            int64_t s = starts ? starts[b] : 0;                                                  \
            float *ob = out + b * H * D;                                                         \
            const T *after = NULL;                                                               \
            if (b + 1 < b_end) {                                                                 \
                int64_t s1 = starts ? starts[b + 1] : 0;                                         \
                after = kc + tables[(b + 1) * table_stride + s1 / bs] * bs * (int64_t)kvH * D;   \
            }                                                                                    \
            if (D == 64)                                                                         \
                SEQ(qb, scale, kc, vc, tb, s, lens[b], H, kvH, 64, bs, sc, ob, after);           \
            else if (D == 128)                                                                   \
                SEQ(qb, scale, kc, vc, tb, s, lens[b], H, kvH, 128, bs, sc, ob, after);          \
            else                                                                                 \
                SEQ(qb, scale, kc, vc, tb, s, lens[b], H, kvH, D, bs, sc, ob, after);            \
        }                                                                                        \
    }

DEFINE_BATCH(batch_f32, float, sequence_f32)
DEFINE_BATCH(batch_bf16, uint16_t, sequence_bf16)
#if SPLITSERVE_HAVE_F16
DEFINE_BATCH(batch_f16, _Float16, sequence_f16)
#endif

/* q: [B, H, D] in the cache's dtype; k_cache/v_cache: [blocks, block_size, kvH, D];
 * tables: [B, table_stride] block ids; lens: [B] context lengths (keys [0, len) exist);
 * starts: [B] first visible key (a sliding window) or NULL; scratch: H * max(lens) floats;
 * out: [B, H, D] float32. Returns 0, or -1 for input it does not take (heads or head_dim out of
 * range, a length its block table cannot hold, an empty window, a dtype left out of this build):
 * the caller checks shapes and dtypes first (supports()), so -1 means a caller's bug. */
int splitserve_decode_attention(int dtype, const void *q, float scale, const void *k_cache,
                                const void *v_cache, const int64_t *tables, int64_t table_stride,
                                const int64_t *lens, const int64_t *starts, int64_t b_begin,
                                int64_t b_end, int H, int kvH, int D, int block_size,
                                float *scratch, float *out) {
    if (H <= 0 || kvH <= 0 || H % kvH || H > SPLITSERVE_MAX_HEADS || D <= 0 ||
        D > SPLITSERVE_MAX_HEAD_DIM || block_size <= 0)
        return -1;
    for (int64_t b = b_begin; b < b_end; b++) {
        int64_t s = starts ? starts[b] : 0;
        if (lens[b] < 1 || lens[b] > table_stride * block_size || s < 0 || s >= lens[b])
            return -1;
    }
    switch (dtype) {
    case KV_FLOAT32:
        batch_f32(q, scale, k_cache, v_cache, tables, table_stride, lens, starts, b_begin, b_end,
                  H, kvH, D, block_size, scratch, out);
        return 0;
    case KV_BFLOAT16:
        batch_bf16(q, scale, k_cache, v_cache, tables, table_stride, lens, starts, b_begin, b_end,
                   H, kvH, D, block_size, scratch, out);
        return 0;
#if SPLITSERVE_HAVE_F16
    case KV_FLOAT16:
        batch_f16(q, scale, k_cache, v_cache, tables, table_stride, lens, starts, b_begin, b_end,
                  H, kvH, D, block_size, scratch, out);
        return 0;
#endif
    }
    return -1;
}
