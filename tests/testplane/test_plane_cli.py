"""`plane.py up|env|down` (what `make cluster-up/cluster-down` run): the plane outlives the
`up` process, `env` points kubectl at it, `down` kills every component it started, and the next
`up` in the same directory starts a fresh cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import plane
import pytest

pytestmark = pytest.mark.cluster


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(plane.HERE / "plane.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_up_env_down(tmp_path: Path) -> None:
    plane.build()
    state_dir = tmp_path / "cluster"
    up = run_cli("up", "--dir", str(state_dir), "--nodes", "2")
    assert up.returncode == 0, up.stderr
    pgids: list[int] = []
    try:
        state = json.loads((state_dir / plane.STATE_FILE).read_text())
        pgids = list(state["pgids"].values())
        assert set(state["pgids"]) == {
            "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
        }  # fmt: skip
        assert all(plane.group_alive(p) for p in pgids), "components outlive `up`"

        again = run_cli("up", "--dir", str(state_dir))
        assert again.returncode == 1
        assert "run `down" in again.stderr

        env = run_cli("env", "--dir", str(state_dir)).stdout
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in env.strip().splitlines()
        )
        kubeconfig = exports["KUBECONFIG"]
        assert kubeconfig == str(state_dir / "admin.kubeconfig")

        def kubectl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(Path(state["bin_dir"]) / "kubectl"), *args],
                capture_output=True,
                text=True,
                env={**os.environ, "KUBECONFIG": kubeconfig},
            )

        nodes = kubectl("get", "nodes", "-o", "name").stdout.split()
        assert nodes == ["node/kwok-node-0", "node/kwok-node-1"]
        assert kubectl("create", "configmap", "from-the-first-plane").returncode == 0
    finally:
        down = run_cli("down", "--dir", str(state_dir))
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not any(plane.group_alive(p) for p in pgids)
    assert not (state_dir / plane.STATE_FILE).exists()
    assert "no plane running" in run_cli("down", "--dir", str(state_dir)).stdout

    # up, down, up: a fresh cluster (not the old etcd data with its Nodes, which made the
    # second `up` fail creating them).
    up = run_cli("up", "--dir", str(state_dir), "--nodes", "2")
    try:
        assert up.returncode == 0, up.stderr
        state = json.loads((state_dir / plane.STATE_FILE).read_text())
        pgids = list(state["pgids"].values())
        old = kubectl("get", "configmap", "from-the-first-plane")
        assert old.returncode == 1 and "NotFound" in old.stderr
        assert kubectl("get", "nodes", "-o", "name").stdout.split() == [
            "node/kwok-node-0", "node/kwok-node-1",
        ]  # fmt: skip
    finally:
        assert run_cli("down", "--dir", str(state_dir)).returncode == 0
    assert not any(plane.group_alive(p) for p in pgids)
