"""CPU benchmark: the cost of structured output (a JSON-schema grammar) in the engine.

Decodes the same prompts with a JSON-schema grammar ("constrained") and without one ("free")
at several batch sizes, in one run. Both configurations do the same work: the free run gives
each request, with ignore_eos, exactly as many tokens as the constrained run generated for it
(greedy decoding is deterministic, so a pilot constrained run fixes the lengths), so the batch
shrinks step by step identically in both. Decode tokens/s = tokens of the steps after every
request has its first token / those steps' time; the two configurations alternate over --reps
runs and the median counts. Also measured: the engine's `_grammar_masks` (llguidance's
bitmasks; sample() unpacks them where the logits are) and `_advance_grammar` per
constrained token, llguidance's mask alone replayed over a generated answer, and the grammar's
compile time (a first matcher) against a copy of the cached one. Prints a table and writes
bench/results/structured.json.

Mask cost grows with the tokenizer's vocabulary: the `small` preset's tokenizer is a byte-level
BPE trained on a small built-in corpus (865 tokens: it asks for 2048 and the corpus runs out of
merges), in a 32000-row vocabulary, so real tokenizers (32k-150k tokens) cost more per mask.

Run: python bench/structured.py [--model DIR] [--batches 1,8] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
from splitserve_workers.engine import llm_engine as engine_module
from splitserve_workers.engine.grammar import Grammars, json_schema
from splitserve_workers.engine.sampling import unpack_bitmask
from splitserve_workers.local import ensure_model

RESULTS = Path(__file__).resolve().parent / "results"
# A typical extraction schema; every string and array is bounded so that a random-weight
# model's greedy output ends inside --max-tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "maxItems": 3,
        },
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "email", "role", "active", "tags", "score"],
    "additionalProperties": False,
}


class Timer:
    """Wraps a function and adds up the seconds spent in it and the rows it handled."""

    def __init__(self, fn: Callable[..., Any], rows: Callable[..., int]) -> None:
        self.fn, self.rows_of = fn, rows
        self.seconds = 0.0
        self.rows = 0

    def __call__(self, *args: Any) -> Any:
        t = time.perf_counter()
        out = self.fn(*args)
        self.seconds += time.perf_counter() - t
        self.rows += self.rows_of(*args)
        return out

    def reset(self) -> None:
        self.seconds, self.rows = 0.0, 0


def prompts_for(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(4, vocab, (batch, length), generator=g).tolist()


def run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[list[int]], list[str | None], int, float, list[float]]:
    """(each request's tokens, finish reasons, decode tokens, decode seconds, each decode
    step's seconds per token): decode = the steps after every request has its first token."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    got: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    decode_tokens, decode_s = 0, 0.0
    per_token: list[float] = []
    while engine.has_unfinished():
        all_started = all(got)
        t = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - t
        tokens = 0
        for o in outs:
            i = int(o.request_id[1:])
            if o.token_id is not None:
                got[i].append(o.token_id)
                tokens += 1
            if o.finish_reason is not None:
                reasons[i] = o.finish_reason
        if all_started and tokens:
            decode_tokens += tokens
            decode_s += elapsed
            per_token.append(elapsed / tokens)
    return got, reasons, decode_tokens, decode_s, per_token


def replay_masks(
    grammars: Grammars, grammar: str, answers: list[list[int]], vocab: int, repeats: int
) -> tuple[float, float]:
    """(llguidance mask microseconds per token, consume_token microseconds per token) over the
    generated answers, each token's mask computed before it is consumed, as in the engine."""
    words = (vocab + 31) // 32
    buf = torch.empty(words, dtype=torch.int32)
    mask_s = consume_s = 0.0
    n = 0
    for _ in range(repeats):
        for tokens in answers:
            m = grammars.matcher(grammar)
            for tok in tokens:
                t = time.perf_counter()
                m.unsafe_compute_mask_ptr(buf.data_ptr(), words * 4)
                t2 = time.perf_counter()
                ok = m.consume_token(tok)
                consume_s += time.perf_counter() - t2
                mask_s += t2 - t
                n += 1
                if not ok or m.is_stopped():
                    break
    return 1e6 * mask_s / max(1, n), 1e6 * consume_s / max(1, n)


def compile_times(engine: LLMEngine, grammar: str, repeats: int) -> dict[str, float]:
    """The LLTokenizer build, a first matcher for `grammar` (compile), and a matcher copied from
    the cached compiled one, each the median of `repeats` runs."""
    tok = engine.tokenizer
    src = (tok.to_json(), engine.model_config.vocab_size, list(engine.eos_token_ids))
    build, compile_, copy, schema = [], [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        json_schema(SCHEMA)
        schema.append(time.perf_counter() - t)
        g = Grammars(*src)
        t = time.perf_counter()
        g._llg_tokenizer()  # noqa: SLF001 - built on the first grammar; timed apart here
        build.append(time.perf_counter() - t)
        t = time.perf_counter()
        g.matcher(grammar)
        compile_.append(time.perf_counter() - t)
        for _ in range(20):
            t = time.perf_counter()
            g.matcher(grammar)
            copy.append(time.perf_counter() - t)
    return {
        "schema_to_grammar_ms": 1e3 * statistics.median(schema),
        "tokenizer_build_ms": 1e3 * statistics.median(build),
        "compile_ms": 1e3 * statistics.median(compile_),
        "cached_copy_us": 1e6 * statistics.median(copy),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF-format directory (default: the cached small preset)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (see bench/engine.py)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160, help="cap per constrained request")
    ap.add_argument("--reps", type=int, default=5, help="alternating runs per point; median")
    ap.add_argument("--quick", action="store_true", help="2 reps, fewer compile/replay repeats")
    ap.add_argument("--out", default=str(RESULTS / "structured.json"))
    args = ap.parse_args()
    if args.quick:
        args.reps = min(args.reps, 2)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    model_dir = ensure_model(args.model, "small")
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_batch_size=max(batches),
            max_batch_tokens=max(batches) * args.prompt_len,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
        )
    )
    mc = engine.model_config
    vocab = mc.vocab_size
    tokenizer_tokens = engine.tokenizer.vocab_size
    grammar = json_schema(SCHEMA)
    print(f"model {mc.architecture} layers={mc.num_layers} hidden={mc.hidden_size} "
          f"params={mc.num_params() / 1e6:.1f}M vocab={vocab} tokenizer={tokenizer_tokens} tokens "
          f"threads={args.threads} prompt={args.prompt_len} reps={args.reps}")  # fmt: skip

    # Compile first, on fresh Grammars (the engine's own cache then compiles once, in warm-up).
    compiled = compile_times(engine, grammar, 2 if args.quick else 5)

    def constrained_rows(seqs: list[Any], vocab: int, drafts: Any = None) -> int:
        return sum(s.matcher is not None for s in seqs)

    masks = Timer(engine_module._grammar_masks, constrained_rows)  # noqa: SLF001
    advance = Timer(engine_module.LLMEngine._advance_grammar, lambda seq, tok: 1)  # noqa: SLF001
    sampler = Timer(engine_module.sample, lambda logits, params, *rest: len(params))
    engine_module._grammar_masks = masks  # type: ignore[assignment]  # noqa: SLF001
    engine_module.sample = sampler  # type: ignore[assignment]
    engine_module.LLMEngine._advance_grammar = staticmethod(advance)  # type: ignore[method-assign,assignment]  # noqa: SLF001

    def constrained(n: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=args.max_tokens, grammar=grammar) for _ in range(n)]

    # Warm-up: kernels, allocator, the engine's grammar cache.
    warm = prompts_for(2, args.prompt_len, tokenizer_tokens, salt=99)
    run(engine, warm, constrained(2))
    run(engine, warm, [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)

    rows: list[dict[str, Any]] = []
    answers: list[list[int]] = []
    for b in batches:
        prompts = prompts_for(b, args.prompt_len, tokenizer_tokens, salt=1000 + b)
        # Pilot: the constrained lengths the free run then matches.
        pilot, reasons, *_ = run(engine, prompts, constrained(b))
        lengths = [len(t) for t in pilot]
        free_params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        rate: dict[str, list[float]] = {"free": [], "constrained": []}
        steps: dict[str, list[float]] = {"free": [], "constrained": []}
        counts: dict[str, int] = {}
        masks.reset()
        advance.reset()
        c_decode_s = 0.0
        sample_s = dict.fromkeys(rate, 0.0)
        sample_rows = dict.fromkeys(rate, 0)
        for rep in range(args.reps):
            order = ("constrained", "free") if rep % 2 == 0 else ("free", "constrained")
            for name in order:
                params = constrained(b) if name == "constrained" else free_params
                sampler.reset()
                got, _, n, secs, per_token = run(engine, prompts, params)
                steps[name] += per_token
                sample_s[name] += sampler.seconds
                sample_rows[name] += sampler.rows
                if name == "constrained":
                    c_decode_s += secs
                    # Greedy: every run must produce the pilot's answers.
                    assert got == pilot, "constrained greedy output changed between runs"
                else:
                    assert [len(t) for t in got] == lengths
                counts[name] = n
                rate[name].append(n / secs if secs else float("nan"))
        assert counts["free"] == counts["constrained"], counts
        free, con = statistics.median(rate["free"]), statistics.median(rate["constrained"])
        # Less sensitive to a burst of other work than whole runs: the median decode step (per
        # token) of all runs; both configurations have the same sequence of batch sizes.
        step_free, step_con = (
            statistics.median(steps["free"]),
            statistics.median(steps["constrained"]),
        )
        # Per constrained token (prefill's first tokens included in the mask counts).
        mask_us = 1e6 * masks.seconds / max(1, masks.rows)
        adv_us = 1e6 * advance.seconds / max(1, advance.rows)
        # sample(): the constrained rows' logits are masked there (masks computed before it).
        samp = {k: 1e6 * sample_s[k] / max(1, sample_rows[k]) for k in rate}
        # The grammar's own work per constrained token, from the timed parts (less noisy than
        # the difference of two whole-run rates on a shared machine), and the ratio it implies.
        overhead_us = mask_us + adv_us + samp["constrained"] - samp["free"]
        rows.append({
            "batch": b,
            "free_tokens_per_s": round(free, 2),
            "constrained_tokens_per_s": round(con, 2),
            "ratio": round(con / free, 3),
            "ratio_median_step": round(step_free / step_con, 3),
            "median_step_us_per_token": {
                "free": round(1e6 * step_free, 1), "constrained": round(1e6 * step_con, 1)
            },
            "runs_tokens_per_s": {k: [round(x, 2) for x in v] for k, v in rate.items()},
            "decode_tokens": counts["free"],
            "mean_output_tokens": round(statistics.mean(lengths), 1),
            "output_tokens": lengths,
            "finish_reasons": reasons,
            "extra_us_per_token": round(1e6 * (1 / con - 1 / free), 1),
            "engine_mask_us_per_token": round(mask_us, 1),
            "advance_us_per_token": round(adv_us, 1),
            "sample_us_per_token": {k: round(v, 1) for k, v in samp.items()},
            "grammar_us_per_token": round(overhead_us, 1),
            "ratio_from_parts": round(1 / (1 + overhead_us * 1e-6 * free), 3),
            "grammar_share_of_constrained_decode": round(
                (masks.seconds + advance.seconds) / (c_decode_s or 1), 3
            ),
        })  # fmt: skip
        answers += pilot
        print(f"batch {b}: done ({statistics.mean(lengths):.1f} tokens per answer, "
              f"finish {sorted(set(map(str, reasons)))})", flush=True)  # fmt: skip

    llg_mask_us, consume_us = replay_masks(
        engine.grammars, grammar, answers, vocab, 2 if args.quick else 10
    )
    # The torch half of the mask, in sample(): unpacking [rows, words] int32 bitmasks to bool.
    words = (vocab + 31) // 32
    unpack_us = {}
    for b in batches:
        bits = torch.randint(-(2**31), 2**31 - 1, (b, words), dtype=torch.int32)
        unpack_bitmask(bits, vocab)
        t = time.perf_counter()
        for _ in range(50):
            unpack_bitmask(bits, vocab)
        unpack_us[b] = round(1e6 * (time.perf_counter() - t) / 50 / b, 1)

    print(f"{'batch':>5} {'free tok/s':>11} {'constr tok/s':>13} {'ratio':>6} {'step ratio':>10}"
          f" {'parts':>6}"
          f" {'extra us/tok':>13}"
          f" {'mask us':>8} {'advance us':>11} {'sample us free/constr':>22}"
          f" {'mean out':>9}")  # fmt: skip
    for r in rows:
        samp = r["sample_us_per_token"]
        print(f"{r['batch']:>5} {r['free_tokens_per_s']:>11.1f} "
              f"{r['constrained_tokens_per_s']:>13.1f} {r['ratio']:>5.2f}x "
              f"{r['ratio_median_step']:>9.2f}x {r['ratio_from_parts']:>5.2f}x "
              f"{r['extra_us_per_token']:>13.1f} "
              f"{r['engine_mask_us_per_token']:>8.1f} "
              f"{r['advance_us_per_token']:>11.1f} "
              f"{samp['free']:>10.1f} / {samp['constrained']:>9.1f} "
              f"{r['mean_output_tokens']:>9.1f}")  # fmt: skip
    print("ratio: constrained / free decode tokens/s (same prompts, same output lengths; "
          "median of runs); step ratio: the same from the median decode step per token of all "
          "runs; parts: the ratio implied by the timed grammar work (mask + advance + sample's "
          "extra) on top of the free rate; extra: "
          "1/constrained - 1/free per token; per constrained token inside the engine: mask = "
          "_grammar_masks (llguidance's bitmasks), advance = _advance_grammar "
          "(consume_token), sample = sample() (unpacking the bitmasks, masking the "
          "logits)")  # fmt: skip
    print(f"isolated, warm caches (replayed over {len(answers)} answers): llguidance mask "
          f"{llg_mask_us:.1f} us/token, consume_token {consume_us:.1f} us/token; unpack_bitmask "
          "per row: "
          + ", ".join(f"batch {b} {us:.1f} us" for b, us in unpack_us.items()))  # fmt: skip
    print(f"compile: schema -> grammar {compiled['schema_to_grammar_ms']:.2f} ms, LLTokenizer "
          f"{compiled['tokenizer_build_ms']:.2f} ms (once per engine), first matcher "
          f"{compiled['compile_ms']:.2f} ms, cached copy "
          f"{compiled['cached_copy_us']:.1f} us")  # fmt: skip
    print(f"note: the tokenizer has {tokenizer_tokens} tokens in a {vocab}-row vocabulary; "
          "llguidance's mask cost grows with the tokenizer's token count, so a 32k-150k "
          "tokenizer costs more per mask than measured here")  # fmt: skip

    result = {
        "rows": rows,
        "mask_us_per_token": round(
            statistics.mean(r["engine_mask_us_per_token"] for r in rows), 1
        ),
        "llguidance_mask_us_per_token": round(llg_mask_us, 1),
        "consume_token_us_per_token": round(consume_us, 1),
        "unpack_us_per_row": unpack_us,
        "compile_ms": round(compiled["compile_ms"], 3),
        "cached_copy_us": round(compiled["cached_copy_us"], 1),
        "schema_to_grammar_ms": round(compiled["schema_to_grammar_ms"], 3),
        "tokenizer_build_ms": round(compiled["tokenizer_build_ms"], 3),
        "setup": {
            "model": "small" if args.model is None else Path(model_dir).name,
            "params": mc.num_params(), "vocab_size": vocab,
            "tokenizer_tokens": tokenizer_tokens, "threads": args.threads, "dtype": "float32",
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "reps": args.reps,
            "schema": SCHEMA, "grammar_bytes": len(grammar.encode("utf-8")),
            "torch": torch.__version__, "llguidance": getattr(llguidance, "__version__", "?"),
            "example_answer": engine.tokenizer.decode(answers[0]) if answers else "",
        },
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
