#!/usr/bin/env bash
# GPU benchmark of the engine on one large GPU (written for an H200): an 8B-shaped Llama model
# with random bf16 weights; decode TPOT at batch 1 against the floor (weight bytes / measured
# device copy bandwidth) and prefill throughput against a measured bf16 matmul rate.
#
# Usage (from a clone):   bash bench/gpu_engine.sh            # writes bench/results/gpu_engine.json
# Environment knobs:      MODE=auto|files|synthetic  PROMPT_LEN=1024  DECODE_PROMPT=512
#                         DECODE_STEPS=128  PREFILL_BATCH=8  SPEC_TOKENS=4  PYTHON=python3
#                         OUT=file or folder  SMOKE=1 (a tiny model on the CPU: checks the script itself,
#                         as the tests do, so it does not rot between GPU runs; no numbers)
# Files mode also measures speculative decoding (engine/speculative.py, SPEC_TOKENS drafts) at
# batch 1: how much a verify pass of 1 + k rows costs against a plain step (on a GPU at batch 1
# both are bound by reading the weights, so nearly the same), and the effective TPOT.
#
# Needs: Python >= 3.11, torch with CUDA and llguidance. Installs nothing. MODE=files (the default when
# importable) also needs safetensors, tokenizers, jinja2 and tqdm: it writes the llama-8b
# preset with `make-model` into .models/llama-8b (16 GB, reused on later runs) and drives the
# full LLMEngine. Without them MODE=synthetic builds the same model in GPU memory with random
# weights and drives the engine's ModelRunner (same model, attention and KV-cache code; no
# scheduler, tokenizer or sampler).
# Time: a few minutes on the first files-mode run (drawing and writing 16 GB of weights, with
# the random numbers drawn on the GPU), about two minutes afterwards or in synthetic mode.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/workers${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p bench/results
"${PYTHON:-python3}" - <<'PY'
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch

env = os.environ.get
SMOKE = env("SMOKE") == "1"
assert SMOKE or torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
dev = torch.device("cpu" if SMOKE else "cuda")
bf16 = torch.bfloat16
MODE = env("MODE", "auto")
PROMPT_LEN = int(env("PROMPT_LEN", "32" if SMOKE else "1024"))
DECODE_PROMPT = int(env("DECODE_PROMPT", "24" if SMOKE else "512"))
DECODE_STEPS = int(env("DECODE_STEPS", "8" if SMOKE else "128"))
PREFILL_BATCH = int(env("PREFILL_BATCH", "2" if SMOKE else "8"))
SPEC_TOKENS = int(env("SPEC_TOKENS", "4"))
OUT = Path(env("OUT", "bench/results/gpu_engine.json"))
if OUT.is_dir():  # a folder to collect results in (a remote runner's output folder, say)
    OUT = OUT / "gpu_engine.json"
# The engine's modules import llguidance (structured output) even where no grammar is used.
assert importlib.util.find_spec("llguidance"), (
    "llguidance is not installed: pip install 'llguidance>=1.0,<2' (or carry its wheel, "
    "manylinux_2_31_x86_64, abi3, no dependencies, and pip install it with --no-index)"
)
if MODE == "auto":
    have = all(importlib.util.find_spec(m) for m in ("safetensors", "tokenizers", "jinja2", "tqdm"))
    MODE = "files" if have else "synthetic"
DEVICE_NAME = "cpu (smoke run)" if SMOKE else torch.cuda.get_device_name()
print(f"device: {DEVICE_NAME}  torch {torch.__version__}  mode {MODE}")


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def cuda_seconds(fn, iters):
    fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


# ---- device ceilings -------------------------------------------------------------------------
a = torch.empty(1 << (23 if SMOKE else 31), dtype=torch.uint8, device=dev)  # 2 GiB
b = torch.empty_like(a)
copy_s = cuda_seconds(lambda: b.copy_(a), 20)
bandwidth = 2 * a.numel() / copy_s  # bytes read + written per second
del a, b
m = 256 if SMOKE else 8192
x = torch.randn(m, m, dtype=bf16, device=dev)
y = torch.randn(m, m, dtype=bf16, device=dev)
mm_s = cuda_seconds(lambda: x @ y, 20)
matmul_flops = 2 * m**3 / mm_s
del x, y
if dev.type == "cuda":
    torch.cuda.empty_cache()
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s")

