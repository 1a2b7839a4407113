"""`splitserve up --autoscale` with real processes: load that breaks the TPOT objective adds a
decode worker (started, then published to the router), and a prefill worker with it to keep
at least one prefill worker per decode worker; once the load is gone the idlest worker of each
pool is retired after the stabilization window: it leaves the router's workers file, drains
and exits 0. Every request made meanwhile completes; nothing here is timed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from test_local_up import start_up

pytestmark = pytest.mark.slow

# Bounds on waits so a broken build fails instead of hanging (torch imports on a busy machine).
WAIT_S = 600.0


class Output:
    """The lines a running `splitserve up` prints, read on a thread; `wait_line` waits for one
    matching a pattern (until `until`, or the process exits) and fails showing them all."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_line(self, pattern: str, until: float | None = None) -> re.Match[str]:
        regex = re.compile(pattern)
        until = time.monotonic() + WAIT_S if until is None else until
        with self.changed:
            while True:
                found = next((m for line in self.lines if (m := regex.search(line))), None)
                if found or self.proc.poll() is not None or time.monotonic() > until:
                    break
                self.changed.wait(1.0)
        assert found, f"no line matching {pattern!r}:\n" + "".join(self.lines)
        return found


def test_up_autoscale_adds_and_retires_a_decode_worker(tiny_model: Path, tmp_path: Path) -> None:
    proc = start_up(
        tiny_model, tmp_path, "--autoscale", "--max-decode", "2", "--max-prefill", "2",
        # Prefill's own signals never ask for more here; this bound does.
        "--min-prefill-per-decode", "1",
        # Any measured TPOT breaks a 0.1 ms objective, so load always asks for more decode.
        "--slo-tpot", "100us", "--slo-ttft", "60s",
        "--scale-interval", "0.5", "--scale-down-stabilization", "3",
    )  # fmt: skip
    out = Output(proc)
    lines, wait_line = out.lines, out.wait_line

    def published() -> dict[str, list[str]]:
        data: dict[str, list[str]] = json.loads((tmp_path / "workers.json").read_text())
        return data

    try:
        port = int(wait_line(r"^READY role=up port=(\d+)", time.monotonic() + WAIT_S)[1])
        base = f"http://127.0.0.1:{port}"
        assert len(published()["decode"]) == 1
        first_decode = published()["decode"][0]

        # Load until the second decode worker serves: the scale-up is the autoscaler's.
        stop_load = threading.Event()
        results: list[tuple[int, int]] = []

        def client(i: int) -> None:
            with httpx.Client(timeout=WAIT_S) as c:
                while not stop_load.is_set():
                    r = c.post(
                        base + "/v1/completions",
                        json={"prompt": f"load {i}", "max_tokens": 24, "ignore_eos": True},
                    )
                    usage = r.json().get("usage", {}) if r.status_code == 200 else {}
                    results.append((r.status_code, usage.get("completion_tokens", 0)))

        with ThreadPoolExecutor(4) as pool:
            for i in range(4):
                pool.submit(client, i)
            until = time.monotonic() + WAIT_S
            wait_line(r"autoscale decode 1 -> 2: TPOT p95 \S+ is above the objective", until)
            wait_line(
                r"autoscale prefill 1 -> 2: .*; 2 to keep prefillPerDecode.min 1 with 2 decode "
                "replicas",
                until,
            )
            wait_line(r"decode-\d+ is serving", until)
            wait_line(r"prefill-\d+ is serving", until)
            assert (len(published()["prefill"]), len(published()["decode"])) == (2, 2)
            # Served by both now: a few more rounds with the new worker in the router's list.
            served = len(results)
            while len(results) < served + 8 and time.monotonic() < until:
                time.sleep(0.2)
            stop_load.set()
        assert results and all(r == (200, 24) for r in results), results[-5:]
        grew = [line for line in lines if "autoscale prefill 1 ->" in line]
        assert len(grew) == 1 and "prefillPerDecode.min" in grew[0], grew

        # Idle: after the stabilization window the idlest decode worker is retired and drains.
        until = time.monotonic() + WAIT_S
        down = wait_line(r"autoscale decode 2 -> 1: ", until)
        wait_line(r"autoscale prefill 2 -> 1: ", until)
        gone = wait_line(r"(decode-\d+) drained and exited with 0", until)
        wait_line(r"prefill-\d+ drained and exited with 0", until)
        wait_line(r"exited with 0 \(prefill 1, decode 1\)", until)
        assert (len(published()["prefill"]), len(published()["decode"])) == (1, 1)
        children = psutil.Process(proc.pid).children(recursive=True)
        roles = [c.cmdline()[3:4] for c in children]
        assert (roles.count(["prefill"]), roles.count(["decode"])) == (1, 1), roles
        print(down.string.strip(), "|", gone.string.strip(), "| first decode was", first_decode)

        # The pool that is left serves.
        r = httpx.post(
            base + "/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=WAIT_S
        )
        assert r.status_code == 200, r.text

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 0, "".join(lines)
        assert "exited with 1" not in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


