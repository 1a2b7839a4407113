"""The test plane behaves like a cluster: controllers, scheduler, kwok Nodes, RBAC with real
ServiceAccount tokens, helm and the real v1.34.4 release (hack/testplane/plane.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import plane
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

T = TypeVar("T")

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - name: web
          image: web:1
          resources: {requests: {cpu: "1", memory: 1Gi}}
"""


def wait_until(fn: Callable[[], T | None], what: str, timeout: float = 90.0) -> T:
    """Poll fn until it returns something truthy; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last value {last!r}")


def pod_ready(pod: Any) -> bool:
    conds = {c.type: c.status for c in (pod.status.conditions or [])}
    return pod.status.phase == "Running" and conds.get("Ready") == "True"


def test_kubectl_version_is_the_real_release(control_plane: plane.ControlPlane) -> None:
    out = control_plane.kubectl("version", "-o", "json").stdout
    versions = json.loads(out)
    assert versions["clientVersion"]["gitVersion"] == plane.KUBE_VERSION
    assert versions["serverVersion"]["gitVersion"] == plane.KUBE_VERSION


def test_fake_nodes_are_ready_with_gpu_capacity(control_plane: plane.ControlPlane) -> None:
    nodes = client.CoreV1Api(control_plane.api_client()).list_node(label_selector="type=kwok")
    assert sorted(n.metadata.name for n in nodes.items) == control_plane.node_names
    for node in nodes.items:
        assert node.status.allocatable["nvidia.com/gpu"] == "4"
        assert node.status.allocatable["cpu"] == "32"
        assert node.status.allocatable["memory"] == "128Gi"
        assert node.status.allocatable["pods"] == "110"
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"


def test_deployment_becomes_ready_pods_on_kwok_nodes(
    control_plane: plane.ControlPlane, namespace: str
) -> None:
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=DEPLOYMENT)
    control_plane.kubectl(
        "rollout", "status", "-n", namespace, "deployment/web", "--timeout=120s", timeout=150
    )
    api = control_plane.api_client()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)

    deployment = apps.read_namespaced_deployment("web", namespace)
    replicasets = apps.list_namespaced_replica_set(namespace, label_selector="app=web").items
    assert len(replicasets) == 1, "the deployment controller makes exactly one ReplicaSet"
    rs = replicasets[0]
    assert [o.uid for o in rs.metadata.owner_references] == [deployment.metadata.uid]

    pods = core.list_namespaced_pod(namespace, label_selector="app=web").items
    assert len(pods) == 3
    for pod in pods:
        assert [o.uid for o in pod.metadata.owner_references] == [rs.metadata.uid]
        assert pod.spec.node_name in control_plane.node_names, "bound by the scheduler"
        assert pod_ready(pod)
        assert pod.status.pod_ip, "kwok gives a running Pod an IP"
    assert deployment.status.ready_replicas == 3

    # Scaling down deletes Pods; with no kubelet, kwok's pod-delete stage must remove them.
    control_plane.kubectl("scale", "-n", namespace, "deployment/web", "--replicas=1")
    wait_until(
        lambda: len(core.list_namespaced_pod(namespace, label_selector="app=web").items) == 1,
        "deleted pods to disappear",
    )


def test_pod_asking_for_too_many_gpus_stays_pending(
    control_plane: plane.ControlPlane, namespace: str
) -> None:
    core = client.CoreV1Api(control_plane.api_client())

    def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
        limits = {"nvidia.com/gpu": str(gpus)}
        container = {"name": "c", "image": "gpu:1", "resources": {"limits": limits}}
        return {"metadata": {"name": name}, "spec": {"containers": [container]}}

    core.create_namespaced_pod(namespace, gpu_pod("fits", 4))  # control: 4 fit on one Node
    core.create_namespaced_pod(namespace, gpu_pod("too-big", 5))

    wait_until(lambda: pod_ready(core.read_namespaced_pod("fits", namespace)), "4-GPU pod Ready")

    def failed_scheduling() -> list[Any]:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=too-big"
        ).items
        return [e for e in events if e.reason == "FailedScheduling"]

    events = wait_until(failed_scheduling, "a FailedScheduling event for too-big")
    assert "Insufficient nvidia.com/gpu" in events[0].message
    pod = core.read_namespaced_pod("too-big", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_service_account_needs_a_role_binding(
    control_plane: plane.ControlPlane, namespace: str
) -> None:
    control_plane.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    kubeconfig: Path = control_plane.kubeconfig_for_service_account(namespace, "reader")
    sa_core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))

    with pytest.raises(ApiException) as denied:
        sa_core.list_namespaced_pod(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:reader" in str(denied.value.body)

    control_plane.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list", "--resource=pods"
    )
    control_plane.kubectl(
        "create", "rolebinding", "reader-pods", "-n", namespace,
        "--role=pod-reader", f"--serviceaccount={namespace}:reader",
    )  # fmt: skip

    def allowed() -> bool:
        try:
            sa_core.list_namespaced_pod(namespace)
        except ApiException as e:
            if e.status == 403:
                return False
            raise
        return True

    wait_until(allowed, "the RoleBinding to take effect", timeout=120)
    # The Role is namespaced: other namespaces stay forbidden.
    with pytest.raises(ApiException) as elsewhere:
        sa_core.list_namespaced_pod("default")
    assert elsewhere.value.status == 403


def test_helm_installs_and_uninstalls_a_chart(
    control_plane: plane.ControlPlane, namespace: str, repo_root: Path
) -> None:
    chart = repo_root / "tests" / "testplane" / "data" / "minichart"
    control_plane.helm(
        "install", "demo", str(chart), "-n", namespace, "--set", "greeting=hi there",
        "--wait", "--timeout=120s",
    )  # fmt: skip
    api = control_plane.api_client()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)

    assert core.read_namespaced_config_map("demo-config", namespace).data == {
        "greeting": "hi there"
    }
    assert apps.read_namespaced_deployment("demo-web", namespace).status.ready_replicas == 2
    assert core.read_namespaced_service("demo-web", namespace).spec.cluster_ip
    releases = json.loads(control_plane.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]

    control_plane.helm("uninstall", "demo", "-n", namespace, "--wait", "--timeout=120s")

    def gone() -> bool:
        selector = "app.kubernetes.io/instance=demo"
        return not (
            core.list_namespaced_config_map(namespace, label_selector=selector).items
            or apps.list_namespaced_deployment(namespace, label_selector=selector).items
            or core.list_namespaced_service(namespace, label_selector=selector).items
            or core.list_namespaced_pod(namespace, label_selector=selector).items
        )

    wait_until(gone, "the release's objects and pods to be deleted")
    assert json.loads(control_plane.helm("list", "-n", namespace, "-o", "json").stdout) == []
