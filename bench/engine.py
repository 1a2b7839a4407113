"""CPU benchmark: this engine against transformers `generate` on the same random-weight files.

Measures prefill and decode tokens/s at several batch sizes (greedy, fixed prompt and output
lengths, the same torch thread count for both; decode = batch / median step time), prints a
table and writes bench/results/engine.json. Run: python bench/engine.py [--model DIR].
Without --model it writes the `small` preset (~58M parameters) into a temporary directory.
Each dtype in --dtypes (default float32 and bfloat16) is its own comparison: both sides load
the same files in that dtype; rows carry a "dtype" field. Extra "serving" rows (`serving_rows`)
time whole workloads of requests with mixed prompt and output lengths end to end and count only
the tokens each request asked for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
from splitserve_workers.engine.layers import cpu_decode_attention
from splitserve_workers.engine.make_model import write_model

RESULTS = Path(__file__).resolve().parent / "results"


def prompts_for(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(4, vocab, (batch, length), generator=g).tolist()


def ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds): the steps until every request has its first
    token, then each decode step."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    started = time.perf_counter()
    prefill = 0.0
    steps: list[float] = []
    first: set[str] = set()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if len(first) == len(prompts):
            steps.append(time.perf_counter() - t)
        first.update(o.request_id for o in outs)
        if not prefill and len(first) == len(prompts):
            prefill = time.perf_counter() - started
    return prefill, steps


class StepClock:
    """A transformers streamer that only timestamps: put() is called with the prompt before the
    prefill and with each new token right after its step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def reference(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds) inside one transformers generate call."""
    ids = torch.tensor(prompts)
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=clock)  # fmt: skip
    assert out.shape[1] == ids.shape[1] + new_tokens and len(clock.times) == new_tokens + 1
    t = clock.times
    return t[1] - t[0], [b - a for a, b in zip(t[1:], t[2:], strict=False)]


def gemm_floor(engine: LLMEngine, batch: int, reps: int = 10) -> list[float]:
    """Seconds of only the matrix multiplies of one decode step at `batch` rows, `reps` times, run
    through the engine's own weights and kernels (q|k|v, o, gate|up, down per layer, then the
    output projection; oneDNN-prepacked where the engine packs them). transformers
    computes the same products (q, k, v and gate, up as separate GEMMs), so its step time
    divided by this bounds what an engine using these GEMM kernels could beat it by at this
    batch size; a faster kernel or weight layout would raise the bound."""
    model = engine.model
    dt = engine.dtype
    x = torch.randn(batch, model.config.hidden_size, dtype=dt)
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []  # (linear, an input of its width)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        calls += [(attn.qkv_proj, x), (attn.o_proj, torch.randn(batch, attn.q_size, dtype=dt))]
        calls += [
            (mlp.gate_up_proj, x),
            (mlp.down_proj, torch.randn(batch, mlp.intermediate_size, dtype=dt)),
        ]

    def step() -> None:
        for linear, inp in calls:
            linear(inp)
        model.compute_logits(x)

    times = []
    with torch.inference_mode():
        step()
        for _ in range(reps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return times


def serving_workload(
    n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """n prompts with lengths uniform in prompt_range and output lengths uniform in out_range
    (both inclusive), from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=g).tolist()
    olens = torch.randint(out_range[0], out_range[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(4, vocab, (p,), generator=g).tolist() for p in plens]
    return prompts, olens


def ours_serving(
    engine: LLMEngine, prompts: list[list[int]], olens: list[int]
) -> tuple[float, list[list[int]]]:
    """(seconds until every request is done, generated tokens). All arrive at once; the
    scheduler admits up to max_batch_size, drops each request when it reaches its own
    max_tokens and admits the next waiting one (continuous batching)."""
    for i, (p, n) in enumerate(zip(prompts, olens, strict=True)):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    got: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                got[int(o.request_id[1:])].append(o.token_id)
    elapsed = time.perf_counter() - started
    assert [len(g) for g in got] == olens, "every request must get exactly what it asked for"
    return elapsed, got


def reference_serving(
    model: torch.nn.Module, prompts: list[list[int]], olens: list[int], slots: int
) -> tuple[float, list[list[int]]]:
    """(seconds, each request's requested tokens) for transformers `generate` on the same
    requests in arrival order, `slots` at a time: each call left-pads its prompts to the
    longest one and steps every row until the longest requested output is done (a static
    batch cannot release or refill a row)."""
    got: list[list[int]] = []
    started = time.perf_counter()
    for lo in range(0, len(prompts), slots):
        chunk, want = prompts[lo : lo + slots], olens[lo : lo + slots]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(want),
                min_new_tokens=max(want), do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert out.shape[1] == width + max(want)
        got += [row[width : width + n] for row, n in zip(out.tolist(), want, strict=True)]
    return time.perf_counter() - started, got


def cpu_name() -> str:
    """The CPU model and whether it has bfloat16 instructions: bf16 rows depend on both."""
    from splitserve_workers.engine.layers.linear import cpu_native_bf16

    name = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} (native bfloat16: {'yes' if cpu_native_bf16() else 'no'})"