async def test_a_worker_that_fails_to_start_is_forgotten(tmp_path: Path) -> None:
    # A scale-up whose worker dies before READY is reported, and its exit is not taken later
    # for the crash of a serving process (which would stop `up`).
    from splitserve_workers.local import LocalStack

    stack = LocalStack(tmp_path, threads_per_child=1)
    with pytest.raises(RuntimeError, match="decode-9 did not start"):
        await stack.start("decode-9", ["decode", "--no-such-flag"])
    assert stack.children == [] and stack._exited.empty()


def test_up_autoscale_lets_decode_sleep_and_wakes_it_for_a_request(
    tiny_model: Path, tmp_path: Path
) -> None:
    # --min-decode 0: idle, the decode pool drains to zero; a request then waits in the router
    # while the autoscaler, seeing it in flight, starts a decode worker, and is served.
    proc = start_up(
        tiny_model, tmp_path, "--autoscale", "--min-decode", "0", "--max-decode", "1",
        "--max-prefill", "1", "--scale-interval", "0.5", "--scale-down-stabilization", "2",
    )  # fmt: skip
    out = Output(proc)
    lines, wait_line = out.lines, out.wait_line
    try:
        port = int(wait_line(r"^READY role=up port=(\d+)")[1])
        base = f"http://127.0.0.1:{port}"
        wait_line(r"autoscale decode 1 -> 0: ")
        wait_line(r"decode-\d+ drained and exited with 0 \(prefill 1, decode 0\)")
        workers = json.loads((tmp_path / "workers.json").read_text())
        assert workers["decode"] == []
        assert httpx.get(base + "/ready", timeout=10).status_code == 200
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": "wake up", "max_tokens": 8, "ignore_eos": True},
            timeout=WAIT_S,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        wait_line(r"autoscale decode 0 -> 1: requests are arriving and the pool has no replicas")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def scripted_autoscaler(
    tmp_path: Path,
    now: list[float],
    answer: list[Any],
    decode: int,
    said: list[str] | None = None,
    acted: list[tuple[str, int]] | None = None,
) -> Any:
    """Local mode's autoscaler on a scripted clock and scripted decode signals (answer[0];
    None: the router's /metrics does not answer), every 2 s, scale-down after 6 s, with one
    prefill and `decode` stand-in workers; what it says and what it would do are recorded."""
    from types import SimpleNamespace

    from splitserve_operator.autoscaler import Objectives, Signals
    from splitserve_operator.prometheus import MetricsError
    from splitserve_workers.local_scaling import Bounds, LocalAutoscaler

    class Scraper:
        def scrape(self, targets: object, t: float) -> None:
            pass

        def read(self, percentile: float, window: float) -> dict[str, Signals]:
            if answer[0] is None:
                raise MetricsError("the router's /metrics did not answer")
            return {"prefill": Signals(reporting=1, latency=0.05, busy=0.3), "decode": answer[0]}

        def limit(self, pool: str, sample: str) -> int:
            return 8

    auto = LocalAutoscaler(
        SimpleNamespace(children=[]),  # type: ignore[arg-type]
        [], tmp_path / "workers.json",
        {"prefill": Bounds(1, 4), "decode": Bounds(1, 4)},
        Objectives(0.5, 0.05, 95), interval=2.0, stabilization=6.0,
        say=(said if said is not None else []).append, clock=lambda: now[0],
    )  # fmt: skip
    auto.scraper = Scraper()  # type: ignore[assignment]

    def act(name: str, decision: Any) -> None:
        if acted is not None:
            acted.append((name, decision.replicas))

    auto.act = act  # type: ignore[method-assign]
    child = SimpleNamespace(name="w", port=1, metrics_port=2)
    auto.adopt("prefill", [child])  # type: ignore[list-item]
    auto.adopt("decode", [child] * decode)  # type: ignore[list-item]
    return auto


