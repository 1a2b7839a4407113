"""`splitserve up` as a user runs it: `--demo` on a fresh cache builds the tiny model, starts the
pools and the router, streams a few answers and exits 0 by itself; a long-running `up` restarts
a worker killed under it on the same port and stops all its children on SIGTERM (no orphans);
with `--max-restarts 0` the first exit stops everything; a frozen (SIGSTOPped) worker is killed by
the liveness probe and restarted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow

# Bounds a hang (torch imports and model loads on a busy machine); nothing here is timed.
DEMO_TIMEOUT_S = 900


def up_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve_workers.cli", "up", *args]


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
    return env


def start_up(
    model: Path, log_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`splitserve up` on `model`, on the CPU and a free port, its logs in log_dir; its stdout
    and stderr merged into one text pipe."""
    return subprocess.Popen(
        up_cmd(
            "--model",
            str(model),
            "--port",
            "0",
            "--device",
            "cpu",
            "--log-dir",
            str(log_dir),
            *args,
        ),  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or env_with(),
    )


def follow(proc: subprocess.Popen[str]) -> tuple[list[str], int]:
    """Collects `up`'s output lines from a thread into the list returned (it keeps growing)
    and waits until `up` is ready; the router's port."""
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY role=up"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not (ready.wait(DEMO_TIMEOUT_S) and proc.poll() is None):
        proc.kill()
        raise AssertionError("".join(lines))
    return lines, int(next(x for x in lines if x.startswith("READY role=up")).split("=")[-1])


def test_up_demo_on_a_fresh_cache_runs_and_exits_zero(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = subprocess.run(
        up_cmd("--port", "0", "--device", "cpu", "--demo", "--log-dir", str(tmp_path / "logs")),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env_with(SPLITSERVE_CACHE=str(cache)),
    )
    out = result.stdout
    assert result.returncode == 0, f"{out[-3000:]}\n{result.stderr[-3000:]}"
    # Built the model once into the cache it was given.
    assert (cache / "models" / "tiny-llama" / "config.json").is_file()
    assert re.search(r"splitserve is up: http://127\.0\.0\.1:\d+/v1", out)
    assert out.count("assistant: ") == 4
    # The last answer is held to a JSON schema: valid JSON even from random weights.
    assert "(valid JSON with keys age, indoor, name: the grammar, not the weights)" in out
    table = re.findall(r"^\s+\d+\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert len(table) == 4, out
    for prompt_tokens, output_tokens, ttft_ms, _tpot_ms in table:
        assert int(prompt_tokens) > 0 and int(output_tokens) > 0 and float(ttft_ms) > 0
    assert "stopping" in out


def test_up_stops_every_child_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    proc = start_up(
        tiny_model, tmp_path, "--prefill", "1", "--decode", "2", "--stats-interval", "0.5",
        "--log-requests",
        # With an API key in the environment the router requires it, and local mode's own
        # calls (the model name, the live line's scrape) still work.
        env=env_with(SPLITSERVE_API_KEY="sk-local"),
    )  # fmt: skip
    lines, port = follow(proc)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        roles = sorted(c.cmdline()[3] for c in children if "splitserve_workers.cli" in c.cmdline())
        assert roles == ["decode", "decode", "prefill", "router"]
        # It serves (with the key only), and the live line reports what it measured.
        url, body = f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hello", "max_tokens": 8}
        assert httpx.post(url, json=body, timeout=120).status_code == 401
        key = {"Authorization": "Bearer sk-local"}
        answer = httpx.post(url, json=body, headers=key, timeout=120)
        assert answer.status_code == 200
        # --log-requests reaches the router: its log file has the request's line.
        logged = (tmp_path / "router.log").read_text()
        assert f'splitserve.requests: {{"id":"{answer.json()["id"]}"' in logged, logged[-2000:]
        deadline = time.monotonic() + 60
        while not any("TTFT mean" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("TTFT mean" in line for line in lines), "".join(lines)

        # A worker killed under it is started again on the same ports and serves again.
        decode = next(c for c in children if c.cmdline()[3:4] == ["decode"])
        decode.kill()
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while not any(re.search(r"decode-\d is back on port", x) for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert any("exited with -9; restarting it on port" in x for x in lines), "".join(lines)
        now = psutil.Process(proc.pid).children(recursive=True)
        decodes = [c for c in now if c.cmdline()[3:4] == ["decode"]]
        assert len(decodes) == 2 and decode.pid not in [c.pid for c in decodes]
        back = next(c for c in decodes if c.pid not in [x.pid for x in children])
        assert back.cmdline()[back.cmdline().index("--port") + 1] != "0"  # pinned to its port
        for _ in range(4):  # whichever decode worker the router picks
            assert httpx.post(url, json=body, headers=key, timeout=120).status_code == 200
        children = now

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "".join(lines)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_up_with_max_restarts_0_stops_at_the_first_exit(tiny_model: Path, tmp_path: Path) -> None:
    proc = start_up(tiny_model, tmp_path, "--colocated", "1", "--max-restarts", "0")
    try:
        assert proc.stdout is not None
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith("READY role=up"):
                break
        worker = next(
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if c.cmdline()[3:4] == ["colocated"]
        )
        worker.kill()
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, "".join(out) + rest
        assert "colocated-0 exited with -9; not restarting it (--max-restarts 0)" in rest
        assert "stopping" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_up_kills_and_restarts_a_frozen_worker(tiny_model: Path, tmp_path: Path) -> None:
    # A stopped process never exits by itself: only the liveness probe can tell it is gone.
    proc = start_up(tiny_model, tmp_path, "--colocated", "1", "--liveness-timeout", "4")
    lines, port = follow(proc)
    try:
        worker = next(
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if c.cmdline()[3:4] == ["colocated"]
        )
        worker.suspend()  # SIGSTOP
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while not any("colocated-0 is back on port" in x for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        said = "".join(lines)
        assert re.search(r"colocated-0 \(pid \d+\) has not answered \S+/health for \d+ s", said)
        assert "colocated-0 exited with -9; restarting it on port" in said
        assert not worker.is_running()
        # Only the frozen worker was killed: the router kept serving and reaches the new one.
        assert "router exited" not in said
        url, body = f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hello", "max_tokens": 4}
        assert httpx.post(url, json=body, timeout=120).status_code == 200
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
