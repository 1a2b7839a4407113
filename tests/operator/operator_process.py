"""Test and benchmark helpers for the operator on the real control plane: install the Helm
chart, run `splitserve operator` as a subprocess with the chart's ServiceAccount credentials,
read LLMService status. Used by tests/operator and bench/operator.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "splitserve"
T = TypeVar("T")


def _testplane_script(name: str) -> str:
    """Run hack/testplane/<name> (which fetches and caches); the path it prints last."""
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "testplane" / name)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def install_monitoring_crds(cp: Any) -> None:
    """The Prometheus operator's own ServiceMonitor, PodMonitor and PrometheusRule CRDs
    (hack/testplane/monitoring-crds.sh takes them from its Go module, cached), so the
    operator's monitors and alert rules are validated by their real schemas. No Prometheus
    operator runs here: nothing turns them into scrape configs or rule files."""
    directory = _testplane_script("monitoring-crds.sh")
    kinds = ("servicemonitors", "podmonitors", "prometheusrules")
    for kind in kinds:
        cp.kubectl("apply", "--server-side", "-f", f"{directory}/{kind}.yaml")
    crds = [f"crd/{kind}.monitoring.coreos.com" for kind in kinds]
    cp.kubectl("wait", "--for=condition=Established", *crds, "--timeout=60s")


def install_keda_crd(cp: Any) -> None:
    """KEDA's own ScaledObject CRD (hack/testplane/keda-crd.sh takes it from KEDA's Go module,
    cached), so ScaledObjects are validated by KEDA's schema. No KEDA operator runs here: it
    is not part of the test plane, so nothing reconciles them."""
    cp.kubectl("apply", "--server-side", "-f", _testplane_script("keda-crd.sh"))
    cp.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s")


def wait_until(fn: Callable[[], T | None], what: str, timeout: float = 120.0) -> T:
    """Poll fn until it returns something truthy; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last value {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install_chart(cp: Any, release: str, namespace: str, *set_args: str) -> str:
    """helm install the chart (CRDs included); returns the operator's ServiceAccount name."""
    sets = [arg for value in set_args for arg in ("--set", value)]
    cp.helm("install", release, str(CHART), "-n", namespace, "--wait=false", *sets)
    return f"{release}-splitserve" if "splitserve" not in release else release


def get_json(cp: Any, *args: str) -> Any:
    proc = cp.kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def is_ready(obj: dict[str, Any] | None) -> bool:
    """Ready=True for the current generation."""
    if not obj:
        return False
    status = obj.get("status") or {}
    ready = conditions(obj).get("Ready", {})
    generation = obj["metadata"]["generation"]
    return ready.get("status") == "True" and status.get("observedGeneration") == generation


class OperatorProcess:
    """`splitserve operator ...` in a subprocess, logging to a file, with a liveness port."""

    def __init__(self, kubeconfig: Path, args: list[str], log: Path) -> None:
        self.kubeconfig = kubeconfig
        self.args = args
        self.log = log
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        self.port = free_port()
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        cmd = [
            sys.executable, "-m", "splitserve_workers.cli", "operator", *self.args,
            f"--liveness=http://127.0.0.1:{self.port}/healthz",
        ]  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        wait_until(self.healthy, f"operator liveness on port {self.port}\n{self.tail()}", 120)
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""
