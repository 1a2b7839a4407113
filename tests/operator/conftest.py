"""Fixtures for the operator's cluster tests: the chart installed cluster-wide and the operator
running as a subprocess with the chart's ServiceAccount token, so its RBAC is what is tested."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from operator_process import (  # noqa: E402
    OperatorProcess,
    install_chart,
    install_monitoring_crds,
)


@dataclass
class Release:
    name: str
    namespace: str
    service_account: str


@pytest.fixture(scope="module")
def cluster_release(control_plane: Any) -> Iterator[Release]:
    """The chart installed with watch.allNamespaces=true (ClusterRole, ClusterKopfPeering), and
    the monitoring.coreos.com kinds served (the Prometheus operator's own CRDs) so
    ServiceMonitor, PodMonitor and PrometheusRule are created."""
    install_monitoring_crds(control_plane)
    namespace = control_plane.create_namespace(f"splitserve-system-{uuid.uuid4().hex[:6]}")
    sa = install_chart(control_plane, "ops", namespace, "watch.allNamespaces=true")
    try:
        yield Release("ops", namespace, sa)
    finally:
        control_plane.helm("uninstall", "ops", "-n", namespace, check=False)
        control_plane.delete_namespace(namespace)


@pytest.fixture(scope="module")
def operator(control_plane: Any, cluster_release: Release) -> Iterator[OperatorProcess]:
    """`splitserve operator --all-namespaces` with the release's ServiceAccount; resync every
    2 s so drift repair is observable quickly."""
    kubeconfig = control_plane.kubeconfig_for_service_account(
        cluster_release.namespace, cluster_release.service_account
    )
    log = Path(control_plane.workdir) / "logs" / f"operator-{uuid.uuid4().hex[:6]}.log"
    proc = OperatorProcess(
        kubeconfig, ["--all-namespaces", "--resync-seconds=2", "--peering=splitserve"], log
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
