"""A real Prometheus server (Debian's `prometheus` binary) with a generated scrape config,
loopback listen address and a temporary TSDB; queried over its HTTP API. Used by the
`prometheus` fixture in tests/conftest.py and by benchmarks that want a real metrics path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from plane import free_port, kill_group, tail

# Debian's `prometheus` package (hack/system-deps.sh) installs it on PATH.
PROMETHEUS_BIN = (
    os.environ.get("SPLITSERVE_PROMETHEUS") or shutil.which("prometheus") or "prometheus"
)


class Prometheus:
    """A running Prometheus server with a generated config; query it over the HTTP API."""

    def __init__(
        self,
        targets: list[str],
        scrape_interval: str = "1s",
        labels: dict[str, dict[str, str]] | None = None,
        rules: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """labels: per target, labels the scrape adds to its series (as kubernetes_sd
        relabelling adds namespace and pod). rules: rule files by name, each a mapping with
        `groups` (a PrometheusRule's spec); they are evaluated every scrape interval."""
        if not targets:
            raise ValueError("targets must name at least one host:port to scrape")
        for t in targets:
            if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", t):
                raise ValueError(f"targets: {t!r} is not host:port")
        if shutil.which(PROMETHEUS_BIN) is None:
            raise FileNotFoundError(
                f"{PROMETHEUS_BIN} not found: install Debian's `prometheus` package "
                "(hack/system-deps.sh) or set SPLITSERVE_PROMETHEUS"
            )
        self.targets = targets
        self.dir = Path(tempfile.mkdtemp(prefix="splitserve-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rule_files = []
        for name, content in (rules or {}).items():
            if not re.fullmatch(r"[\w.\-]+", name):
                raise ValueError(f"rules: {name!r} is not a plain file name")
            rule_files.append(str(self.dir / f"{name}.rules.yml"))
            # JSON is YAML, and it has no anchors where one mapping is shared by several rules.
            Path(rule_files[-1]).write_text(json.dumps(content, indent=1))
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": rule_files,
            "scrape_configs": [
                {
                    "job_name": "test",
                    "static_configs": [
                        {"targets": [t], "labels": (labels or {}).get(t, {})} for t in targets
                    ],
                }
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = self.dir / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS_BIN,
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready(60.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self.proc.returncode}:\n{tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout:.0f}s:\n{tail(self.log)}")

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns the answer's `data`."""
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params} failed: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; returns the API's data.result (vector samples)."""
        result: list[dict[str, Any]] = self.api("query", query=promql)["result"]
        return result

    def rule_groups(self) -> list[dict[str, Any]]:
        """/api/v1/rules: every loaded group with its `file`, and each rule's `state`
        (inactive, pending, firing), `health` and active `alerts`."""
        groups: list[dict[str, Any]] = self.api("rules")["groups"]
        return groups

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool],
        timeout: float = 60.0,
    ) -> list[dict[str, Any]]:
        """Poll `promql` until predicate(result) is true; return that result."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{promql!r} never satisfied the predicate; last result {result}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
