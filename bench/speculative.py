"""CPU benchmark: speculative decoding by n-gram lookup (engine/speculative.py) against plain
decoding, same engine, same requests, in one run.

Decode tokens/s = tokens emitted by decode passes / the time of those passes (prefill passes
are left out: they are the same in both). Greedy, so both configurations emit the same tokens
(checked: the `identical` column). The two alternate over --reps runs; the median counts.

What speculation gains depends on how often the drafts are right, which depends on the model
and the text. A random-weight model is no guide to a real model's text, so three workloads
bracket it:
- `lookup`: prompts that repeat a phrase, drafts from the n-gram lookup. The random model's
  greedy answers drift into short loops, as random models do, and the lookup predicts loops
  well: this flatters speculation compared with a real model's text.
- `oracle`: the drafts are the tokens plain decoding produced next (the lookup replaced by the
  known answer): every draft is accepted, the ceiling at this --draft-tokens (one pass of
  1 + k rows per sequence against k + 1 plain passes).
- `json`: answers held to a JSON schema (bench/structured.py's): the drafts are what the
  grammar forces next (keys, punctuation), else the lookup's as far as the grammar allows.
- `wrong`: the drafts are never right (the known answer's tokens shifted by one id): the
  floor, what drafting costs over plain decoding where it never pays (each sequence's
  drafter then shrinks its drafts and pauses, speculative.Drafter).

Prints a table and writes bench/results/speculative.json.

Run: python bench/speculative.py [--model DIR] [--batches 1,8] [--draft-tokens 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams, speculative
from splitserve_workers.engine.grammar import json_schema
from splitserve_workers.local import ensure_model
from structured import SCHEMA  # bench/structured.py's extraction schema

RESULTS = Path(__file__).resolve().parent / "results"
JSON = json_schema(SCHEMA)


def prompts_for(engine: LLMEngine, batch: int, length: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase, one phrase per request."""
    g = torch.Generator().manual_seed(11)
    vocab = engine.tokenizer.vocab_size
    out = []
    for i in range(batch):
        phrase = torch.randint(4, vocab, (6 + i % 5,), generator=g).tolist()
        out.append((phrase * (length // len(phrase) + 1))[:length])
    return out


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Every request to completion: seconds in decode passes, tokens those passes emitted,
    sequence-passes (each decode pass's batch size, summed) and every request's tokens."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    seconds, emitted, seq_passes = 0.0, 0, 0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        for o in outs:
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
        st = engine.stats()
        if st.num_prefill_tokens == 0 and st.num_decode_tokens:
            seconds += dt
            emitted += sum(o.token_id is not None for o in outs)
            seq_passes += st.batch_size
    return {
        "seconds": seconds,
        "emitted": emitted,
        "seq_passes": seq_passes,
        "tokens": [tokens[rid] for rid in ids],
    }


class Oracle:
    """Stands in for NgramIndex: proposes the tokens the plain run produced next (`answers`),
    or with `wrong` those tokens shifted by one id, so none is accepted."""

    answers: dict[tuple[int, ...], list[int]] = {}
    wrong = False

    def __init__(self, *_: int) -> None:
        pass

    def add(self, token_ids: list[int]) -> None:
        pass  # the answers are known: nothing to index

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for prompt, answer in self.answers.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt:
                done = len(token_ids) - n
                return [t + 1 if self.wrong else t for t in answer[done : done + k]]
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: the `small` preset, built once)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "speculative.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(ensure_model(args.model, "small"))

    def engine(k: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, device="cpu", speculative_tokens=k))

    plain, spec = engine(0), engine(args.draft_tokens)
    rows: list[dict[str, Any]] = []
    print(
        f"{'workload':>10} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
        f"{'accepted':>9} {'tok/pass':>8} {'identical':>9}"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        for workload in ("lookup", "oracle", "wrong", "json"):
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            if workload == "json":
                params = SamplingParams(max_tokens=4 * args.max_tokens, grammar=JSON)
            prompts = prompts_for(plain, batch, args.prompt_tokens)
            real_index = speculative.NgramIndex
            ratios, plain_rates, spec_rates = [], [], []
            identical = True
            drafted = accepted = emitted = seq_passes = 0
            for _ in range(args.reps):
                a = run(plain, prompts, params)
                if workload in ("oracle", "wrong"):
                    Oracle.wrong = workload == "wrong"
                    Oracle.answers = {
                        tuple(p): t for p, t in zip(prompts, a["tokens"], strict=True)
                    }
                    speculative.NgramIndex = Oracle  # type: ignore[misc]
                before = spec.stats()
                try:
                    b = run(spec, prompts, params)
                finally:
                    speculative.NgramIndex = real_index  # type: ignore[misc]
                after = spec.stats()
                drafted += after.draft_tokens_total - before.draft_tokens_total
                accepted += after.accepted_tokens_total - before.accepted_tokens_total
                emitted += b["emitted"]
                seq_passes += b["seq_passes"]
                identical &= b["tokens"] == a["tokens"]
                plain_rates.append(a["emitted"] / a["seconds"])
                spec_rates.append(b["emitted"] / b["seconds"])
                ratios.append(spec_rates[-1] / plain_rates[-1])
            row = {
                "workload": workload,
                "batch": batch,
                "draft_tokens": args.draft_tokens,
                "plain_tokens_per_s": round(statistics.median(plain_rates), 2),
                "spec_tokens_per_s": round(statistics.median(spec_rates), 2),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_sequence_pass": round(emitted / seq_passes, 2),
                "identical": identical,
            }
            rows.append(row)
            acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            print(
                f"{workload:>10} {batch:>5} {row['plain_tokens_per_s']:>12.1f} "
                f"{row['spec_tokens_per_s']:>11.1f} {row['ratio']:>5.2f}x {acc:>9} "
                f"{row['tokens_per_sequence_pass']:>8.2f} {str(identical):>9}"
            )
    result = {
        "model": Path(model).name,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "reps": args.reps,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