def bench_dtype(
    engine: LLMEngine, hf: torch.nn.Module, dtype: str, batches: list[int], args: argparse.Namespace
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(rows, serving_rows) for one dtype: both implementations loaded in it from the same files."""
    vocab = engine.tokenizer.vocab_size
    mc = engine.model_config
    print(f"{dtype}: model {mc.architecture} layers={mc.num_layers} hidden={mc.hidden_size} "
          f"params={mc.num_params() / 1e6:.1f}M threads={args.threads} "
          f"prompt={args.prompt_len} new_tokens={args.new_tokens}")  # fmt: skip

    # Warm up both (allocator, kernels) on a small batch.
    warm = prompts_for(2, args.prompt_len, vocab, salt=99)
    ours(engine, warm, 4)
    reference(hf, warm, 4)
    del warm

    # The machine may be shared: alternate the two implementations, keep the best prefill of
    # --reps runs and the median decode step, so bursts of other work do not decide the ratio.
    rows: list[dict[str, object]] = []
    for b in batches:
        prefill = {"ours": 1e9, "transformers": 1e9}
        steps: dict[str, list[float]] = {"ours": [], "transformers": []}
        gemms: list[float] = []
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, salt=1000 * b + rep)
            for name, fn in (("ours", ours), ("transformers", reference)):
                p, s = fn(engine if name == "ours" else hf, prompts, args.new_tokens)
                prefill[name] = min(prefill[name], p)
                steps[name] += s
            gemms += gemm_floor(engine, b)  # between the runs, so load bursts hit it alike
        step = {name: statistics.median(v) for name, v in steps.items()}
        floor = statistics.median(gemms)
        n_prefill = b * args.prompt_len
        rows.append({
            "dtype": dtype, "phase": "prefill", "batch": b,
            "ours_tokens_per_s": round(n_prefill / prefill["ours"], 2),
            "transformers_tokens_per_s": round(n_prefill / prefill["transformers"], 2),
            "ratio": round(prefill["transformers"] / prefill["ours"], 3),
        })  # fmt: skip
        rows.append({
            "dtype": dtype, "phase": "decode", "batch": b,
            "ours_tokens_per_s": round(b / step["ours"], 2),
            "transformers_tokens_per_s": round(b / step["transformers"], 2),
            "ratio": round(step["transformers"] / step["ours"], 3),
            # The step's GEMMs alone (the engine's own weights and kernels), and transformers'
            # step over them: the ceiling on "ratio" for an engine doing the same math with
            # those GEMM kernels on this CPU.
            "gemm_floor_step_s": round(floor, 5),
            "ratio_ceiling": round(step["transformers"] / floor, 3),
        })  # fmt: skip
        print(f"{dtype} batch {b}: done", flush=True)

    serving_rows: list[dict[str, object]] = []
    slots = max(batches)
    prange = tuple(int(x) for x in args.serving_prompt.split(","))
    orange = tuple(int(x) for x in args.serving_output.split(","))
    for n in [int(x) for x in args.serving_requests.split(",") if x]:
        prompts, olens = serving_workload(n, prange, orange, vocab, seed=7 + n)  # type: ignore[arg-type]
        secs: dict[str, list[float]] = {"ours": [], "transformers": []}
        for _ in range(args.serving_reps):
            t_ours, toks_ours = ours_serving(engine, prompts, olens)
            t_ref, toks_ref = reference_serving(hf, prompts, olens, slots)
            secs["ours"].append(t_ours)
            secs["transformers"].append(t_ref)
        # Same greedy tokens is the check that both did the same work (padding changes GEMM
        # shapes, so a near-tie may rarely flip one argmax; more often in bfloat16).
        same = sum(a == b for a, b in zip(toks_ours, toks_ref, strict=True))
        t = {name: statistics.median(v) for name, v in secs.items()}
        useful = sum(olens)
        serving_rows.append({
            "dtype": dtype, "phase": "serving", "batch": slots,
            "ours_tokens_per_s": round(useful / t["ours"], 2),
            "transformers_tokens_per_s": round(useful / t["transformers"], 2),
            "ratio": round(t["transformers"] / t["ours"], 3),
            "shape": f"{n} requests arriving together, {slots} at a time; prompts "
                     f"{prange[0]}..{prange[1]} tokens, outputs {orange[0]}..{orange[1]} tokens "
                     f"(uniform, seed {7 + n}); useful tokens = sum of requested outputs",
            "requests": n, "useful_tokens": useful, "prompt_tokens": sum(map(len, prompts)),
            "ours_s": round(t["ours"], 3), "transformers_s": round(t["transformers"], 3),
            "identical_outputs": f"{same}/{n}",
        })  # fmt: skip
        print(f"{dtype} serving {n} requests: done ({same}/{n} identical outputs)", flush=True)
    return rows, serving_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="HF-format directory (default: write the small preset)")
    # One thread by default: on a shared machine a 2-thread run mostly measures how often the
    # second thread is descheduled at each parallel region. Pass --threads 2 on an idle box.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="runs per point; the best one counts")
    ap.add_argument("--out", default=str(RESULTS / "engine.json"))
    ap.add_argument("--serving-requests", default="32,64",
                    help="serving workloads: request counts, each run max(--batches) at a time "
                         "('' skips the serving rows)")  # fmt: skip
    ap.add_argument("--serving-prompt", default="16,512", help="min,max prompt tokens")
    ap.add_argument("--serving-output", default="4,64", help="min,max requested new tokens")
    ap.add_argument("--serving-reps", type=int, default=1, help="runs per workload; median")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated; each is a separate comparison, both sides loading the "
                         "same files in that dtype")  # fmt: skip
    ap.add_argument(
        "--no-prepack",
        action="store_true",
        help="the engine without oneDNN-prepacked weights, either dtype (an ablation)",
    )
    ap.add_argument(
        "--no-decode-kernel",
        action="store_true",
        help="the engine's torch decode attention (gather + SDPA) instead of its C kernel "
        "(an ablation)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    for name in args.dtypes.split(","):
        if name not in ("float32", "bfloat16", "float16"):
            ap.error(f"--dtypes: {name!r} is not one of float32, bfloat16, float16")
    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="splitserve-bench-")
        model_dir = str(write_model("small", Path(tmp.name) / "small", seed=0))

    from transformers import AutoModelForCausalLM

    rows: list[dict[str, object]] = []
    serving_rows: list[dict[str, object]] = []
    kv: dict[str, dict[str, int]] = {}
    prepacked: dict[str, bool] = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        engine = LLMEngine(
            EngineConfig(
                model=model_dir,
                device="cpu",
                dtype=dtype_name,
                max_batch_size=max(batches),
                max_batch_tokens=max(batches) * args.prompt_len,
                kv_cache_memory_bytes=1 << 30,
                enable_prefix_caching=False,  # fresh prompts anyway; transformers has none
                cpu_weight_prepack=not args.no_prepack,
                cpu_decode_kernel=not args.no_decode_kernel,
            )
        )
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        hf.eval()
        hf.generation_config.eos_token_id = None
        # Which decode attention ran: the C kernel, or the torch path (and why, on screen).
        decode_kernel = engine.model_runner.decode_kernel is not None
        # Whether this dtype's projections ran prepacked (float32: the load-time probe decides).
        prepacked[dtype_name] = engine.model.logits_head is not None
        print(
            f"{dtype_name}: projections {'oneDNN-prepacked' if prepacked[dtype_name] else 'plain'}"
        )
        if not decode_kernel and not args.no_decode_kernel:
            print(f"decode attention on the torch path: {cpu_decode_attention.status()}")
        got = bench_dtype(engine, hf, dtype_name, batches, args)
        rows += got[0]
        serving_rows += got[1]
        cache = engine.model_runner.kv_cache
        mc = engine.model_config
        kv[dtype_name] = {
            "measured": cache.numel()
            * cache.element_size()
            // (engine.num_kv_blocks * engine.block_size),
            "formula": 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * cache.element_size(),
        }
        params = mc.num_params()
        del engine, hf

    print(f"{'dtype':9} {'phase':8} {'batch':>5} {'ours tok/s':>12} {'transformers':>13}"
          f" {'ratio':>7} {'ceiling':>8}")  # fmt: skip
    for r in rows:
        ceiling = f"{r['ratio_ceiling']:>7.2f}x" if "ratio_ceiling" in r else ""
        print(f"{r['dtype']:9} {r['phase']:8} {r['batch']:>5} {r['ours_tokens_per_s']:>12.1f} "
              f"{r['transformers_tokens_per_s']:>13.1f} {r['ratio']:>6.2f}x {ceiling}")  # fmt: skip
    print("ceiling: transformers' decode step / the matrix multiplies of the same step alone, "
          "run through the engine's own weights (the most an engine doing this math with "
          "these GEMM kernels could reach)")  # fmt: skip
    if serving_rows:
        print("extra: serving workloads, whole run, useful generated tokens/s "
              "(only the tokens each request asked for; prefill time included)")  # fmt: skip
        print(f"{'dtype':9} {'requests':>8} {'batch':>5} {'ours tok/s':>12} {'transformers':>13}"
              f" {'ratio':>7}  shape")  # fmt: skip
        for r in serving_rows:
            print(f"{r['dtype']:9} {r['requests']:>8} {r['batch']:>5} "
                  f"{r['ours_tokens_per_s']:>12.1f} {r['transformers_tokens_per_s']:>13.1f} "
                  f"{r['ratio']:>6.2f}x  prompts {args.serving_prompt.replace(',', '..')}, "
                  f"outputs {args.serving_output.replace(',', '..')}")  # fmt: skip
    for name, k in kv.items():
        print(f"KV bytes/token, {name}: {k['measured']} (formula 2 x layers x kv_heads x "
              f"head_dim x bytes = {k['formula']})")  # fmt: skip
    first = next(iter(kv.values()))
    result = {
        "rows": rows,
        # The first dtype's (float32 by default), as earlier runs reported it; every dtype's in
        # kv_bytes_per_token_by_dtype.
        "kv_bytes_per_token": first["measured"],
        "kv_bytes_per_token_formula": first["formula"],
        "kv_bytes_per_token_by_dtype": kv,
        "serving_rows": serving_rows,
        "setup": {
            "model": "small" if args.model is None else Path(model_dir).name,
            "params": params, "threads": args.threads, "dtypes": args.dtypes.split(","),
            "cpu_weight_prepack": not args.no_prepack, "cpu": cpu_name(),
            "cpu_decode_kernel": decode_kernel, "prepacked_by_dtype": prepacked,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
            "torch": torch.__version__,
        },
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
