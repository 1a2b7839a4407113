"""Shared fixtures for the data-plane tests: a tiny random-weight model made once per session with
`splitserve make-model`, and a launcher for real worker processes (`splitserve prefill|decode|
colocated|router ...`) that waits for their READY line. Worker and router tests both use these."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY_RE = re.compile(
    r"^READY role=(?P<role>\S+) port=(?P<port>\d+)(?: metrics_port=(?P<mport>\d+))?"
)
# Generous: a worker imports torch and loads a model on a busy 2-core machine. This bounds a hang,
# it does not measure anything.
START_TIMEOUT_S = 300.0


def child_env() -> dict[str, str]:
    """Environment for worker subprocesses: one thread each, so several fit on two cores."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def splitserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve_workers.cli", *args]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny-llama model directory (config.json, model.safetensors, tokenizer.json)."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    subprocess.run(
        splitserve_cmd("make-model", "--preset", "tiny-llama", "--out", str(out)),
        check=True,
        env=child_env(),
    )
    return out


@dataclass
class WorkerProcess:
    """A running `splitserve <role>` subprocess; its ports come from its READY line."""

    role: str
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int | None
    log_path: Path
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM (the worker drains) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process vanishes without draining (a crashed pod)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def launch(role: str, args: list[str], log_dir: Path, name: str | None = None) -> WorkerProcess:
    """Start `splitserve <role> <args>` and wait for its READY line (raises with the log)."""
    name = name or role
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(
        splitserve_cmd(role, *args),
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    ready: dict[str, re.Match[str]] = {}
    found = threading.Event()

    def pump() -> None:
        # Keep draining stdout for the process's whole life so it never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = READY_RE.match(line)
            if m and not found.is_set():
                ready["m"] = m
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(START_TIMEOUT_S) or "m" not in ready:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        raise RuntimeError(
            f"{name} did not become ready (exit {proc.returncode}); stdout: {lines[-20:]}\n"
            f"log:\n{log_path.read_text(errors='replace')[-4000:]}"
        )
    m = ready["m"]
    return WorkerProcess(
        role=m["role"],
        proc=proc,
        port=int(m["port"]),
        metrics_port=int(m["mport"]) if m["mport"] else None,
        log_path=log_path,
        stdout_lines=lines,
    )


@pytest.fixture
def launch_worker(tmp_path: Path) -> Iterator:
    """Factory: `launch_worker("decode", [...args])`; every process is killed at teardown."""
    started: list[WorkerProcess] = []
    counter = [0]

    def _launch(role: str, args: list[str], name: str | None = None) -> WorkerProcess:
        counter[0] += 1
        w = launch(role, args, tmp_path, name or f"{role}-{counter[0]}")
        started.append(w)
        return w

    yield _launch
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=30)
