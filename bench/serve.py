"""Serving benchmark through the router's HTTP API: disaggregated (prefill + decode pools) against
colocated workers, same model, same number of worker processes, same open-loop Poisson load.

Reports per mode: goodput (requests/s meeting both the TTFT and the TPOT objective), SLO
attainment, throughput, and p50/p90/p99 of TTFT, TPOT, ITL and end-to-end latency as the client
measures them. Prints a table and writes bench/results/serve.json.

Run: python bench/serve.py [--model DIR | --preset small] [--device cpu] [--rate 2]
     [--num-requests 40] [--input-len 256] [--output-len 32] [--slo-ttft 1.0] [--slo-tpot 0.1]
     [--endpoint URL]   (an already running router: measure it as is, start nothing)
Without --model it builds the preset once into the local-mode model cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from splitserve_workers.local import ensure_model

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Sample:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


async def one_request(
    session: aiohttp.ClientSession,
    base: str,
    prompt: list[int],
    output_len: int,
    priority: str | None = None,
) -> Sample:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                return Sample(False, len(prompt), error=f"HTTP {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(False, len(prompt), error=event["error"]["message"])
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices"):
                    times.append(time.perf_counter())
    except aiohttp.ClientError as e:
        return Sample(False, len(prompt), error=str(e))
    if not times:
        return Sample(False, len(prompt), error="no tokens")
    n = int(usage.get("completion_tokens", len(times)))
    first, last = times[0], times[-1]
    return Sample(
        True,
        len(prompt),
        output_tokens=n,
        ttft=first - start,
        tpot=(last - first) / (n - 1) if n > 1 else 0.0,
        e2e=last - start,
        itls=[b - a for a, b in zip(times, times[1:], strict=False)],
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
    )


def write_results(args: argparse.Namespace, model: Path, payload: dict[str, Any]) -> None:
    """`payload` with the run's settings (the arguments, the model, the CPUs) to --out."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["model"] = model.name
    settings["cpu_count"] = os.cpu_count()
    out.write_text(json.dumps({"settings": settings, **payload}, indent=2) + "\n")
    print(f"wrote {out}")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


async def run_load(base: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_requests):
        n = rng.randint(max(1, args.input_len // 2), args.input_len * 3 // 2)
        prompts.append([rng.randrange(4, vocab) for _ in range(n)])
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: first requests pay one-time costs (allocator, caches) in every worker.
        await asyncio.gather(*(one_request(session, base, p, 4) for p in prompts[:2]))
        tasks = []
        started = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one_request(session, base, prompt, args.output_len)))
            await asyncio.sleep(rng.expovariate(args.rate))
        samples: list[Sample] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    ok = [s for s in samples if s.ok]
    good = [s for s in ok if s.ttft <= args.slo_ttft and s.tpot <= args.slo_tpot]
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok})[:5],
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / duration,
        "goodput_rps": len(good) / duration,
        "slo_attainment": len(good) / len(samples) if samples else 0.0,
        "ttft_s": percentiles([s.ttft for s in ok]),
        "tpot_s": percentiles([s.tpot for s in ok]),
        "itl_s": percentiles([x for s in ok for x in s.itls]),
        "e2e_s": percentiles([s.e2e for s in ok]),
    }


class Stack:
    """`splitserve up` in the background; its READY line gives the router's port."""

    def __init__(self, model: Path, device: str, shape: list[str], log_dir: Path) -> None:
        cmd = [sys.executable, "-m", "splitserve_workers.cli", "up", "--model", str(model)]
        cmd += ["--port", "0", "--device", device, "--stats-interval", "3600"]
        cmd += ["--log-dir", str(log_dir), *shape]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.port = 0
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = re.match(r"READY role=up port=(\d+)", line)
                if m:
                    self.port = int(m[1])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(900)
        if not self.port:
            self.stop()
            raise RuntimeError(f"splitserve up {' '.join(shape)} did not start; see {log_dir}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stack_parser(doc: str, preset: str = "small", modes: bool = True) -> argparse.ArgumentParser:
    """The arguments of every benchmark that starts local stacks: the model (a directory, or a
    preset built once), the device, and (modes) which stacks to compare."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--preset", default=preset)
    p.add_argument("--device", default="auto")
    if modes:
        p.add_argument("--modes", default="disaggregated,colocated")
    return p


def main() -> int:
    p = stack_parser(__doc__)
    p.add_argument("--workers", type=int, default=2, help="worker processes per mode")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint", help="measure this router instead of starting stacks")
    p.add_argument("--out", default=str(RESULTS / "serve.json"))
    args = p.parse_args()

    model = ensure_model(args.model, args.preset)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    results: dict[str, Any] = {}
    if args.endpoint:
        results["endpoint"] = asyncio.run(run_load(args.endpoint.rstrip("/"), args, vocab))
    for mode in [] if args.endpoint else args.modes.split(","):
        if mode == "disaggregated":
            n_prefill = max(1, args.workers // 2)
            shape = ["--prefill", str(n_prefill), "--decode", str(args.workers - n_prefill)]
        else:
            shape = ["--colocated", str(args.workers)]
        log_dir = Path(tempfile.mkdtemp(prefix=f"splitserve-bench-{mode}-"))
        stack = Stack(model, args.device, shape, log_dir)
        try:
            results[mode] = asyncio.run(run_load(f"http://127.0.0.1:{stack.port}", args, vocab))
            results[mode]["shape"] = " ".join(shape)
        finally:
            stack.stop()

    print(
        f"\nmodel {model.name}, device {args.device}, {args.num_requests} requests at "
        f"{args.rate}/s, prompt ~{args.input_len} tok, output {args.output_len} tok, "
        f"SLO TTFT<={args.slo_ttft}s TPOT<={args.slo_tpot}s"
    )
    head = (
        f"{'mode':<14} {'goodput':>8} {'attain':>7} {'rps':>6} {'fail':>5} "
        f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p99 ms':>15} "
        f"{'e2e p50/p99 s':>14}"
    )
    print(head)
    for mode, r in results.items():

        def ms(d: dict[str, float], keys: tuple[str, ...]) -> str:
            return "/".join(f"{d[k] * 1000:.0f}" for k in keys)

        print(
            f"{mode:<14} {r['goodput_rps']:>8.2f} {r['slo_attainment'] * 100:>6.0f}% "
            f"{r['throughput_rps']:>6.2f} {r['failed']:>5} "
            f"{ms(r['ttft_s'], ('p50', 'p90', 'p99')):>22} "
            f"{ms(r['tpot_s'], ('p50', 'p90', 'p99')):>22} "
            f"{ms(r['itl_s'], ('p50', 'p99')):>15} "
            f"{r['e2e_s']['p50']:>6.2f}/{r['e2e_s']['p99']:.2f}"
        )
    for mode, r in results.items():
        for error in r["errors"]:
            print(f"{mode}: failed request: {error[:200]}")
    write_results(args, model, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
