"""Priority benchmark: what a flood of background requests does to interactive ones, against
the same flood sent as interactive, on a disaggregated stack (1 prefill + 1 decode worker) and
a colocated one, both with a small KV cache so that the flood fills it.

Each measurement: F flood requests (long prompt, many tokens) sent at once with one priority;
once they hold the cache, P interactive probes (short prompt, few tokens, C at a time). The
probes' TTFT and TPOT as the client sees them, p50/p90, and per mode the ratio of probe TTFT p90
under a background flood to under an interactive flood (below 1: priority lets interactive work
through; 1: the flood's priority makes no difference). Baseline: the probes alone. Flood kinds
alternate on one stack per mode, for --rounds rounds. Prints a table and writes
bench/results/priority.json.

Run: python bench/priority.py [--model DIR | --preset tiny-llama] [--modes disaggregated,colocated]
     [--flood 32] [--flood-prompt 400] [--flood-tokens 600] [--probes 32] [--probe-concurrency 4]
     [--kv-bytes 2097152] [--max-batch-size 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from splitserve_workers.local import ensure_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (  # noqa: E402 - the serving benchmark's
    Sample,
    Stack,
    one_request,
    percentiles,
    stack_parser,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results"
FLOODS = ("none", "background", "interactive")


async def measure(
    base: str, args: argparse.Namespace, vocab: int, flood: str, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """(probes, flood requests) of one measurement; flood "none" is the baseline."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        flooding = [
            asyncio.ensure_future(
                one_request(session, base, tokens(args.flood_prompt), args.flood_tokens, flood)
            )
            for _ in range(0 if flood == "none" else args.flood)
        ]
        if flooding:
            await asyncio.sleep(args.settle)  # the flood is prefilled and holds the cache
        probes: list[Sample] = []
        queue = [tokens(args.probe_prompt) for _ in range(args.probes)]

        async def prober() -> None:
            while queue:
                prompt = queue.pop()
                probes.append(
                    await one_request(session, base, prompt, args.probe_tokens, "interactive")
                )

        await asyncio.gather(*(prober() for _ in range(args.probe_concurrency)))
        flooded = list(await asyncio.gather(*flooding))
    return probes, flooded


def summary(probes: list[Sample], flooded: list[Sample]) -> dict[str, Any]:
    ok = [s for s in probes if s.ok]
    return {
        "probes": len(probes),
        "probes_failed": len(probes) - len(ok),
        "probe_ttft_s": percentiles([s.ttft for s in ok]),
        "probe_tpot_s": percentiles([s.tpot for s in ok]),
        "flood": len(flooded),
        "flood_failed": sum(not s.ok for s in flooded),
        "errors": sorted({s.error for s in [*probes, *flooded] if not s.ok})[:5],
    }


def main() -> int:
    p = stack_parser(__doc__, preset="tiny-llama")
    p.add_argument("--flood", type=int, default=32, help="flood requests, sent at once")
    p.add_argument("--flood-prompt", type=int, default=400)
    p.add_argument("--flood-tokens", type=int, default=600)
    p.add_argument("--probes", type=int, default=32, help="interactive probe requests")
    p.add_argument("--probe-prompt", type=int, default=40)
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--probe-concurrency", type=int, default=4)
    p.add_argument("--settle", type=float, default=2.0, help="seconds between flood and probes")
    p.add_argument("--kv-bytes", type=int, default=2 << 20, help="each worker's KV cache")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "priority.json"))
    args = p.parse_args()

    model = ensure_model(args.model, args.preset)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    config = {
        "prefill": {"kv_cache_memory_bytes": args.kv_bytes},
        "decode": {"kv_cache_memory_bytes": args.kv_bytes, "max_batch_size": args.max_batch_size},
    }
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        shape = ["--colocated", "1"] if mode == "colocated" else ["--prefill", "1", "--decode", "1"]
        log_dir = Path(tempfile.mkdtemp(prefix=f"splitserve-bench-priority-{mode}-"))
        (log_dir / "config.yaml").write_text(json.dumps(config))  # YAML too
        stack = Stack(
            model, args.device, [*shape, "--config", str(log_dir / "config.yaml")], log_dir
        )
        samples: dict[str, tuple[list[Sample], list[Sample]]] = {f: ([], []) for f in FLOODS}
        try:
            base = f"http://127.0.0.1:{stack.port}"
            asyncio.run(measure(base, args, vocab, "none", -1))  # warm-up
            for round_ in range(args.rounds):
                # Alternate the order: a shared machine drifts during a run.
                for flood in FLOODS if round_ % 2 == 0 else FLOODS[::-1]:
                    probes, flooded = asyncio.run(
                        measure(base, args, vocab, flood, args.seed + round_)
                    )
                    samples[flood][0].extend(probes)
                    samples[flood][1].extend(flooded)
        finally:
            stack.stop()
        per_flood = {f: summary(*samples[f]) for f in FLOODS}
        bg, inter = (per_flood[f]["probe_ttft_s"]["p90"] for f in ("background", "interactive"))
        results[mode] = {**per_flood, "ttft_p90_ratio_background_to_interactive": bg / inter}

    print(
        f"\nmodel {model.name}; flood {args.flood} x ({args.flood_prompt} prompt, "
        f"{args.flood_tokens} output) tokens; {args.probes} interactive probes "
        f"({args.probe_prompt}/{args.probe_tokens} tokens, {args.probe_concurrency} at a time); "
        f"KV {args.kv_bytes >> 10} KiB per worker, max batch {args.max_batch_size}"
    )
    print(
        f"{'mode':<14} {'flood':<12} {'probe TTFT p50/p90 ms':>22} "
        f"{'TPOT p50/p90 ms':>17} {'failed':>7}"
    )
    for mode, r in results.items():
        for flood in FLOODS:
            s = r[flood]
            ttft, tpot = s["probe_ttft_s"], s["probe_tpot_s"]
            print(
                f"{mode:<14} {flood:<12} {ttft['p50'] * 1e3:>12.0f}/{ttft['p90'] * 1e3:<9.0f} "
                f"{tpot['p50'] * 1e3:>8.1f}/{tpot['p90'] * 1e3:<8.1f} "
                f"{s['probes_failed'] + s['flood_failed']:>7}"
            )
        ratio = r["ttft_p90_ratio_background_to_interactive"]
        print(f"{mode}: probe TTFT p90 under a background / an interactive flood: {ratio:.2f}x")
    write_results(args, model, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
