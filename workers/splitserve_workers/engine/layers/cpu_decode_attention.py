"""The CPU decode-attention kernel (cpu_decode_attention.c): built on first use, called by
layers/attention.py for decode passes on the CPU (one query token per sequence).

The C file is compiled with the host's C compiler (`$CC`, else `cc`) for this very CPU
(-march=native) into a cache keyed by the source, the compiler and the CPU's flags, so the
first engine on a machine pays about a second and every later one loads the library. Where no
compiler is found or the build fails, `load()` says why once and returns None, and attention
stays on the torch path (a gather out of the block pool + SDPA), which computes the same thing.
SPLITSERVE_CPU_DECODE_KERNEL=0 turns the kernel off; SPLITSERVE_KERNEL_CACHE moves the cache.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("splitserve.engine")

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
ABI = 1
# -ffast-math for the compile step only (vectorised expf and float reductions). Linked with it,
# gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole process at
# load: every float op in the worker (torch's too) would silently drop denormals.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-std=gnu11", "-fPIC"]
LDFLAGS = ["-shared"]
COMPILE_TIMEOUT_S = 120.0
# The kernel's own limits (SPLITSERVE_MAX_HEADS / SPLITSERVE_MAX_HEAD_DIM in the C file).
MAX_HEADS = 256
MAX_HEAD_DIM = 256
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None  # (library, how it was got or why not)
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _cpu_flags() -> str:
    """What -march=native depends on: the instruction-set flags (x86 `flags`, Arm `Features`
    and `CPU part`), so a cache shared by different machines never hands one's build to the
    other."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keys = ("flags", "Features", "CPU implementer", "CPU part", "model name")
    found = sorted({line.split(":", 1)[1].strip() for line in lines
                    if ":" in line and line.split(":", 1)[0].strip() in keys})  # fmt: skip
    return "\n".join(found) or f"{platform.machine()} {platform.processor()}"


def _private(d: Path, check_parents: bool = True) -> bool:
    """d is this user's, writable by nobody else, and (check_parents) no directory above it
    lets others rename what is in it (group- or world-writable without the sticky bit that
    /tmp has)."""
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    for parent in d.parents if check_parents else ():
        mode = parent.stat().st_mode
        if mode & 0o022 and not mode & 0o1000:
            return False
    return True


def _cache_dir() -> Path:
    """SPLITSERVE_KERNEL_CACHE, else ~/.cache/splitserve/kernels, else a per-user temp dir
    (a read-only home). A library loaded from it runs in this process, so one planted there by
    another user (a shared /tmp) must never be picked up: the directory must be this user's
    and writable by nobody else, and for the default locations no directory above it may let
    others rename its entries. SPLITSERVE_KERNEL_CACHE is trusted above that (the pods set it
    inside their own emptyDir, which is world-writable but the pod's alone)."""
    env = os.environ.get("SPLITSERVE_KERNEL_CACHE")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    candidates = [(Path(env), True)] if env else []
    candidates += [
        (Path(base) / "splitserve" / "kernels", False),
        (Path(tempfile.gettempdir()) / f"splitserve-kernels-{os.getuid()}", False),
    ]
    for d, explicit in candidates:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            # The real directory, checked and used from here on: a symlink another user
            # owns could be pointed elsewhere between the check and the load.
            d = d.resolve(strict=True)
            if _private(d, check_parents=not explicit) and os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError(
        "no kernel cache directory that only this user can write among "
        f"{[str(d) for d in candidates]}"
    )


def _compile(cc: str, target: Path) -> str | None:
    """Builds the library at `target`; None, or why it failed. Built beside the target and
    renamed into place: processes starting together on one machine never load a half-written
    library."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for step in (
            [cc, *CFLAGS, "-c", "-o", obj, str(SOURCE)],
            [cc, *LDFLAGS, "-o", tmp, obj, "-lm"],
        ):
            done = subprocess.run(step, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                return f"{cc} failed: {done.stderr.strip()[-500:]}"
        os.replace(tmp, target)
        return None
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("SPLITSERVE_CPU_DECODE_KERNEL", "1") == "0":
        return None, "turned off (SPLITSERVE_CPU_DECODE_KERNEL=0)"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        source = SOURCE.read_bytes()
        flags = f"compile {' '.join(CFLAGS)} | link {' '.join(LDFLAGS)}".encode()
        key = hashlib.sha256(
            b"\0".join([source, version.encode(), flags, _cpu_flags().encode()])
        ).hexdigest()[:16]
        target = _cache_dir() / f"cpu_decode_attention-{key}.so"
        how = f"loaded {target}"
        if not target.exists():
            if error := _compile(cc, target):
                return None, error
            how = f"compiled {target}"
        try:
            lib = ctypes.CDLL(str(target))
        except OSError:
            # A library cut short (a crash mid-write elsewhere, a full disk): build it again.
            target.unlink(missing_ok=True)
            if error := _compile(cc, target):
                return None, error
            lib, how = ctypes.CDLL(str(target)), f"compiled {target} again"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot build or load it: {e}"
    if lib.splitserve_decode_attention_abi() != ABI:
        return None, f"{target} has another ABI than this package's ({ABI})"
    lib.splitserve_decode_attention_dtypes.restype = ctypes.c_int
    fn = lib.splitserve_decode_attention
    fn.restype = ctypes.c_int
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [i32, vp, ctypes.c_float, vp, vp, vp, i64, vp, vp, i64, i64,
                   i32, i32, i32, i32, vp, vp]  # fmt: skip
    return lib, how


def load() -> ctypes.CDLL | None:
    """The kernel library, built once per process (None: the torch path; why is logged once)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
            lib, how = _loaded
            if lib is not None:
                log.info("CPU decode attention: kernel %s", how)
            else:
                log.warning("CPU decode attention: torch path, the kernel is %s", how)
        return _loaded[0]


