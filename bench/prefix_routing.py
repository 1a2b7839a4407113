"""Prefill routing benchmark: multi-turn conversations through the router, with the prefill pool
picked by `cache_aware` (a conversation's next turn goes where its history is cached) against
`least_queued_tokens` (load only), and `cache_aware` without the decode workers' KV reuse (each
turn's whole history crosses to decode again), same model, stack shape and conversations.

Every conversation resends its whole history plus a new message each turn, as chat clients do;
conversations run concurrently, each one turn at a time. Reports per policy: the fraction of
prompt tokens served from the prefill workers' prefix caches (the API's `cached_tokens`) and
TTFT p50/p90 of the turns after the first, and the ratio of the two policies' TTFTs. Prints a
table and writes bench/results/prefix_routing.json.

Run: python bench/prefix_routing.py [--model DIR | --preset small] [--prefill 2] [--decode 1]
     [--conversations 8] [--turns 4] [--first-len 384] [--turn-len 96] [--output-len 8]
     [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from splitserve_workers.local import ensure_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import Stack, one_request, percentiles, stack_parser, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Router settings per configuration: the prefill policies, and cache_aware without the decode
# workers' KV reuse (every turn's whole history crosses to decode again).
CONFIGS: dict[str, dict[str, Any]] = {
    "cache_aware": {"prefill_policy": "cache_aware"},
    "least_queued_tokens": {"prefill_policy": "least_queued_tokens"},
    "cache_aware, no KV reuse": {"prefill_policy": "cache_aware", "decode_kv_reuse": False},
}
POLICIES = tuple(CONFIGS)


async def kv_bytes_sent(session: aiohttp.ClientSession, base: str) -> float:
    """The router's splitserve_kv_transfer_bytes_total."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("splitserve_kv_transfer_bytes_total{")
    )


async def turn(
    session: aiohttp.ClientSession, base: str, prompt: list[int], output_len: int
) -> tuple[float, int]:
    """(TTFT seconds, cached prompt tokens) of one streamed completion."""
    sample = await one_request(session, base, prompt, output_len)
    if not sample.ok:
        raise RuntimeError(sample.error)
    return sample.ttft, sample.cached_tokens


async def conversations(
    base: str, args: argparse.Namespace, vocab: int, seed: int
) -> tuple[list[tuple[float, int, int]], float]:
    """(TTFT, cached tokens, prompt tokens) of every turn after the first, and the KV bytes
    the turns sent to decode workers."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    histories = [tokens(args.first_len) for _ in range(args.conversations)]
    news = [[tokens(args.turn_len) for _ in range(args.turns)] for _ in histories]
    later: list[tuple[float, int, int]] = []  # (ttft, cached, prompt tokens) of turns >= 2
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up on prompts no conversation shares: one-time costs in every worker.
        await asyncio.gather(*(turn(session, base, tokens(64), 2) for _ in range(4)))
        kv_before = await kv_bytes_sent(session, base)

        async def talk(c: int) -> None:
            prompt = histories[c]
            for t in range(args.turns):
                ttft, cached = await turn(session, base, prompt, args.output_len)
                if t:
                    later.append((ttft, cached, len(prompt)))
                prompt = prompt + news[c][t]

        await asyncio.gather(*(talk(c) for c in range(args.conversations)))
        kv = await kv_bytes_sent(session, base) - kv_before
    return later, kv


def summary(
    later: list[tuple[float, int, int]], duration: float, kv_bytes: float, turns: int
) -> dict[str, Any]:
    return {
        "duration_s": duration,
        "later_turns": len(later),
        "cached_fraction": sum(c for _, c, _ in later) / max(1, sum(n for _, _, n in later)),
        "ttft_s": percentiles([t for t, _, _ in later]),
        "kv_bytes_per_turn": kv_bytes / max(1, turns),
    }


def main() -> int:
    p = stack_parser(__doc__, modes=False)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=384, help="first prompt's tokens")
    p.add_argument("--turn-len", type=int, default=96, help="tokens each turn adds")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="stacks per policy, alternating")
    p.add_argument("--out", default=str(RESULTS / "prefix_routing.json"))
    args = p.parse_args()

    model = ensure_model(args.model, args.preset)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    shape = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    samples: dict[str, list[tuple[float, int, int]]] = {p: [] for p in POLICIES}
    durations = dict.fromkeys(POLICIES, 0.0)
    kv_bytes = dict.fromkeys(POLICIES, 0.0)
    for round_ in range(args.rounds):
        # Alternate the order (A B, B A, ...): a shared machine drifts during a run. Each
        # round has its own conversations, the same for both policies.
        for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
            log_dir = Path(tempfile.mkdtemp(prefix=f"splitserve-bench-{policy}-"))
            config = log_dir / "config.yaml"
            config.write_text(json.dumps({"router": CONFIGS[policy]}))  # YAML too
            stack = Stack(model, args.device, [*shape, "--config", str(config)], log_dir)
            try:
                started = time.perf_counter()
                later, kv = asyncio.run(
                    conversations(f"http://127.0.0.1:{stack.port}", args, vocab, args.seed + round_)
                )
                samples[policy] += later
                kv_bytes[policy] += kv
                durations[policy] += time.perf_counter() - started
            finally:
                stack.stop()
    turns = args.rounds * args.conversations * args.turns
    results = {p: summary(samples[p], durations[p], kv_bytes[p], turns) for p in POLICIES}
    base, other, full = (results[p]["ttft_s"] for p in POLICIES)
    ratio = {k: other[k] / base[k] for k in ("p50", "p90")}
    reuse_ratio = {k: full[k] / base[k] for k in ("p50", "p90")}
    kv_ratio = results[POLICIES[2]]["kv_bytes_per_turn"] / max(
        1.0, results[POLICIES[0]]["kv_bytes_per_turn"]
    )

    print(
        f"\nmodel {model.name}, {args.prefill} prefill + {args.decode} decode, "
        f"{args.conversations} conversations x {args.turns} turns, first prompt "
        f"{args.first_len} tok, +{args.turn_len} tok per turn, output {args.output_len} tok"
    )
    print(f"{'router':<26} {'cached':>7} {'TTFT p50/p90 ms (turns 2+)':>28} {'KV MB per turn':>15}")
    for policy, r in results.items():
        ttft = r["ttft_s"]
        print(
            f"{policy:<26} {r['cached_fraction'] * 100:>6.0f}% "
            f"{ttft['p50'] * 1000:>18.0f}/{ttft['p90'] * 1000:<9.0f} "
            f"{r['kv_bytes_per_turn'] / 1e6:>15.2f}"
        )
    print(
        f"least_queued_tokens / cache_aware TTFT: p50 {ratio['p50']:.2f}x, p90 {ratio['p90']:.2f}x"
    )
    print(
        f"no KV reuse / cache_aware: TTFT p50 {reuse_ratio['p50']:.2f}x, "
        f"p90 {reuse_ratio['p90']:.2f}x; KV bytes {kv_ratio:.2f}x"
    )
    write_results(
        args,
        model,
        {
            "results": results,
            "ttft_ratio": ratio,
            "no_kv_reuse": {"ttft_ratio": reuse_ratio, "kv_bytes_ratio": kv_ratio},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
