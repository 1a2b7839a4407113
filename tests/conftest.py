"""Shared pytest fixtures: the real Kubernetes control plane (hack/testplane/plane.py),
a fresh namespace per test, and real Prometheus servers (hack/testplane/promserver.py).

Tests that use `control_plane` or `prometheus` are marked `@pytest.mark.cluster`.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "hack" / "testplane"))
# Test this checkout's code, here and in every process the tests start, whatever Python runs
# them (hack/venv.sh's .venv already imports this clone; another venv may not).
SOURCES = [str(REPO_ROOT / "workers"), str(REPO_ROOT / "operator")]
sys.path[:0] = SOURCES
os.environ["PYTHONPATH"] = os.pathsep.join(
    SOURCES + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

import plane  # noqa: E402  (lives in hack/testplane, put on sys.path just above)
from promserver import Prometheus  # noqa: E402


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def control_plane() -> Iterator[plane.ControlPlane]:
    """One real control plane (etcd, apiserver, controller-manager, scheduler, kwok with
    3 fake GPU Nodes) for the whole session; always stopped at the end."""
    bin_dir = plane.build()  # returns at once when the binaries are cached
    cp = plane.ControlPlane(bin_dir=bin_dir, nodes=3)
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def namespace(control_plane: plane.ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (default ServiceAccount ready), deleted after the test."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    control_plane.create_namespace(name)
    try:
        yield name
    finally:
        control_plane.delete_namespace(name)


@pytest.fixture
def prometheus() -> Iterator[Callable[..., Prometheus]]:
    """Factory: prometheus(["127.0.0.1:PORT"], scrape_interval="1s") -> running server with
    `.url`, `.query(promql)`, `.wait_for(promql, predicate)` and `.rule_groups()`; `labels`
    adds labels per target, `rules` loads rule files ({name: {"groups": [...]}}); stopped
    after the test."""
    started: list[Prometheus] = []

    def start(
        targets: list[str],
        scrape_interval: str = "1s",
        labels: dict[str, dict[str, str]] | None = None,
        rules: dict[str, dict[str, Any]] | None = None,
    ) -> Prometheus:
        prom = Prometheus(targets, scrape_interval, labels, rules)
        started.append(prom)
        return prom

    try:
        yield start
    finally:
        for prom in started:
            prom.stop()