async def test_metrics_gone_for_a_while_hold_like_the_operator(tmp_path: Path) -> None:
    # Every 2 s, scale-down after 6 s (so the signal window, 8 s, is longer). Decode needs its
    # 2 workers until t=10; then the router's /metrics does not answer for 6 s, a pause no
    # longer than the signal window, which does not restart the watch. Without the held sizes
    # counting as recommendations, the first reading after it (idle) was the whole window's
    # agreement and decode shrank at once, on one reading after a blind spot.
    from splitserve_operator.autoscaler import SCALE_DOWN, STABILIZING, Signals

    now = [0.0]
    busy = Signals(reporting=2, latency=0.04, kv_usage=0.3, running=8)
    idle = Signals(reporting=2, latency=0.001, kv_usage=0.01, running=0)
    answer: list[Signals | None] = [busy]
    auto = scripted_autoscaler(tmp_path, now, answer, decode=2)
    for t in range(0, 17, 2):
        now[0] = float(t)
        answer[0] = busy if t <= 10 else None
        decisions = await auto.evaluate()
        assert (decisions is None) == (t > 10)
    now[0], answer[0] = 18.0, idle
    decisions = await auto.evaluate()
    assert decisions is not None
    assert decisions["decode"].verdict == STABILIZING, decisions["decode"].reason
    assert "2 replicas were needed within the last 6s" in decisions["decode"].reason
    # A whole window of idle readings later, it shrinks.
    for t in (20, 22, 24):
        now[0] = float(t)
        decisions = await auto.evaluate()
    assert decisions is not None and decisions["decode"].verdict == SCALE_DOWN


async def test_a_scale_up_after_a_failed_start_is_held_and_said_once(tmp_path: Path) -> None:
    # A worker failed to start a moment ago: for one window the autoscaler starts no other,
    # says so once with what it would have done, and does not claim "1 -> 2" meanwhile.
    from splitserve_operator.autoscaler import Signals

    now = [100.0]
    late = Signals(reporting=1, latency=0.2, kv_usage=0.3, running=8)
    said: list[str] = []
    acted: list[tuple[str, int]] = []
    auto = scripted_autoscaler(tmp_path, now, [late], decode=1, said=said, acted=acted)
    auto.pools["decode"].failed_at = 99.0
    for t in (100.0, 102.0, 104.0):
        now[0] = t
        await auto.evaluate()
    decode_lines = [line for line in said if "autoscale decode" in line]
    assert len(decode_lines) == 1, said
    assert "autoscale decode 1 -> 2 held: a worker failed to start" in decode_lines[0]
    assert "TPOT p95 200ms is above the objective 50ms" in decode_lines[0]
    assert acted == []
    now[0] = 99.0 + auto.window + 1  # the backoff is over: it scales up
    await auto.evaluate()
    assert acted and acted[-1][0] == "decode" and acted[-1][1] >= 2, said
