"""`kubectl apply -k manifests/` on the real control plane: the operator's namespace enforces
the restricted Pod Security Standard, and the operator's own pod is admitted under it."""

from __future__ import annotations

import json
import time

import plane
import pytest

pytestmark = pytest.mark.cluster

NS = "splitserve-system"


def _operator_pods(cp: plane.ControlPlane) -> list[dict]:
    out = cp.kubectl(
        "get", "pods", "-n", NS, "-l", "app.kubernetes.io/name=splitserve", "-o", "json"
    ).stdout
    return json.loads(out)["items"]


def test_kustomize_install_runs_the_operator_under_restricted_pod_security(
    control_plane: plane.ControlPlane, repo_root
) -> None:
    cp = control_plane
    # As documented: the CRDs first (the kustomization also holds a ClusterKopfPeering, which
    # cannot be mapped before its CRD is established), then everything.
    cp.kubectl("apply", "--server-side", "-f", str(repo_root / "manifests" / "crd"))
    cp.kubectl(
        "wait",
        "--for",
        "condition=established",
        "--timeout",
        "120s",
        "crd/clusterkopfpeerings.kopf.dev",
        "crd/llmservices.splitserve.io",
    )
    cp.kubectl("apply", "--server-side", "-k", str(repo_root / "manifests"))
    try:
        ns = json.loads(cp.kubectl("get", "namespace", NS, "-o", "json").stdout)
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        # The operator Deployment's pod passes admission (a violation would leave the
        # ReplicaSet with a FailedCreate event and no pod).
        deadline = time.monotonic() + 120
        while not _operator_pods(cp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _operator_pods(cp), cp.kubectl("get", "events", "-n", NS).stdout

        # And the namespace really enforces: a privileged pod is refused, naming the standard.
        bad = cp.kubectl(
            "apply",
            "-n",
            NS,
            "-f",
            "-",
            check=False,
            input="""
apiVersion: v1
kind: Pod
metadata: {name: privileged}
spec:
  containers:
    - name: c
      image: busybox
      securityContext: {privileged: true}
""",
        )
        assert bad.returncode != 0
        assert 'violates PodSecurity "restricted' in bad.stderr
    finally:
        # Everything but the CRDs: every test shares them, and deleting one waits on (and can
        # be held in Terminating by) LLMServices other tests still have.
        cp.kubectl(
            "delete",
            "-f",
            str(repo_root / "manifests" / "operator.yaml"),
            "-f",
            str(repo_root / "manifests" / "namespace.yaml"),
            "--wait=false",
            "--ignore-not-found",
            check=False,
        )
