"""Local mode, `splitserve up`: the whole stack on one machine as plain subprocesses — prefill and
decode pools (or a colocated pool) and the router in front of them — wired by the ports their
READY lines report. Prints the endpoint and a live TTFT/TPOT line read from the router's own
/metrics; `--demo` sends a few streaming requests and exits. Ctrl-C/SIGTERM stops every child."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve_operator.scrape import buckets, histogram_quantile, parse_page

from splitserve_workers.engine.config import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from splitserve_workers.local_scaling import LocalAutoscaler

READY_RE = re.compile(
    r"^READY role=(?P<role>\S+) port=(?P<port>\d+)(?: metrics_port=(?P<metrics>\d+))?"
)
DEFAULT_PRESET = "tiny-llama"
START_TIMEOUT_S = 600.0  # first start imports torch and may build the model
STOP_TIMEOUT_S = 30.0
RESTART_WINDOW_S = 60.0  # --max-restarts counts restarts of one child within this window
DEFAULT_MAX_RESTARTS = 3
# A child whose /health has not answered for this long (stopped, or its event loop blocked) is
# killed, and restarted as an exited one is: local mode's liveness probe.
DEFAULT_LIVENESS_TIMEOUT_S = 30.0
DEMO_PROMPTS = (
    "Explain in one sentence why prefill and decode are served by separate pools.",
    "Write a haiku about a KV cache moving between two machines.",
    "List three things a router measures at the edge.",
)
# The demo's last request: held to this schema, even random weights answer with valid JSON.
DEMO_SCHEMA_PROMPT = "Describe a cat as JSON."
DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
    },
    "required": ["name", "age", "indoor"],
    "additionalProperties": False,
}


def cache_dir() -> Path:
    """Where local mode keeps the model it builds (same root as the project's venv cache)."""
    root = os.environ.get("SPLITSERVE_CACHE") or str(Path.home() / ".cache" / "splitserve")
    return Path(root) / "models"


def splitserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve_workers.cli", *args]


def ensure_model(model: str | None, preset: str = DEFAULT_PRESET) -> Path:
    """The model to serve: the given directory, or a tiny random-weight model built once into
    the cache (so `splitserve up` works on a fresh machine with nothing downloaded)."""
    if model:
        path = Path(model)
        for name in ("config.json", "tokenizer.json"):
            if not (path / name).is_file():
                raise _usage_error(f"--model: {model} has no {name}")
        return path
    path = cache_dir() / preset
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=path.parent))
    except OSError as e:  # SPLITSERVE_CACHE names a file, a read-only place, ...
        raise _usage_error(f"SPLITSERVE_CACHE: cannot create {path.parent}: {e.strerror}") from None
    print(f"building the {preset} model once into {path} ...", flush=True)
    try:
        built = subprocess.run(splitserve_cmd("make-model", "--preset", preset, "--out", str(tmp)))
        if built.returncode != 0:  # make-model has printed why (e.g. an unknown preset)
            raise _usage_error(f"--preset: building {preset!r} failed") from None
        try:
            tmp.rename(path)  # atomic: a concurrent `up` either sees all of it or none
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if `up` itself dies, even by SIGKILL — no orphans.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    log_path: Path
    proc: asyncio.subprocess.Process = field(init=False)  # the latest process (restarts)
    port: int = 0
    metrics_port: int = 0
    stdout: list[str] = field(default_factory=list)
    retiring: bool = False  # told to stop (scale-down): its exit is not a failure
    args: list[str] = field(default_factory=list)  # its command line after `splitserve`
    restarts: list[float] = field(default_factory=list)  # monotonic times it was restarted
    host: str = "127.0.0.1"  # where its /health is asked
    ready: bool = False  # started and not exited since (what the liveness probe looks at)
    alive_at: float = 0.0  # monotonic time it last answered /health (or became ready)

    @property
    def health_url(self) -> str:
        # Workers answer /health on their metrics port, the router on its API port.
        return f"http://{self.host}:{self.metrics_port or self.port}/health"

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class LocalStack:
    """Starts, watches, restarts and stops the child processes."""

    def __init__(self, log_dir: Path, threads_per_child: int) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        # Children that exited on their own after starting (not told to), in exit order.
        self._exited: asyncio.Queue[Child] = asyncio.Queue()
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env.setdefault(var, str(threads_per_child))

    async def start(self, name: str, args: list[str]) -> Child:
        child = Child(name, self.log_dir / f"{name}.log", args=list(args))
        self.children.append(child)
        try:
            await self._launch(child, "wb")
        except RuntimeError:
            # Not started is not a child: forget it, so its exit is not taken for a crash.
            self.children.remove(child)
            raise
        return child

    async def restart(self, child: Child) -> None:
        """Starts an exited child again with the same command line, on the ports it had (so
        the router and the autoscaler find it where they knew it); its log continues.
        RuntimeError when it does not start."""
        child.args = _pinned_ports(child.args, child.port, child.metrics_port)
        child.restarts.append(time.monotonic())
        await self._launch(child, "ab")

    async def _launch(self, child: Child, log_mode: str) -> None:
        child.ready = False
        with open(child.log_path, log_mode) as log_file:
            proc = await asyncio.create_subprocess_exec(
                *splitserve_cmd(*child.args),
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                stdin=asyncio.subprocess.DEVNULL,
                env=self.env,
                preexec_fn=_die_with_parent,
            )
        child.proc = proc
        ready: asyncio.Future[re.Match[str]] = asyncio.get_running_loop().create_future()

        async def pump() -> None:
            # Read stdout for the child's whole life so it never blocks on a full pipe.
            assert proc.stdout is not None
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                child.stdout.append(line)
                m = READY_RE.match(line)
                if m and not ready.done():
                    ready.set_result(m)
            if not ready.done():
                ready.set_exception(RuntimeError("exited before it was ready"))
                return
            await proc.wait()
            child.ready = False
            if not child.retiring:
                self._exited.put_nowait(child)

        asyncio.get_running_loop().create_task(pump())
        try:
            m = await asyncio.wait_for(ready, START_TIMEOUT_S)
            child.port, child.metrics_port = int(m["port"]), int(m["metrics"] or 0)
            child.ready, child.alive_at = True, time.monotonic()
        except (TimeoutError, RuntimeError) as e:
            # Stop it (if it still runs), so its later exit is not taken for a crash.
            child.retiring = True
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"{child.name} did not start ({e or 'timed out'}); its log "
                f"{child.log_path}:\n{child.log_tail()}"
            ) from None

    async def wait_any_exit(self) -> Child:
        """The next started child that exits without being told to; children started (or
        restarted) later count too."""
        return await self._exited.get()

    async def stop(self) -> None:
        """SIGTERM in reverse start order (the router first, so nothing new reaches the pools),
        then SIGKILL whatever has not exited in time."""
        for child in reversed(self.children):
            if child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                await asyncio.wait_for(child.proc.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()


# ---- reading the router's metrics ----------------------------------------------------------


class LiveLine:
    """TTFT/TPOT over the last interval, from the router's cumulative histograms."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float, list[tuple[float, float]]]] = {}
        self._finished = 0.0

    def update(self, text: str) -> str | None:
        page = parse_page(text)
        parts = []
        # Requests finished, whatever their status: a request with n choices observes n TTFTs.
        finished = page.get(("splitserve_requests_total", ""), 0.0)
        old_finished = self._finished
        if finished < old_finished:  # the router was restarted: its counters began again
            old_finished = 0.0
        self._finished = finished
        new_requests = finished - old_finished
        for key, metric in (
            ("TTFT", "splitserve_time_to_first_token_seconds"),
            ("TPOT", "splitserve_time_per_output_token_seconds"),
        ):
            total = page.get((metric + "_sum", ""), 0.0)
            count = page.get((metric + "_count", ""), 0.0)
            cumulative = buckets(page, metric)
            old_total, old_count, old_buckets = self._last.get(key, (0.0, 0.0, []))
            if count < old_count:  # the router was restarted: its counters began again
                old_total, old_count, old_buckets = 0.0, 0.0, []
            self._last[key] = (total, count, cumulative)
            n = count - old_count
            if n <= 0:
                continue
            old = dict(old_buckets)
            window = [(le, c - old.get(le, 0.0)) for le, c in cumulative]
            p90 = histogram_quantile(0.9, window)
            p90_text = f", p90 ~{p90 * 1000:.0f} ms" if p90 is not None else ""
            parts.append(f"{key} mean {(total - old_total) / n * 1000:.1f} ms{p90_text}")
        if not parts:
            return None
        return f"{int(new_requests)} new request(s) | " + " | ".join(parts)


# One-off reads whose failure ends the command: generous, since a busy machine answers slowly.
# The live line's periodic read keeps the short default so it never delays a Ctrl-C for long.
STARTUP_GET_TIMEOUT_S = 60.0


def _api_headers() -> dict[str, str]:
    """The router inherits SPLITSERVE_API_KEY from this process: local mode's own API calls
    (the model name, the demo) send its first key."""
    from splitserve_workers.router.auth import ENV_VAR

    keys = [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


async def _get(url: str, timeout: float = 5.0) -> str:
    import aiohttp

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.get(url, headers=_api_headers()) as r,
    ):
        return await r.text()


async def _wait_ready(base: str, timeout: float = 120.0) -> None:
    """The router is listening; wait until it has seen a healthy worker in every pool."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with s.get(base + "/ready") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not become ready (no healthy workers)")
            await asyncio.sleep(0.2)