def status() -> str:
    """How the kernel was got, or why it is not used (after load())."""
    return _loaded[1] if _loaded is not None else "not loaded yet"


def supports(lib: ctypes.CDLL, k_cache: torch.Tensor, num_heads: int, head_dim: int) -> bool:
    """Whether this kernel build takes a cache like k_cache (its dtype: a compiler without
    _Float16 builds it without float16) and these head sizes."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in DTYPE_CODES
        and bool(lib.splitserve_decode_attention_dtypes() & (1 << DTYPE_CODES[k_cache.dtype]))
        and k_cache.is_contiguous()
        and num_heads <= MAX_HEADS
        and head_dim <= MAX_HEAD_DIM
    )


def _threads_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of at least n threads. A smaller one is replaced but never shut down: another
    caller may be about to submit to it (its idle threads end once it is collected)."""
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < n:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(n, os.cpu_count() or 1), thread_name_prefix="decode-attention"
            )
        return _pool


@dataclass(frozen=True)
class DecodeBatch:
    """One decode pass's sequences as the kernel reads them: checked and made contiguous once
    per pass by `decode_batch`, then read by every layer's call."""

    lib: ctypes.CDLL
    tables: torch.Tensor  # [B, n] int64 block ids
    lens: torch.Tensor  # [B] int64 context lengths, the new token's included
    starts: torch.Tensor | None  # [B] int64 first visible key (a sliding window), or None
    max_len: int


def decode_batch(
    lib: ctypes.CDLL,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    window_starts: torch.Tensor | None = None,
) -> DecodeBatch:
    """The kernel's view of a decode pass (keys [0, len) of each sequence, or [start, len)).
    Refuses what the C code would read without checking: another dtype, device or row count."""
    B = context_lens.shape[0]
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens),
                    ("window_starts", window_starts)):  # fmt: skip
        if t is not None and (t.dtype != torch.int64 or t.device.type != "cpu" or t.shape[0] != B):
            raise ValueError(f"cpu decode attention: {name} must be [{B}, ...] int64 on the CPU")
    return DecodeBatch(
        lib,
        block_tables.contiguous(),
        context_lens.contiguous(),
        None if window_starts is None else window_starts.contiguous(),
        int(context_lens.max()),
    )


def decode_attention(
    batch: DecodeBatch,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D] (one token per sequence, the cache's dtype); k_cache/v_cache: [blocks,
    block_size, kv_heads, D]. Returns [B, H * D] in q's dtype. Batches of two or more are split
    over torch's thread count (ctypes releases the GIL)."""
    B, H, D = q.shape
    kvH = k_cache.shape[2]
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cpu decode attention: q {q.dtype}, cache {k_cache.dtype}")
    if batch.lens.shape[0] != B:
        raise ValueError(f"cpu decode attention: q has {B} rows, the batch {batch.lens.shape[0]}")
    q = q.contiguous()
    tables, lens, starts = batch.tables, batch.lens, batch.starts
    out = torch.empty(B, H, D, dtype=torch.float32)
    code = DTYPE_CODES[k_cache.dtype]
    fn = batch.lib.splitserve_decode_attention

    def run(lo: int, hi: int) -> int:
        scratch = torch.empty(H * batch.max_len, dtype=torch.float32)
        return int(
            fn(
                code,
                q.data_ptr(),
                scale,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                tables.data_ptr(),
                tables.shape[1],
                lens.data_ptr(),
                None if starts is None else starts.data_ptr(),
                lo,
                hi,
                H,
                kvH,
                D,
                k_cache.shape[1],
                scratch.data_ptr(),
                out.data_ptr(),
            )  # fmt: skip
        )

    n = min(torch.get_num_threads(), B)
    if n <= 1:
        codes = [run(0, B)]
    else:
        bounds = [B * i // n for i in range(n + 1)]
        pool = _threads_pool(n - 1)
        futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, n)]
        codes = [run(bounds[0], bounds[1])] + [f.result() for f in futures]
    if any(codes):
        raise ValueError(
            f"cpu decode attention refused the shapes: heads {H}, kv_heads {kvH}, head_dim {D}, "
            f"context lengths {lens.tolist()}"
        )
    return out.view(B, H * D).to(q.dtype)
