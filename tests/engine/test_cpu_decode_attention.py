"""The CPU decode-attention kernel (layers/cpu_decode_attention.c): built here (CI installs a C
compiler), checked against a float64 computation for every KV dtype, GQA group size, head size
and sliding window, and end to end against the torch path it replaces. Without a compiler the
engine must fall back to the torch path and still decode the same tokens."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import LLMEngine, SamplingParams
from splitserve_workers.engine.layers import cpu_decode_attention
from splitserve_workers.engine.layers.attention import AttentionMetadata, paged_attention
from test_cpu_bf16 import reference_decode_attention

# Output rounding of each dtype (the kernel computes in float32 and rounds once at the end).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def test_the_kernel_builds_on_this_machine() -> None:
    lib = cpu_decode_attention.load()
    assert lib is not None, cpu_decode_attention.status()
    assert lib.splitserve_decode_attention_abi() == cpu_decode_attention.ABI
    # Loading it leaves the process's floating point alone: a library linked with -ffast-math
    # turns on flush-to-zero at load, and every denormal in the worker would become 0.
    assert 5e-324 * 1.0 > 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() > 0.0


def random_pool(
    g: torch.Generator, contexts: list[int], kvH: int, D: int, bs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    per_seq = max(math.ceil(c / bs) for c in contexts)
    blocks = len(contexts) * per_seq + 3
    k = torch.randn(blocks, bs, kvH, D, generator=g).to(dtype)
    v = torch.randn(blocks, bs, kvH, D, generator=g).to(dtype)
    # Scattered, non-monotonic block ids; rows past a sequence's blocks are padding (0).
    ids = torch.randperm(blocks, generator=g)[: len(contexts) * per_seq].view(-1, per_seq)
    tables = [[int(b) if i * bs < c else 0 for i, b in enumerate(row)]
              for row, c in zip(ids.tolist(), contexts, strict=True)]  # fmt: skip
    return k, v, tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("H", "kvH", "D"),
    [(8, 4, 64), (32, 8, 128), (7, 1, 64), (4, 4, 32), (6, 2, 80)],
    ids=["G2-D64", "G4-D128", "G7-D64", "G1-D32", "G3-D80"],
)
def test_kernel_matches_float64(dtype: torch.dtype, H: int, kvH: int, D: int) -> None:
    lib = cpu_decode_attention.load()
    assert lib is not None, cpu_decode_attention.status()
    g = torch.Generator().manual_seed(H * 1000 + D)
    bs = 16
    contexts = [1, 16, 17, 150, 33, 64]  # one key, block-aligned, one past a block, long
    k, v, tables = random_pool(g, contexts, kvH, D, bs, dtype)
    # Scores of 15-30 at the maximum: softmax is sensitive there (a bf16-rounded score is off
    # by up to 0.06, which moves a weight by 6%), the kernel keeps them in float32.
    q = (torch.randn(len(contexts), H, D, generator=g) * 3).to(dtype)
    scale = D**-0.5
    lens = torch.tensor(contexts)
    for window in (None, 20):
        starts = None if window is None else (lens - window).clamp(min=0)
        batch = cpu_decode_attention.decode_batch(lib, torch.tensor(tables), lens, starts)
        got = cpu_decode_attention.decode_attention(batch, q, k, v, scale)
        assert got.dtype == dtype and got.shape == (len(contexts), H * D)
        want = reference_decode_attention(q, k, v, tables, contexts, scale, window)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_kernel_splits_the_batch_over_threads() -> None:
    lib = cpu_decode_attention.load()
    assert lib is not None, cpu_decode_attention.status()
    g = torch.Generator().manual_seed(5)
    contexts = [40, 3, 97, 16, 1, 64, 200]
    k, v, tables = random_pool(g, contexts, 2, 64, 16, torch.bfloat16)
    q = torch.randn(len(contexts), 4, 64, generator=g).bfloat16()
    batch = cpu_decode_attention.decode_batch(lib, torch.tensor(tables), torch.tensor(contexts))
    args = (batch, q, k, v, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode_attention.decode_attention(*args)
        torch.set_num_threads(3)
        three = cpu_decode_attention.decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)  # the same sums per sequence, whichever thread ran it


def test_kernel_refuses_what_it_cannot_do() -> None:
    lib = cpu_decode_attention.load()
    assert lib is not None, cpu_decode_attention.status()
    k = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="refused the shapes"):
        batch = cpu_decode_attention.decode_batch(  # a window that starts past the context
            lib, torch.tensor([[1]]), torch.tensor([5]), torch.tensor([5])
        )
        cpu_decode_attention.decode_attention(batch, q, k, k, 0.1)
    with pytest.raises(ValueError, match="refused the shapes"):
        batch = cpu_decode_attention.decode_batch(  # longer than its block table can hold
            lib, torch.tensor([[1]]), torch.tensor([17])
        )
        cpu_decode_attention.decode_attention(batch, q, k, k, 0.1)
    with pytest.raises(ValueError, match="block_tables must be"):
        cpu_decode_attention.decode_batch(  # int32 tables would be read as int64
            lib, torch.tensor([[1]], dtype=torch.int32), torch.tensor([5])
        )
    # Not contiguous, or a head too large for the kernel: the torch path.
    assert cpu_decode_attention.supports(lib, k, 4, 64)
    assert not cpu_decode_attention.supports(lib, k.transpose(0, 1), 4, 64)
    assert not cpu_decode_attention.supports(lib, k, 4, 512)
    assert not cpu_decode_attention.supports(lib, k.to(torch.int16), 4, 64)


def test_paged_attention_takes_the_kernel_for_decode() -> None:
    """Through paged_attention, as the model calls it: the new token's K/V are written first,
    then attended; the kernel path and the torch path agree."""
    lib = cpu_decode_attention.load()
    assert lib is not None, cpu_decode_attention.status()
    g = torch.Generator().manual_seed(3)
    B, H, kvH, D, bs = 3, 8, 2, 64, 16
    contexts = [6, 3, 40]
    k_cache, v_cache, ids = random_pool(g, contexts, kvH, D, bs, torch.bfloat16)
    tables = torch.tensor(ids)
    lens = torch.tensor(contexts)
    last = lens - 1
    slots = tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
    q = torch.randn(B, H, D, generator=g).bfloat16()
    k = torch.randn(B, kvH, D, generator=g).bfloat16()
    v = torch.randn(B, kvH, D, generator=g).bfloat16()
    L = max(contexts)
    torch_meta = AttentionMetadata(slot_mapping=slots, batch_size=B, max_q=1, kv_len=L,
                                   block_tables=tables)  # fmt: skip
    torch_meta.attn_mask = (torch.arange(L)[None, :] < lens[:, None]).view(B, 1, 1, L)
    batch = cpu_decode_attention.decode_batch(lib, tables, lens)
    kernel_meta = AttentionMetadata(slot_mapping=slots, batch_size=B, max_q=1, kv_len=L,
                                    block_tables=tables, cpu_decode=batch)  # fmt: skip
    via_torch = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), torch_meta, 0.125)
    via_kernel = paged_attention(q, k, v, k_cache, v_cache, kernel_meta, 0.125)
    assert torch.equal(k_cache.reshape(-1, kvH, D)[slots], k)  # written before attending
    want = reference_decode_attention(q, k_cache, v_cache, ids, contexts, 0.125)
    torch.testing.assert_close(via_kernel.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(via_torch.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen3"])
def test_engine_decodes_the_same_tokens_with_and_without_the_kernel(
    tiny_models: dict[str, Path],
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
    preset: str,
) -> None:
    # Prompts of different lengths share every decode pass; tiny-mistral's sliding window is
    # shorter than the longest contexts here, so its windowed layers are checked too. In
    # float32, where both paths agree to ~1e-6; in bfloat16 the two round differently and a
    # random model's near-tied logits flip (test_cpu_bf16 checks bf16 decode steps against a
    # fresh prefill instead, through the kernel).
    outputs = {}
    for on in (True, False):
        engine = make_engine(tiny_models[preset], dtype="float32", cpu_decode_kernel=on)
        assert (engine.model_runner.decode_kernel is not None) == on
        window = engine.model_config.sliding_window
        probe = prompt_ids(engine, 4)
        lengths = [5, 37, 90, 128] if window is None else [5, window - 3, window + 20, 2 * window]
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for i, n in enumerate(lengths):
            engine.add_request(f"r{i}", prompt_ids(engine, n, salt=i) + probe, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.token_id is not None:
                    got.setdefault(o.request_id, []).append(o.token_id)
        outputs[on] = got
    assert outputs[True] == outputs[False]
    assert all(len(t) == 24 for t in outputs[True].values())


def test_without_a_compiler_the_engine_uses_the_torch_path(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # A fresh process (the kernel is built once per process) whose compiler does not exist.
    script = f"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model={str(tiny_llama)!r}, device="cpu"))
assert engine.model_runner.decode_kernel is None
engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
n = 0
while engine.has_unfinished():
    n += sum(o.token_id is not None for o in engine.step())
print("tokens", n)
"""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), SPLITSERVE_KERNEL_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tokens 6" in done.stdout
    assert "CPU decode attention: torch path, the kernel is cannot build or load it" in (
        done.stdout + done.stderr
    )
    assert not list(tmp_path.glob("*.so"))