# ---- the demo ------------------------------------------------------------------------------


async def stream_chat(
    base: str,
    model: str,
    prompt: str,
    max_tokens: int = 32,
    echo: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streaming chat request over plain HTTP/SSE (`extra`: more request fields); returns
    text and measured latencies."""
    import aiohttp

    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = time.monotonic()
    first: float | None = None
    last = start
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + "/v1/chat/completions", json=body, headers=_api_headers()) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                delta = choice.get("delta", {}).get("content") or ""
                text.append(delta)
                if echo and delta:
                    print(delta, end="", flush=True)
    if echo:
        print(flush=True)
    n = int(usage.get("completion_tokens", 0))
    ttft = (first or last) - start
    tpot = (last - (first or last)) / (n - 1) if n > 1 else 0.0
    return {
        "text": "".join(text),
        "ttft": ttft,
        "tpot": tpot,
        "tokens": n,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
    }


async def run_demo(base: str, model: str, random_weights: bool) -> None:
    if random_weights:
        print(
            "(the built-in model has random weights: its text is noise; the requests, the "
            "streaming and the timings are real)"
        )
    results = []
    total = len(DEMO_PROMPTS) + 1
    for i, prompt in enumerate(DEMO_PROMPTS, 1):
        print(f"\n[{i}/{total}] user: {prompt}\nassistant: ", end="", flush=True)
        results.append(await stream_chat(base, model, prompt))
    print(
        f"\n[{total}/{total}] user: {DEMO_SCHEMA_PROMPT}  (response_format: a JSON schema)"
        "\nassistant: ",
        end="",
        flush=True,
    )
    schema_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": DEMO_SCHEMA}}
    result = await stream_chat(
        base, model, DEMO_SCHEMA_PROMPT, 64, extra={"response_format": schema_format}
    )
    results.append(result)
    try:
        keys = sorted(json.loads(result["text"]))
        print(f"(valid JSON with keys {', '.join(keys)}: the grammar, not the weights)")
    except ValueError:
        print("(not valid JSON: cut by max_tokens)")
    print("\n request  prompt tok  output tok   TTFT (ms)   TPOT (ms)")
    for i, r in enumerate(results, 1):
        print(
            f"   {i:>3}   {r['prompt_tokens']:>9}  {r['tokens']:>10}  {r['ttft'] * 1000:>10.1f}"
            f"  {r['tpot'] * 1000:>10.2f}"
        )
    line = LiveLine().update(await _get(base + "/metrics", timeout=STARTUP_GET_TIMEOUT_S))
    if line:
        print(f"router metrics: {line}")


# ---- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: build a tiny model once)")
    parser.add_argument(
        "--preset", default=DEFAULT_PRESET, help="make-model preset used when --model is not given"
    )
    parser.add_argument("--config", help="ServingConfig YAML passed to every process")
    parser.add_argument(
        "--log-requests",
        action="store_true",
        help="the router logs one JSON line per request (in its log file under the logs folder)",
    )
    parser.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    parser.add_argument(
        "--colocated",
        type=int,
        default=None,
        help="colocated workers instead of prefill+decode pools",
    )
    parser.add_argument(
        "--port", type=int, help="router port (default 8000; with --demo a free one; 0 = free)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="router listen address")
    parser.add_argument("--device", default="auto", help="worker device: auto|cpu|cuda|cuda:N")
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        help="decode and colocated workers verify up to this many draft tokens per sequence "
        "per pass, found by n-gram lookup in the prompt and output (default 0: off)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="send a few streaming requests, print them, stop and exit",
    )
    parser.add_argument(
        "--stats-interval", type=float, default=5.0, help="seconds between live TTFT/TPOT lines"
    )
    parser.add_argument("--log-dir", help="where child logs go (default: a temp dir)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="a process that exits on its own is started again on its ports, unless it was "
        f"restarted this many times in the last {RESTART_WINDOW_S:.0f} s; then everything "
        f"stops (default {DEFAULT_MAX_RESTARTS}; 0: stop at the first exit)",
    )
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT_S,
        metavar="SECONDS",
        help="a process whose /health has not answered for this long (stopped, or its event "
        "loop blocked) is killed and restarted as one that exited "
        f"(default {DEFAULT_LIVENESS_TIMEOUT_S:.0f}; 0: never)",
    )
    scaling = parser.add_argument_group(
        "autoscaling",
        "size the prefill and decode pools from their measured TTFT, TPOT, utilization and KV "
        "usage against the objectives (the operator's Builtin autoscaler, reading the "
        "processes' /metrics); --prefill/--decode are the starting sizes",
    )
    scaling.add_argument("--autoscale", action="store_true", help="scale the pools while up")
    for pool in ("prefill", "decode"):
        scaling.add_argument(
            f"--min-{pool}",
            type=int,
            help=f"fewest {pool} workers, 0 to let the pool sleep when idle (default 1)",
        )
        scaling.add_argument(f"--max-{pool}", type=int, help=f"most {pool} workers (default 4)")
    scaling.add_argument("--slo-ttft", help="TTFT objective, e.g. 500ms (default 500ms)")
    scaling.add_argument("--slo-tpot", help="TPOT objective, e.g. 50ms (default 50ms)")
    scaling.add_argument(
        "--slo-percentile", type=float, help="percentile the objectives hold at (default 95)"
    )
    scaling.add_argument(
        "--scale-interval", type=float, help="seconds between evaluations (default 5)"
    )
    scaling.add_argument(
        "--scale-down-stabilization",
        type=float,
        help="seconds every recommendation must agree before a pool shrinks (default 60)",
    )
    for bound, word in (("min", "fewest"), ("max", "most")):
        scaling.add_argument(
            f"--{bound}-prefill-per-decode",
            type=float,
            help=f"{word} prefill workers per decode worker, e.g. 0.5 (default: unbounded)",
        )
    for flag, what, default in TARGET_FLAGS:
        scaling.add_argument(f"--{flag}", type=float, help=f"{what} (default {default:g})")


AUTOSCALE_FLAGS = (
    "min_prefill",
    "max_prefill",
    "min_decode",
    "max_decode",
    "slo_ttft",
    "slo_tpot",
    "slo_percentile",
    "scale_interval",
    "scale_down_stabilization",
    "min_prefill_per_decode",
    "max_prefill_per_decode",
    "target_utilization",
    "target_kv_usage",
    "target_queue_share",
)
# The operator's spec.autoscaling.targets: flag, help, default.
TARGET_FLAGS = (
    ("target-utilization", "prefill busy seconds per second per worker to size for", 0.7),
    ("target-kv-usage", "decode KV cache usage per worker to size for", 0.8),
    (
        "target-queue-share",
        "TTFT over its objective adds prefill workers only when queueing is this share of it",
        0.2,
    ),
)


@dataclass(frozen=True)
class AutoscaleSettings:
    bounds: dict[str, tuple[int, int]]  # pool -> (min, max)
    ttft_seconds: float
    tpot_seconds: float
    percentile: float
    interval: float
    stabilization: float
    prefill_per_decode: tuple[float | None, float | None] = (None, None)  # (min, max)
    targets: tuple[float, float, float] = (0.7, 0.8, 0.2)  # utilization, KV usage, queue share


def _check_autoscale(
    args: argparse.Namespace, counts: tuple[int, int, int]
) -> AutoscaleSettings | None:
    """--autoscale's flags, checked before anything starts; None without --autoscale."""
    given = [f for f in AUTOSCALE_FLAGS if getattr(args, f, None) is not None]
    if not args.autoscale:
        if given:
            raise _usage_error(f"--{given[0].replace('_', '-')} needs --autoscale")
        return None
    if counts[2]:
        raise _usage_error("--autoscale sizes prefill and decode pools, not --colocated")
    from splitserve_operator.spec import SpecError, parse_duration

    bounds = {}
    for pool, start in (("prefill", counts[0]), ("decode", counts[1])):
        low = 1 if getattr(args, f"min_{pool}") is None else getattr(args, f"min_{pool}")
        high = 4 if getattr(args, f"max_{pool}") is None else getattr(args, f"max_{pool}")
        if low < 0:
            raise _usage_error(f"--min-{pool}: {low} must be >= 0")
        if high < low:
            raise _usage_error(f"--max-{pool}: {high} is below --min-{pool} {low}")
        if not low <= start <= high:
            raise _usage_error(f"--{pool}: {start} workers is outside [{low}, {high}]")
        bounds[pool] = (low, high)
    try:
        ttft = parse_duration(args.slo_ttft or "500ms", "--slo-ttft")
        tpot = parse_duration(args.slo_tpot or "50ms", "--slo-tpot")
    except SpecError as e:
        raise _usage_error(str(e)) from None
    percentile = 95.0 if args.slo_percentile is None else args.slo_percentile
    if not 0 < percentile < 100:
        raise _usage_error(f"--slo-percentile: {percentile} must be in (0, 100)")
    # argparse's float() takes "nan" and "inf": an infinite interval never evaluates, and a NaN
    # window compares false to every age, so an idle pool would never shrink.
    interval = 5.0 if args.scale_interval is None else args.scale_interval
    if not (interval > 0 and math.isfinite(interval)):
        raise _usage_error(f"--scale-interval: {interval} must be positive and finite")
    window = 60.0 if args.scale_down_stabilization is None else args.scale_down_stabilization
    if not (window >= 0 and math.isfinite(window)):
        raise _usage_error(f"--scale-down-stabilization: {window} must be >= 0 and finite")
    ratio = _check_ratio(args, bounds)
    targets = []
    for (flag, _what, default), low_open in zip(TARGET_FLAGS, (True, True, False), strict=True):
        value = getattr(args, flag.replace("-", "_"))
        value = default if value is None else value
        if not (0 < value <= 1 if low_open else 0 <= value <= 1):
            interval = "(0, 1]" if low_open else "[0, 1]"
            raise _usage_error(f"--{flag}: {value:g} must be in {interval}")
        targets.append(value)
    return AutoscaleSettings(
        bounds,
        ttft,
        tpot,
        percentile,
        interval,
        window,
        ratio,
        (targets[0], targets[1], targets[2]),
    )


def _check_ratio(
    args: argparse.Namespace, bounds: dict[str, tuple[int, int]]
) -> tuple[float | None, float | None]:
    from splitserve_operator.autoscaler import RatioBounds, unreachable_ratio

    low, high = args.min_prefill_per_decode, args.max_prefill_per_decode
    for flag, value in (("--min-prefill-per-decode", low), ("--max-prefill-per-decode", high)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise _usage_error(f"{flag}: {value:g} must be a finite number greater than 0")
    if low is not None and high is not None and low > high:
        raise _usage_error(
            f"--min-prefill-per-decode: {low:g} is above --max-prefill-per-decode {high:g}"
        )
    which = unreachable_ratio(RatioBounds(low, high), bounds["prefill"], bounds["decode"])
    if which == "max":
        raise _usage_error(
            f"--max-prefill-per-decode: {high:g} cannot hold: --min-prefill "
            f"{bounds['prefill'][0]} needs more than --max-decode {bounds['decode'][1]} "
            "decode workers"
        )
    if which == "min":
        raise _usage_error(
            f"--min-prefill-per-decode: {low:g} cannot hold: --min-decode "
            f"{bounds['decode'][0]} needs more than --max-prefill {bounds['prefill'][1]} "
            "prefill workers"
        )
    if which == "both":
        raise _usage_error(
            f"--min-prefill-per-decode {low:g} and --max-prefill-per-decode {high:g} cannot "
            f"both hold for any worker counts within --min/--max-prefill {bounds['prefill']} "
            f"and --min/--max-decode {bounds['decode']}"
        )
    return low, high


def _usage_error(message: str) -> SystemExit:
    # Exit 2 like argparse and the worker commands: bad input, named, nothing started.
    print(f"splitserve up: {message}", file=sys.stderr)
    return SystemExit(2)


def _router_port(args: argparse.Namespace) -> int:
    # The demo exits by itself: any free port, so it never collides with a real `up`.
    return int(args.port if args.port is not None else (0 if args.demo else 8000))


def _check_port_free(host: str, port: int) -> None:
    """Fail before any worker loads a model when the router's port is taken. Same
    SO_REUSEADDR as aiohttp, so a port in TIME_WAIT does not count as taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise _usage_error(f"--host: cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise _usage_error(f"--port: cannot listen on {host}:{port}: {e.strerror}") from None


def _check_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    if args.port is not None and not 0 <= args.port <= 65535:
        raise _usage_error(f"--port: {args.port} must be in [0, 65535]")
    if not args.stats_interval > 0:
        raise _usage_error(f"--stats-interval: {args.stats_interval} must be positive")
    if args.max_restarts < 0:
        raise _usage_error(f"--max-restarts: {args.max_restarts} must be >= 0")
    if not args.liveness_timeout >= 0:  # NaN too
        raise _usage_error(f"--liveness-timeout: {args.liveness_timeout} must be >= 0")
    device = args.device
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        # Every worker would refuse it after importing torch; `up` exited 1 with one's log.
        raise _usage_error(f"--device: {device!r} is not one of auto, cpu, cuda, cuda:N")
    spec = args.speculative_tokens
    if spec is not None and not 0 <= spec <= MAX_SPECULATIVE_TOKENS:
        raise _usage_error(f"--speculative-tokens: {spec} not in [0, {MAX_SPECULATIVE_TOKENS}]")
    if args.colocated is not None:
        if args.prefill is not None or args.decode is not None:
            raise _usage_error("use --colocated K or --prefill N --decode M, not both")
        if args.colocated < 1:
            raise _usage_error(f"--colocated: {args.colocated} must be >= 1")
        return 0, 0, args.colocated
    prefill = 1 if args.prefill is None else args.prefill
    decode = 1 if args.decode is None else args.decode
    if prefill < 1 or decode < 1:
        raise _usage_error(f"--prefill/--decode: {prefill}/{decode} must be >= 1")
    return prefill, decode, 0


async def _up(
    args: argparse.Namespace,
    model: Path,
    counts: tuple[int, int, int],
    log_dir: Path,
    autoscale: AutoscaleSettings | None = None,
) -> int:
    n_prefill, n_decode, n_colocated = counts
    n_workers = n_prefill + n_decode + n_colocated
    if autoscale:  # threads for the most workers it may run at once
        n_workers = sum(high for _, high in autoscale.bounds.values())
    stack = LocalStack(log_dir, max(1, (os.cpu_count() or 1) // n_workers))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    common = [
        "--model",
        str(model),
        "--device",
        args.device,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
    ]
    if args.config:
        common += ["--config", args.config]
    if args.speculative_tokens is not None:
        common += ["--speculative-tokens", str(args.speculative_tokens)]
    try:
        specs = (
            [("prefill", i) for i in range(n_prefill)]
            + [("decode", i) for i in range(n_decode)]
            + [("colocated", i) for i in range(n_colocated)]
        )
        starting = asyncio.gather(
            *(stack.start(f"{role}-{i}", [role, *common]) for role, i in specs)
        )
        stopper = asyncio.ensure_future(stop.wait())
        first: set[asyncio.Future[Any]] = {starting, stopper}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            starting.cancel()
            return 130
        stopper.cancel()
        workers = starting.result()

        def endpoints(role: str) -> str:
            return ",".join(f"127.0.0.1:{c.port}" for c in workers if c.name.startswith(role))

        router_args = [
            "router",
            "--model",
            str(model),
            "--port",
            str(_router_port(args)),
            "--host",
            args.host,
        ]
        if args.config:
            router_args += ["--config", args.config]
        if args.log_requests:
            router_args.append("--log-requests")
        scaler = None
        if autoscale:
            scaler = _local_autoscaler(stack, common, log_dir, autoscale)
            for pool in ("prefill", "decode"):
                scaler.adopt(pool, [c for c in workers if c.name.startswith(pool)])
            scaler.publish()
            router_args += ["--workers-file", str(scaler.workers_file)]
            if any(low == 0 for low, _ in autoscale.bounds.values()):
                # A pool may reach zero: the router stays ready, and a request waits while the
                # autoscaler starts a worker for it (a cold start: torch import, model load).
                router_args += ["--ready-without-workers", "--empty-pool-wait", "120"]
        elif n_colocated:
            router_args += ["--colocated", endpoints("colocated")]
        else:
            router_args += ["--prefill", endpoints("prefill"), "--decode", endpoints("decode")]
        router = await stack.start("router", router_args)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        router.host = host
        base = f"http://{host}:{router.port}"
        await _wait_ready(base)
        models = json.loads(await _get(base + "/v1/models", timeout=STARTUP_GET_TIMEOUT_S))
        model_name = models["data"][0]["id"]
        shape = (
            f"{n_colocated} colocated"
            if n_colocated
            else f"{n_prefill} prefill + {n_decode} decode"
        )
        print(
            f"splitserve is up: {base}/v1 (model {model_name!r}, {shape} worker(s), "
            f"logs in {log_dir})",
            flush=True,
        )
        print(f"READY role=up port={router.port}", flush=True)
        if args.demo:
            demo = asyncio.ensure_future(run_demo(base, model_name, random_weights=not args.model))
            stopper = asyncio.ensure_future(stop.wait())
            racing: set[asyncio.Future[Any]] = {demo, stopper}
            done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if demo not in done:
                demo.cancel()
                return 130
            demo.result()  # raises what the demo hit
            return 0
        print("press Ctrl-C to stop", flush=True)
        if scaler is None:
            return await _watch(
                stack, base, stop, args.stats_interval, args.max_restarts, args.liveness_timeout
            )
        scaler.router_metrics_url = base + "/metrics"
        print(f"autoscaling: {scaler.describe()}", flush=True)
        scaling = asyncio.ensure_future(scaler.run(stop))
        try:
            return await _watch(
                stack,
                base,
                stop,
                args.stats_interval,
                args.max_restarts,
                args.liveness_timeout,
                scaler.sizes,
            )
        finally:
            scaling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scaling
    except RuntimeError as e:
        print(f"splitserve up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping ...", flush=True)
        await stack.stop()


def _local_autoscaler(
    stack: LocalStack, worker_args: list[str], log_dir: Path, settings: AutoscaleSettings
) -> LocalAutoscaler:
    from splitserve_operator.autoscaler import Objectives, RatioBounds, Targets

    from splitserve_workers.local_scaling import Bounds, LocalAutoscaler

    def say(line: str) -> None:
        print(line, flush=True)

    return LocalAutoscaler(
        stack,
        worker_args,
        log_dir / "workers.json",
        {pool: Bounds(low, high) for pool, (low, high) in settings.bounds.items()},
        Objectives(settings.ttft_seconds, settings.tpot_seconds, settings.percentile),
        settings.interval,
        settings.stabilization,
        ratio=RatioBounds(*settings.prefill_per_decode),
        targets=Targets(*settings.targets),
        say=say,
    )


async def _watch(
    stack: LocalStack,
    base: str,
    stop: asyncio.Event,
    interval: float,
    max_restarts: int,
    liveness_timeout: float,
    sizes: Callable[[], str] | None = None,
) -> int:
    """Prints the live line until Ctrl-C. A child that exits on its own is started again on
    its ports (what it had in flight is lost; its clients got their error), unless it has
    already been restarted max_restarts times in the last RESTART_WINDOW_S seconds (a crash
    loop) or does not come back: then `up` stops everything and exits 1. A child that stops
    answering /health for liveness_timeout seconds (0: never) is killed first."""
    live = LiveLine()
    exited = asyncio.ensure_future(stack.wait_any_exit())
    stopper = asyncio.ensure_future(stop.wait())
    restarting: set[asyncio.Future[bool]] = set()
    prober = asyncio.ensure_future(_liveness(stack, liveness_timeout)) if liveness_timeout else None
    try:
        while True:
            waiting: set[asyncio.Future[Any]] = {exited, stopper, *restarting}
            done, _ = await asyncio.wait(
                waiting, timeout=interval, return_when=asyncio.FIRST_COMPLETED
            )
            if stopper in done:
                return 0
            for task in [t for t in restarting if t in done]:
                restarting.discard(task)
                if not task.result():
                    return 1
            if exited in done:
                restarting.add(
                    asyncio.ensure_future(_restart(stack, exited.result(), max_restarts))
                )
                exited = asyncio.ensure_future(stack.wait_any_exit())
            with contextlib.suppress(Exception):
                line = live.update(await _get(base + "/metrics"))
                if line:
                    pools = f" | pools: {sizes()}" if sizes else ""
                    print(f"[{time.strftime('%H:%M:%S')}] {line}{pools}", flush=True)
    finally:
        exited.cancel()
        stopper.cancel()
        if prober is not None:
            prober.cancel()
        for task in restarting:
            task.cancel()


async def _answers(url: str, timeout: float) -> bool:
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.get(url) as r,
        ):
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _liveness(stack: LocalStack, timeout_s: float) -> None:
    """Kills a child whose /health has not answered for timeout_s seconds: a stopped process,
    or one whose event loop is blocked, serves nothing and never exits by itself. Its exit
    then takes the same path as a crash's (_watch restarts it). Like a pod's liveness probe,
    it cannot see an engine thread stuck behind a healthy event loop."""
    period = max(0.2, min(5.0, timeout_s / 4))

    async def probe(child: Child) -> None:
        if await _answers(child.health_url, timeout=period):
            child.alive_at = time.monotonic()
            return
        silent = time.monotonic() - child.alive_at
        if child.ready and not child.retiring and silent > timeout_s:
            print(
                f"splitserve up: {child.name} (pid {child.proc.pid}) has not answered "
                f"{child.health_url} for {silent:.0f} s; killing it",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()

    while True:
        await asyncio.sleep(period)
        watched = [c for c in stack.children if c.ready and not c.retiring]
        await asyncio.gather(*(probe(c) for c in watched))


async def _restart(stack: LocalStack, child: Child, max_restarts: int) -> bool:
    """Starts an exited child again; False (said why) when it should not or did not."""
    if child.retiring:  # the autoscaler retired it meanwhile: nothing to bring back
        return True
    now = time.monotonic()
    recent = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
    why = f"{child.name} exited with {child.proc.returncode}"
    if len(recent) >= max_restarts:
        loop = f" ({len(recent)} restarts in {RESTART_WINDOW_S:.0f} s)" if recent else ""
        print(
            f"splitserve up: {why}{loop}; not restarting it (--max-restarts {max_restarts}); "
            f"its log:\n{child.log_tail()}",
            file=sys.stderr,
            flush=True,
        )
        return False
    print(
        f"splitserve up: {why}; restarting it on port {child.port} (what it had in flight is "
        f"lost); its log {child.log_path} ends:\n{child.log_tail(10)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stack.restart(child)
    except RuntimeError as e:
        print(f"splitserve up: {e}", file=sys.stderr, flush=True)
        return False
    print(f"[{time.strftime('%H:%M:%S')}] {child.name} is back on port {child.port}", flush=True)
    return True


def _pinned_ports(args: list[str], port: int, metrics_port: int) -> list[str]:
    """args with the values of --port and --metrics-port set to these ports."""
    out = list(args)
    for flag, value in (("--port", port), ("--metrics-port", metrics_port)):
        if flag in out[:-1]:
            out[out.index(flag) + 1] = str(value)
    return out


def run(args: argparse.Namespace) -> int:
    counts = _check_counts(args)
    autoscale = _check_autoscale(args, counts)
    if args.config:  # every child would fail on it after loading torch: say so once, now
        from splitserve_workers.config import ConfigError, ServingConfig

        try:
            ServingConfig.load(args.config)
        except ConfigError as e:
            raise _usage_error(str(e)) from None
    if _router_port(args):
        _check_port_free(args.host, _router_port(args))
    model = ensure_model(args.model, args.preset)
    if args.log_dir:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="splitserve-up-"))
    return asyncio.run(_up(args, model, counts, log_dir, autoscale))