# ---- the model -------------------------------------------------------------------------------
from splitserve_workers.engine.model_config import ModelConfig  # noqa: E402

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
if SMOKE:  # the tiny-llama preset's shape
    LLAMA_8B |= {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
MAX_LEN = 512 if SMOKE else 8192
PRESET = "tiny-llama" if SMOKE else "llama-8b"
g = torch.Generator().manual_seed(0)


def prompt(n):
    return torch.randint(4, LLAMA_8B["vocab_size"] - 1, (n,), generator=g).tolist()


if MODE == "files":
    from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
    from splitserve_workers.engine.make_model import write_model

    model_dir = Path(env("MODELS_DIR", ".models")) / PRESET
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        write_model(PRESET, model_dir, dtype="bfloat16", device=dev.type)
        print(f"wrote {model_dir} in {time.perf_counter() - t:.0f}s")
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16", device=dev.type, max_model_len=MAX_LEN,
        # On the GPU half of what is free after the weights (the CUDA path of
        # engine/memory.py); the CPU smoke run keeps a small fixed budget.
        kv_cache_memory_bytes=64 << 20, kv_cache_memory_fraction=None if SMOKE else 0.5,
        max_batch_size=64,
        max_batch_tokens=PREFILL_BATCH * PROMPT_LEN, enable_prefix_caching=False,
        speculative_tokens=SPEC_TOKENS,  # drafting is switched on only where measured
    ))
    engine.scheduler.speculative_tokens = 0
    load_s = time.perf_counter() - t
    model, cfg = engine.model, engine.model_config
    print(f"loaded in {load_s:.0f}s, {engine.num_kv_blocks} KV blocks ({engine.kv_cache_sizing})")

    def decode_tpot(speculative=0):
        """Seconds of each decode step at batch 1 (and the tokens each emitted), with
        `speculative` draft tokens (the same engine with its scheduler drafting; each request
        has its drafter either way, built when it is added)."""
        engine.scheduler.speculative_tokens = speculative
        engine.add_request("tpot", prompt(DECODE_PROMPT),
                           SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True))
        engine.step()  # prefill + first token
        times, emitted = [], []
        while engine.has_unfinished():
            t = time.perf_counter()
            outs = engine.step()  # sampling reads the token on the host: the step has finished
            times.append(time.perf_counter() - t)
            emitted.append(sum(o.token_id is not None for o in outs))
        engine.scheduler.speculative_tokens = 0
        return times if not speculative else (times, emitted)

    def prefill_seconds():
        for i in range(PREFILL_BATCH):
            engine.add_request(f"p{i}", prompt(PROMPT_LEN), SamplingParams(max_tokens=1))
        sync()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t
else:
    from splitserve_workers.engine.block_manager import BlockManager
    from splitserve_workers.engine.model_runner import ModelRunner
    from splitserve_workers.engine.models.llama import LlamaForCausalLM
    from splitserve_workers.engine.sampling import SamplingParams
    from splitserve_workers.engine.sequence import Sequence

    cfg = ModelConfig.from_dict(LLAMA_8B)
    cfg.max_model_len = MAX_LEN
    t = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, bf16)
    model.to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.init_rotary(dev)
    load_s = time.perf_counter() - t
    block_size = 16
    per_block = block_size * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    num_blocks = ((64 << 20) if SMOKE else (24 << 30)) // per_block
    runner = ModelRunner(model, cfg, bf16, dev, num_blocks, block_size)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)

    def new_seq(rid, n, max_tokens):
        seq = Sequence(rid, prompt(n), SamplingParams(max_tokens=max_tokens))
        seq.block_table = bm.allocate(bm.blocks_for(n + max_tokens))
        return seq

    def decode_tpot():
        seq = new_seq("tpot", DECODE_PROMPT, DECODE_STEPS + 1)
        logits, _, _ = runner.run_prefill([seq], [DECODE_PROMPT])
        seq.num_computed_tokens = DECODE_PROMPT
        seq.token_ids.append(int(logits.argmax(-1)[0]))
        times = []
        for _ in range(DECODE_STEPS):
            t = time.perf_counter()
            logits = runner.run_decode([seq])
            seq.num_computed_tokens += 1
            seq.token_ids.append(int(logits.argmax(-1)[0]))  # host read: step finished
            times.append(time.perf_counter() - t)
        bm.free(seq.block_table)
        return times

    def prefill_seconds():
        seqs = [new_seq(f"p{i}", PROMPT_LEN, 1) for i in range(PREFILL_BATCH)]
        sync()
        t = time.perf_counter()
        logits, _, _ = runner.run_prefill(seqs, [PROMPT_LEN] * PREFILL_BATCH)
        logits.argmax(-1).tolist()
        elapsed = time.perf_counter() - t
        for s in seqs:
            bm.free(s.block_table)
        return elapsed

