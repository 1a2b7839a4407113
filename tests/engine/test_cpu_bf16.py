"""bfloat16 on CPU: prepacked projections (layers/linear.py), paged decode attention and the
"auto" dtype. Each path is checked against an independent computation; where this CPU lacks
bfloat16 instructions the tests check the fallback instead (plain nn.Linear, float32 under
"auto")."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
from splitserve_workers.engine.layers.attention import AttentionMetadata, paged_attention
from splitserve_workers.engine.layers.linear import (
    PackedLinear,
    cpu_native_bf16,
    prepack_supported,
)
from splitserve_workers.engine.make_model import write_model
from torch import nn


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    contexts: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Float64, one sequence and one head at a time: softmax(q k^T * scale) v over the sequence's
    own context (the last `window` positions when given). [B, heads * head_dim]."""
    B, H, D = q.shape
    kvH, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        slots = [tables[b][p // bs] * bs + p % bs for p in range(contexts[b])]
        if window is not None:
            slots = slots[-window:]
        k = k_cache.reshape(-1, kvH, D)[slots].double()  # [ctx, kvH, D]
        v = v_cache.reshape(-1, kvH, D)[slots].double()
        for h in range(H):
            kv = h // (H // kvH)
            w = torch.softmax(k[:, kv] @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ v[:, kv]
    return out.reshape(B, H * D)


def decode_in_place(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    contexts: list[int],
    scale: float,
) -> torch.Tensor:
    """paged_attention for one new token per sequence whose K/V are already in the cache at
    its last position (written again unchanged)."""
    kvH, bs, D = k_cache.shape[2], k_cache.shape[1], k_cache.shape[3]
    assert meta.block_tables is not None
    last = torch.tensor(contexts) - 1
    slots = meta.block_tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
    meta.slot_mapping = slots
    k = k_cache.reshape(-1, kvH, D)[slots].clone()
    v = v_cache.reshape(-1, kvH, D)[slots].clone()
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("equal_contexts", [True, False])
def test_bf16_decode_attention_matches_float64(equal_contexts: bool) -> None:
    g = torch.Generator().manual_seed(7)
    B, H, kvH, D, bs = 5, 8, 2, 16, 4
    contexts = [13] * B if equal_contexts else [13, 1, 7, 12, 4]
    L = max(contexts)
    per_seq = math.ceil(L / bs)
    k_cache = torch.randn(40, bs, kvH, D, generator=g).bfloat16()
    v_cache = torch.randn(40, bs, kvH, D, generator=g).bfloat16()
    # Scattered, non-monotonic block ids, as a long-running cache hands them out.
    ids = torch.randperm(40, generator=g)[: B * per_seq].view(B, per_seq).tolist()
    q = torch.randn(B, H, D, generator=g).bfloat16()
    scale = D**-0.5
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(B, dtype=torch.long),
        batch_size=B,
        max_q=1,
        kv_len=L,
        block_tables=torch.tensor(ids),
    )
    if not equal_contexts:
        meta.attn_mask = (torch.arange(L)[None, :] < torch.tensor(contexts)[:, None]).view(
            B, 1, 1, L
        )
    want = reference_decode_attention(q, k_cache, v_cache, ids, contexts, scale)
    got = decode_in_place(q, k_cache, v_cache, meta, contexts, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (B, H * D)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)

    # A sliding window is just another mask to the decode path.
    window = 5
    ctx_t = torch.tensor(contexts)
    kj = torch.arange(L)[None, :]
    meta.attn_mask = ((kj < ctx_t[:, None]) & (kj >= ctx_t[:, None] - window)).view(B, 1, 1, L)
    want = reference_decode_attention(q, k_cache, v_cache, ids, contexts, scale, window)
    got = decode_in_place(q, k_cache, v_cache, meta, contexts, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_paged_attention_bf16_decode_writes_then_attends() -> None:
    """Through paged_attention: the new token's K/V land in the cache first and are attended."""
    g = torch.Generator().manual_seed(3)
    B, H, kvH, D, bs = 3, 4, 4, 8, 4
    contexts = [6, 3, 8]
    k_cache = torch.randn(12, bs, kvH, D, generator=g).bfloat16()
    v_cache = torch.randn(12, bs, kvH, D, generator=g).bfloat16()
    ids = [[4, 9], [0, 0], [7, 2]]
    last = torch.tensor(contexts) - 1
    tables = torch.tensor(ids)
    slots = tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
    meta = AttentionMetadata(
        slot_mapping=slots, batch_size=B, max_q=1, kv_len=8, block_tables=tables
    )
    meta.attn_mask = (torch.arange(8)[None, :] < torch.tensor(contexts)[:, None]).view(B, 1, 1, 8)
    q = torch.randn(B, H, D, generator=g).bfloat16()
    k = torch.randn(B, kvH, D, generator=g).bfloat16()
    v = torch.randn(B, kvH, D, generator=g).bfloat16()
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3)
    assert torch.equal(k_cache.reshape(-1, kvH, D)[slots], k)
    want = reference_decode_attention(q, k_cache, v_cache, ids, contexts, 0.3)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_packed_linear_matches_linear() -> None:
    if not cpu_native_bf16():
        assert not prepack_supported(torch.device("cpu"), torch.bfloat16)
        return  # nothing is packed on this CPU: the engine test below checks the fallback
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(48, 80, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=g))
        linear.bias.copy_(torch.randn(80, generator=g))
    packed = PackedLinear.from_linear(linear)
    for shape in [(1, 48), (7, 48), (2, 3, 48)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        torch.testing.assert_close(packed(x), linear(x), atol=0, rtol=0)
    x = torch.randn(6, 96, generator=g).bfloat16()[:, ::2]  # a strided input
    torch.testing.assert_close(packed(x), linear(x), atol=0, rtol=0)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(
        "tiny-llama", tmp_path_factory.mktemp("bf16") / "m", dtype="bfloat16", seed=4
    )


def run_batch(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))


def prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The logits a prefill of `ids` computes for its last position."""
    runner = engine.model_runner
    seen: list[torch.Tensor] = []
    run_prefill = runner.run_prefill

    def prefill(*args):  # type: ignore[no-untyped-def]
        logits, done, hidden = run_prefill(*args)
        seen.append(logits[0].clone())
        return logits, done, hidden

    runner.run_prefill = prefill  # type: ignore[method-assign]
    try:
        run_batch(engine, [ids], 1)
    finally:
        runner.run_prefill = run_prefill  # type: ignore[method-assign]
    assert len(seen) == 1
    return seen[0]


def test_bf16_engine_prepacked_equals_plain(
    bf16_llama: Path, prompt_ids: Callable[..., list[int]]
) -> None:
    """Prepacked and plain weights give the same greedy tokens for a batch of different
    lengths (decode steps with a padding mask), and the model is packed exactly when
    supported."""
    packed = LLMEngine(EngineConfig(model=str(bf16_llama), device="cpu", dtype="bfloat16"))
    plain = LLMEngine(
        EngineConfig(
            model=str(bf16_llama), device="cpu", dtype="bfloat16", cpu_weight_prepack=False
        )
    )
    linears = [m for m in packed.model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    if cpu_native_bf16():
        assert linears and all(isinstance(m, PackedLinear) for m in linears)
        assert packed.model.logits_head is not None
    else:
        assert not any(isinstance(m, PackedLinear) for m in linears)
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    prompts = [prompt_ids(packed, n, salt=n) for n in (5, 19, 33, 2)]
    assert run_batch(packed, prompts, 10) == run_batch(plain, prompts, 10)


def test_bf16_decode_logits_match_bf16_prefill(
    bf16_llama: Path, prompt_ids: Callable[..., list[int]]
) -> None:
    """Each bfloat16 decode step's logits (attention over the gathered paged cache) against a
    fresh prefill of the same tokens (causal attention over fresh K/V, no gather)."""
    engine = LLMEngine(EngineConfig(model=str(bf16_llama), device="cpu", dtype="bfloat16"))
    seen: list[torch.Tensor] = []
    run_decode = engine.model_runner.run_decode

    def decode(*args):  # type: ignore[no-untyped-def]
        logits = run_decode(*args)
        seen.append(logits.clone())
        return logits

    engine.model_runner.run_decode = decode  # type: ignore[method-assign]
    prompts = [prompt_ids(engine, 23, salt=1), prompt_ids(engine, 9, salt=2)]
    outs = run_batch(engine, prompts, 6)
    engine.model_runner.run_decode = run_decode  # type: ignore[method-assign]
    fresh = LLMEngine(
        EngineConfig(
            model=str(bf16_llama), device="cpu", dtype="bfloat16", enable_prefix_caching=False
        )
    )
    assert len(seen) == 5  # 6 tokens: one from prefill, five decode steps of both rows
    for step in range(1, 6):
        for row, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            ref = prefill_logits(fresh, prompt + out[:step])
            torch.testing.assert_close(seen[step - 1][row], ref, atol=0.1, rtol=0.05)
            assert int(ref.argmax()) == out[step]


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32"])
def test_auto_dtype_on_cpu(tmp_path: Path, checkpoint: str) -> None:
    model = write_model("tiny-llama", tmp_path / "m", dtype=checkpoint, seed=2)
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    if checkpoint == "bfloat16" and cpu_native_bf16():
        assert engine.dtype == torch.bfloat16
    else:
        assert engine.dtype == torch.float32
    assert engine.model_runner.kv_cache.dtype == engine.dtype


def test_bf16_kv_handoff_decodes_like_local(
    bf16_llama: Path, prompt_ids: Callable[..., list[int]]
) -> None:
    """Prefill on one bfloat16 engine, its KV streamed into another (paged differently), decode
    there: the tokens one engine gives, as in float32 (test_disaggregation.py)."""
    from test_disaggregation import decode_on, prefill_elsewhere

    def make(**kw: object) -> LLMEngine:
        return LLMEngine(
            EngineConfig(model=str(bf16_llama), device="cpu", dtype="bfloat16", **kw)  # type: ignore[arg-type]
        )

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    local = make()
    prompt = prompt_ids(local, 29)
    expected = local.generate([prompt], params)[0]
    first, collector = prefill_elsewhere(make(), "r1", prompt, params)
    assert first.finish_reason == "prefill_done"
    assert all(k.dtype == torch.bfloat16 for _, _, k, _ in collector.chunks)
    b = make(block_size=8)
    assert decode_on(b, "r1", prompt, first.token_id, collector.chunks, params) == expected


def test_prepack_frees_the_original_weights_first(bf16_llama: Path) -> None:
    """While the projections are prepacked nothing of the loader's still holds the originals:
    each one is freed as its packed copy is made, so loading peaks at one copy of the weights
    plus one matrix, not two copies."""
    if not cpu_native_bf16():
        return  # nothing is packed on this CPU
    import gc
    import weakref

    from splitserve_workers.engine.loader import load_model
    from splitserve_workers.engine.model_config import ModelConfig
    from splitserve_workers.engine.models.llama import LlamaForCausalLM

    alive_after: list[int] = []
    prepack = LlamaForCausalLM.prepack_weights

    def watched(self: LlamaForCausalLM) -> None:
        refs = [weakref.ref(m.weight) for m in self.modules() if isinstance(m, nn.Linear)]
        assert refs
        prepack(self)
        gc.collect()
        alive_after.append(sum(r() is not None for r in refs))

    LlamaForCausalLM.prepack_weights = watched  # type: ignore[method-assign]
    try:
        cfg = ModelConfig.from_dir(bf16_llama)
        load_model(bf16_llama, cfg, torch.bfloat16, torch.device("cpu"))
    finally:
        LlamaForCausalLM.prepack_weights = prepack  # type: ignore[method-assign]
    assert alive_after == [0]