def test_a_cache_others_can_write_is_not_used(tmp_path: Path) -> None:
    # A library planted in a world-writable cache would run in the worker: such a directory,
    # or one inside a world-writable directory without the sticky bit, is skipped for the next
    # candidate (here, the per-user temp dir; the system temp dir has the sticky bit).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = dict(os.environ, SPLITSERVE_KERNEL_CACHE=str(shared), XDG_CACHE_HOME=str(shared))
    script = "from splitserve_workers.engine.layers import cpu_decode_attention as c; " \
             "print(c._cache_dir())"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    chosen = Path(done.stdout.strip())
    assert shared not in (chosen, *chosen.parents)
    assert chosen.stat().st_uid == os.getuid() and not chosen.stat().st_mode & 0o022
    # Named explicitly (as the pods do, inside their own emptyDir), a private directory in a
    # world-writable one is taken: the setting says whose that directory is.
    env["SPLITSERVE_KERNEL_CACHE"] = str(shared / "kernels")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    assert Path(done.stdout.strip()) == shared / "kernels"
    assert (shared / "kernels").stat().st_mode & 0o777 == 0o700


def test_a_cut_short_library_is_built_again(tmp_path: Path) -> None:
    # A crash mid-write elsewhere, or a full disk, can leave a truncated .so under the key's
    # name: loading it fails, so it is rebuilt once instead of disabling the kernel for good.
    env = dict(os.environ, SPLITSERVE_KERNEL_CACHE=str(tmp_path))
    script = (
        "from splitserve_workers.engine.layers import cpu_decode_attention as c; "
        "assert c.load() is not None, c.status(); print(c.status())"
    )

    def load() -> str:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert load().startswith("compiled ")
    assert load().startswith("loaded ")
    (built,) = tmp_path.glob("*.so")
    built.write_bytes(built.read_bytes()[:100])
    assert load().endswith(" again")
    assert load().startswith("loaded ")


def test_pools_handed_out_stay_usable_while_others_grow() -> None:
    # Callers asking for more threads replace the shared pool; one that was just handed the
    # smaller pool must still be able to submit to it.
    errors: list[BaseException] = []

    def ask(n: int) -> None:
        try:
            pool = cpu_decode_attention._threads_pool(n)
            assert pool.submit(lambda: n).result() == n
        except BaseException as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    for round_ in range(10):
        base = 64 * (round_ + 1)
        threads = [threading.Thread(target=ask, args=(base + i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