# ---- measurements ----------------------------------------------------------------------------
params = {n: p for n, p in model.named_parameters()}
total_bytes = sum(p.numel() * p.element_size() for p in params.values())
embed_bytes = params["embed_tokens.weight"].numel() * 2
# A decode step reads every weight once, except the embedding table (one row per token).
floor_bytes = total_bytes - (embed_bytes if not cfg.tie_word_embeddings else 0)
decode_tpot()  # warm-up
times = decode_tpot()
tpot = statistics.median(times)
floor = floor_bytes / bandwidth

prefill_seconds()  # warm-up
prefill_s = min(prefill_seconds() for _ in range(3))
tokens = PREFILL_BATCH * PROMPT_LEN
h, i_size, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
linear_params = L * (h * (qd + 2 * kvd) + qd * h + 3 * h * i_size)
flops = 2 * linear_params * tokens  # projections and MLP
flops += L * PREFILL_BATCH * 2 * cfg.num_heads * cfg.head_dim * PROMPT_LEN**2  # causal attention
flops += 2 * h * cfg.vocab_size * PREFILL_BATCH  # logits of the last tokens only
achieved = flops / prefill_s

speculative = None
if MODE == "files" and SPEC_TOKENS:
    before = engine.stats()
    spec_times, spec_emitted = decode_tpot(SPEC_TOKENS)
    after = engine.stats()
    drafted = after.draft_tokens_total - before.draft_tokens_total
    accepted = after.accepted_tokens_total - before.accepted_tokens_total
    wide = [t for t, n in zip(spec_times, spec_emitted) if n > 1]  # passes that accepted drafts
    speculative = {
        "draft_tokens": SPEC_TOKENS,
        "effective_tpot_ms": sum(spec_times) / max(1, sum(spec_emitted)) * 1e3,
        "plain_tpot_ms": tpot * 1e3,
        "speedup": tpot / (sum(spec_times) / max(1, sum(spec_emitted))),
        "acceptance": accepted / drafted if drafted else None,
        # What one pass of 1 + k rows costs against a plain step (the GPU's case for drafting).
        "accepting_pass_over_plain_step": statistics.median(wide) / tpot if wide else None,
        "note": "random weights: the lookup finds the model's own loops, so acceptance flatters",
    }

result = {
    "device": DEVICE_NAME, "torch": torch.__version__, "mode": MODE,
    "model": "llama-8b shape, random bf16 weights", "params": sum(p.numel() for p in params.values()),
    "load_seconds": round(load_s, 1),
    "copy_bandwidth_bytes_per_s": bandwidth, "bf16_matmul_flops_per_s": matmul_flops,
    "decode": {
        "batch": 1, "prompt_len": DECODE_PROMPT, "steps": DECODE_STEPS,
        "tpot_ms_median": tpot * 1e3, "tpot_ms_p90": sorted(times)[int(0.9 * len(times))] * 1e3,
        "floor_ms": floor * 1e3, "floor_weight_bytes": floor_bytes,
        "tpot_over_floor": tpot / floor,
    },
    "prefill": {
        "batch": PREFILL_BATCH, "prompt_len": PROMPT_LEN, "seconds": prefill_s,
        "tokens_per_s": tokens / prefill_s, "achieved_flops_per_s": achieved,
        "fraction_of_measured_matmul_rate": achieved / matmul_flops,
    },
    "speculative": speculative,
}
if MODE == "files":
    result["kv_cache"] = {"blocks": engine.num_kv_blocks, "sizing": engine.kv_cache_sizing}
out = OUT
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
d, p = result["decode"], result["prefill"]
print(f"decode  batch 1: TPOT {d['tpot_ms_median']:.2f} ms (floor {d['floor_ms']:.2f} ms, "
      f"{d['tpot_over_floor']:.2f}x)")
print(f"prefill {PREFILL_BATCH}x{PROMPT_LEN}: {p['tokens_per_s']:.0f} tokens/s, "
      f"{achieved / 1e12:.0f} TFLOP/s = {p['fraction_of_measured_matmul_rate']:.0%} of matmul rate")
if speculative:
    print(f"speculative, {SPEC_TOKENS} drafts, batch 1: effective TPOT "
          f"{speculative['effective_tpot_ms']:.2f} ms ({speculative['speedup']:.2f}x plain)")
print(f"wrote {out}")
PY
