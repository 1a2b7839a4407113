"""The operator against the real control plane: the chart's RBAC, reconcile of the tiny example
down to Ready pods on kwok nodes, rollouts, garbage collection, drift repair, restarts, HPA
ownership of replicas, schema rejection of bad resources, and 50 services at once."""

from __future__ import annotations

import json
import signal
import urllib.request
import uuid
from typing import Any

import pytest
import yaml
from operator_process import (
    REPO_ROOT,
    OperatorProcess,
    conditions,
    get_json,
    install_keda_crd,
    is_ready,
    wait_until,
)
from splitserve_operator.spec import parse_spec

pytestmark = pytest.mark.cluster

TINY = (REPO_ROOT / "manifests" / "examples" / "tiny-cpu.yaml").read_text()
POOLS = ("router", "prefill", "decode")


def apply(cp: Any, namespace: str, manifest: str | dict) -> None:
    text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=text)


def llms(cp: Any, namespace: str, name: str) -> dict[str, Any] | None:
    return get_json(cp, "-n", namespace, "llmservice", name)  # type: ignore[no-any-return]


def wait_ready(cp: Any, namespace: str, name: str, timeout: float = 180.0) -> dict[str, Any]:
    return wait_until(
        lambda: (obj := llms(cp, namespace, name)) and is_ready(obj) and obj,
        f"LLMService {namespace}/{name} Ready",
        timeout,
    )


def deployment(cp: Any, namespace: str, name: str) -> dict[str, Any] | None:
    return get_json(cp, "-n", namespace, "deployment", name)  # type: ignore[no-any-return]


def tiny_events(cp: Any, namespace: str, reason: str = "") -> list[dict[str, Any]]:
    """The Events about LLMService `tiny` (with this reason, if given)."""
    selector = "involvedObject.kind=LLMService,involvedObject.name=tiny"
    if reason:
        selector += f",reason={reason}"
    items: list[dict[str, Any]] = get_json(
        cp, "-n", namespace, "events", "--field-selector", selector
    )["items"]
    return items


def config_map_name(cp: Any, namespace: str, service: str = "tiny", pool: str = "decode") -> str:
    """The config version a pool's Deployment mounts (ConfigMaps are named by content hash)."""
    dep = deployment(cp, namespace, f"{service}-{pool}")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}  # type: ignore
    return str(volumes["config"]["configMap"]["name"])


def config_maps(cp: Any, namespace: str, service: str = "tiny") -> list[str]:
    sel = f"app.kubernetes.io/instance={service},app.kubernetes.io/component=config"
    return sorted(c["metadata"]["name"] for c in get_json(cp, "-n", namespace, "configmaps",
                                                          "-l", sel)["items"])  # fmt: skip


def tiny(**spec_overrides: Any) -> dict[str, Any]:
    obj = yaml.safe_load(TINY)
    obj["spec"].update(spec_overrides)
    return obj


def test_chart_rbac_reconciles_tiny_example_to_ready(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, namespace, TINY)
    obj = wait_ready(cp, namespace, "tiny")
    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["endpoint"] == f"http://tiny-router.{namespace}.svc:8000"
    conds = conditions(obj)
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "AllPoolsReady"
    assert conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "False"
    for cond in conds.values():
        assert cond["observedGeneration"] == obj["metadata"]["generation"]
        assert cond["lastTransitionTime"]
    for pool in POOLS:
        assert status[pool]["readyReplicas"] == 1 and status[pool]["ready"] == "1/1"

    uid = obj["metadata"]["uid"]
    kinds = (
        "deployments,services,configmaps,poddisruptionbudgets,servicemonitors,podmonitors,"
        "prometheusrules,networkpolicies"
    )
    children = get_json(cp, "-n", namespace, kinds, "-l", "app.kubernetes.io/instance=tiny")
    names = sorted((c["kind"], c["metadata"]["name"]) for c in children["items"])
    assert names == sorted(
        [
            ("ConfigMap", config_map_name(cp, namespace, pool="router")),
            ("ConfigMap", config_map_name(cp, namespace)),  # the prefill and decode pools'
            ("NetworkPolicy", "tiny-workers"),
            ("PodMonitor", "tiny-workers"),
            ("PrometheusRule", "tiny-slo"),
            *[("Deployment", f"tiny-{p}") for p in POOLS],
            *[("PodDisruptionBudget", f"tiny-{p}") for p in POOLS],
            *[("Service", f"tiny-{p}") for p in POOLS],
            ("ServiceMonitor", "tiny-router"),
        ]
    )
    for child in children["items"]:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] is True

    decode = deployment(cp, namespace, "tiny-decode")
    assert decode is not None
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["decode", "--config", "/etc/splitserve/config.yaml"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30
    assert get_json(cp, "-n", namespace, "service", "tiny-prefill")["spec"]["clusterIP"] == "None"

    pods = get_json(cp, "-n", namespace, "pods", "-l", "app.kubernetes.io/instance=tiny")
    assert len(pods["items"]) == 3
    for pod in pods["items"]:
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
        assert pod["status"]["phase"] == "Running" and ready.get("Ready") == "True"
        assert pod["spec"]["nodeName"].startswith("kwok-node-")

    events = tiny_events(cp, namespace)
    assert "Created" in {e["reason"] for e in events}
    # `kubectl describe`'s From column names the operator, not kopf.
    assert {e["source"]["component"] for e in events} == {"splitserve-operator"}
    assert {e["reportingComponent"] for e in events} == {"splitserve-operator"}
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.port}/healthz") as r:
        assert r.status == 200


def test_updates_roll_out_and_delete_collects_children(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, namespace, TINY)
    wait_ready(cp, namespace, "tiny")

    def replicasets(pool: str) -> list[dict[str, Any]]:
        sel = f"app.kubernetes.io/instance=tiny,app.kubernetes.io/component={pool}"
        return get_json(cp, "-n", namespace, "replicasets", "-l", sel)["items"]  # type: ignore

    def template(pool: str) -> dict[str, Any]:
        return deployment(cp, namespace, f"tiny-{pool}")["spec"]["template"]  # type: ignore

    # New image: every pool rolls to a new ReplicaSet.
    apply(cp, namespace, tiny(image="splitserve/worker:v2"))
    obj = wait_ready(cp, namespace, "tiny")
    assert obj["metadata"]["generation"] == 2
    for pool in POOLS:
        assert template(pool)["spec"]["containers"][0]["image"] == "splitserve/worker:v2"
        assert len(replicasets(pool)) == 2

    # New worker config: a new immutable ConfigMap, and its hash rolls the pods onto it.
    # The old version stays while a pod or a ReplicaSet with pods mounts it, and goes after.
    # The router reads none of it: its config and pods stay.
    before = template("decode")["metadata"]["annotations"]["splitserve.io/config-hash"]
    old_config = config_map_name(cp, namespace)
    assert old_config == f"tiny-config-{before}"
    router_config = config_map_name(cp, namespace, pool="router")
    assert router_config != old_config
    changed = tiny(image="splitserve/worker:v2")
    changed["spec"]["decode"]["maxBatchSize"] = 8
    apply(cp, namespace, changed)
    wait_ready(cp, namespace, "tiny")
    new_config = config_map_name(cp, namespace)
    assert new_config != old_config
    config = get_json(cp, "-n", namespace, "configmap", new_config)["data"]["config.yaml"]
    assert yaml.safe_load(config)["decode"]["max_batch_size"] == 8
    assert template("decode")["metadata"]["annotations"]["splitserve.io/config-hash"] != before
    assert len(replicasets("decode")) == 3
    assert len(replicasets("router")) == 2  # the image's rollout only
    assert config_map_name(cp, namespace, pool="router") == router_config
    wait_until(
        lambda: config_maps(cp, namespace) == sorted([router_config, new_config]),
        "the superseded config version deleted once no pod mounts it",
    )
    assert any(old_config in e["message"] for e in tiny_events(cp, namespace, "Deleted"))
    for pod in get_json(cp, "-n", namespace, "pods", "-l", "app.kubernetes.io/instance=tiny")[
        "items"
    ]:
        mounted = {v["name"]: v for v in pod["spec"]["volumes"]}["config"]["configMap"]["name"]
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert mounted == (router_config if component == "router" else new_config)

    # More replicas (mode Off): the Deployment follows the spec.
    changed["spec"]["decode"]["replicas"] = 3
    apply(cp, namespace, changed)
    obj = wait_ready(cp, namespace, "tiny")
    assert deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 3  # type: ignore
    assert obj["status"]["decode"]["ready"] == "3/3"

    cp.kubectl("delete", "-n", namespace, "llmservice", "tiny", "--wait=true")
    wait_until(
        lambda: (
            not get_json(
                cp,
                "-n",
                namespace,
                "deployments,services,configmaps",
                "-l",
                "app.kubernetes.io/instance=tiny",
            )["items"]
        ),
        "children garbage-collected",
    )


def test_drift_is_repaired(control_plane: Any, operator: OperatorProcess, namespace: str) -> None:
    cp = control_plane
    apply(cp, namespace, TINY)
    wait_ready(cp, namespace, "tiny")

    def delete_and_wait_for_a_new_one(kind: str, name: str, timeout: float) -> None:
        old_uid = get_json(cp, "-n", namespace, kind, name)["metadata"]["uid"]
        cp.kubectl("delete", "-n", namespace, kind, name)
        wait_until(
            lambda: (
                (obj := get_json(cp, "-n", namespace, kind, name))
                and obj["metadata"]["uid"] != old_uid
            ),
            f"deleted {kind} recreated",
            timeout,
        )

    cp.kubectl("set", "image", "-n", namespace, "deployment/tiny-decode", "decode=evil:1")
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-router", "--replicas=4")
    delete_and_wait_for_a_new_one("service", "tiny-prefill", 120)
    wait_until(
        lambda: (
            deployment(cp, namespace, "tiny-decode")["spec"]["template"]["spec"][  # type: ignore
                "containers"
            ][0]["image"]
            == "splitserve/worker:dev"
        ),
        "hand-edited image restored",
    )
    wait_until(
        lambda: deployment(cp, namespace, "tiny-router")["spec"]["replicas"] == 1,  # type: ignore
        "replicas restored in mode Off",
    )
    assert "DriftRepaired" in {e["reason"] for e in tiny_events(cp, namespace)}
    # A ConfigMap is not watched: the resync finds it missing, and says so as a repair too.
    delete_and_wait_for_a_new_one("configmap", config_map_name(cp, namespace), 90)
    wait_until(
        lambda: any(
            "ConfigMap" in e["message"] for e in tiny_events(cp, namespace, "DriftRepaired")
        ),
        "a DriftRepaired Event naming the ConfigMap",
        30,
    )
    wait_ready(cp, namespace, "tiny")


def test_objects_it_does_not_own_are_never_taken_over(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    # Someone's own Service has the name the LLMService's router Service would get. Applied
    # over it, it would get a controller owner reference, and the garbage collector would
    # delete it with the LLMService.
    cp = control_plane
    cp.kubectl("create", "service", "clusterip", "-n", namespace, "tiny-router", "--tcp=81:81")
    apply(cp, namespace, TINY)
    ready = wait_until(
        lambda: (
            (c := conditions(llms(cp, namespace, "tiny") or {}).get("Ready"))
            and c["reason"] == "ChildConflict"
            and c
        ),
        "Ready False ChildConflict",
    )
    assert ready["status"] == "False"
    assert f"Service {namespace}/tiny-router (it has no controller)" in ready["message"]
    mine = get_json(cp, "-n", namespace, "service", "tiny-router")
    assert mine["spec"]["ports"][0]["port"] == 81
    assert not mine["metadata"].get("ownerReferences")
    assert deployment(cp, namespace, "tiny-router") is None  # stopped before changing anything
    assert config_maps(cp, namespace) == []
    events = tiny_events(cp, namespace, "ChildConflict")
    assert events and events[0]["type"] == "Warning"
    # Once the name is free the service comes up (at the next retry).
    cp.kubectl("delete", "service", "-n", namespace, "tiny-router")
    wait_ready(cp, namespace, "tiny")
    ours = get_json(cp, "-n", namespace, "service", "tiny-router")
    assert ours["metadata"]["ownerReferences"][0]["name"] == "tiny"


def test_a_conflict_stays_in_status_between_retries(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    # Status is also written when a child Deployment changes (pods come and go). Such a write
    # between two reconcile retries used to forget the conflict and say Ready.
    cp = control_plane
    apply(cp, namespace, TINY)
    wait_ready(cp, namespace, "tiny")
    # A stranger's PDB in place of the operator's. The operator recreates a deleted child as
    # soon as it sees the deletion, so the create may find its PDB back: delete and try again.
    for _ in range(20):
        cp.kubectl("delete", "pdb", "-n", namespace, "tiny-router", "--ignore-not-found")
        made = cp.kubectl(
            "create", "pdb", "-n", namespace, "tiny-router", "--selector=app=mine",
            "--min-available=1", check=False,
        )  # fmt: skip
        if made.returncode == 0:
            break
        assert "AlreadyExists" in made.stderr, made.stderr
    else:
        raise AssertionError("the operator recreated its PDB before every create, 20 times")
    # The next resync meets the stranger's PDB.
    wait_until(
        lambda: conditions(llms(cp, namespace, "tiny") or {})["Ready"]["reason"] == "ChildConflict",
        "Ready False ChildConflict",
        90,
    )
    # Nothing reconciles meanwhile, so this scale stands and its Deployment events write status.
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-router", "--replicas=2")
    current = wait_until(
        lambda: (
            (o := llms(cp, namespace, "tiny")) and o["status"]["router"]["readyReplicas"] == 2 and o
        ),
        "status written from the scaled router Deployment",
    )
    for kind in ("Ready", "Degraded"):
        assert conditions(current)[kind]["reason"] == "ChildConflict", conditions(current)[kind]
    assert "PodDisruptionBudget" in conditions(current)["Ready"]["message"]


def test_ready_message_says_why_a_pool_cannot_schedule(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    # kwok nodes have 4 GPUs each: a decode pod asking for 8 stays Pending, and the status says
    # why (the scheduler's own words, read by the chart RBAC's `list pods`) long before the
    # Deployment's 10-minute progress deadline would.
    cp = control_plane
    obj = tiny()
    obj["spec"]["decode"]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    apply(cp, namespace, obj)

    def unschedulable_message() -> str | None:
        current = llms(cp, namespace, "tiny")
        if not current or "status" not in current:
            return None
        ready = conditions(current).get("Ready") or {}
        message = str(ready.get("message", ""))
        return message if "Insufficient nvidia.com/gpu" in message else None

    message = wait_until(unschedulable_message, "Ready message naming the GPU shortage", 120)
    assert "decode 0/1 ready" in message and "1 pod unschedulable:" in message
    assert "prefill" not in message and "router" not in message  # those pools are fine
    obj["spec"]["decode"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    apply(cp, namespace, obj)
    assert "Insufficient" not in conditions(wait_ready(cp, namespace, "tiny"))["Ready"]["message"]


def test_hpa_mode_owns_hpas_and_leaves_replicas_to_them(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    obj = tiny(autoscaling={"mode": "HPA"})
    for pool in ("prefill", "decode"):
        obj["spec"][pool]["replicas"] = 2
        obj["spec"][pool]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 6}
    apply(cp, namespace, obj)
    wait_ready(cp, namespace, "tiny")
    assert deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 2  # type: ignore
    # What an HPA does: scale through the /scale subresource.
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-decode", "--replicas=5")
    # A spec change (new image) and several resyncs must not touch the replicas.
    obj["spec"]["image"] = "splitserve/worker:v3"
    # Nothing autoscales the router: its replicas follow the spec in every mode.
    obj["spec"].setdefault("router", {})["replicas"] = 2
    apply(cp, namespace, obj)
    wait_until(
        lambda: deployment(cp, namespace, "tiny-router")["spec"]["replicas"] == 2,  # type: ignore
        "spec.router.replicas applied in mode HPA",
    )
    wait_until(
        lambda: (
            (d := deployment(cp, namespace, "tiny-decode"))
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == "splitserve/worker:v3"
            and d
        ),
        "image rolled out",
    )
    ready = wait_ready(cp, namespace, "tiny")
    assert deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 5  # type: ignore
    assert ready["status"]["decode"]["desiredReplicas"] == 5

    # The operator made one HPA per pool, and the real HPA controller evaluates them. This
    # cluster serves no custom metrics API, so it cannot get the pods' metrics: the
    # Autoscaling condition says so in the controller's words, and no replica moves.
    for pool in ("prefill", "decode"):
        hpa = get_json(cp, "-n", namespace, "hpa", f"tiny-{pool}")
        assert hpa["metadata"]["ownerReferences"][0]["name"] == "tiny"
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"tiny-{pool}"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    autoscaling = wait_until(
        lambda: (
            (c := conditions(llms(cp, namespace, "tiny") or {}).get("Autoscaling"))
            and c["reason"].startswith("FailedGet")
            and c
        ),
        "the HPA controller's verdict in the Autoscaling condition",
        120,
    )
    assert autoscaling["status"] == "False"
    assert "splitserve_" in autoscaling["message"]
    assert "manifests/prometheus-adapter/values.yaml" in autoscaling["message"]
    assert deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 5  # type: ignore

    # Leaving mode HPA deletes them (left behind, they would keep resizing the pools).
    obj["spec"]["autoscaling"] = {"mode": "Off"}
    apply(cp, namespace, obj)
    wait_until(
        lambda: not get_json(cp, "-n", namespace, "hpa")["items"], "HPAs deleted after mode Off"
    )
    off = wait_until(
        lambda: (
            (o := llms(cp, namespace, "tiny"))
            and conditions(o)["Autoscaling"]["reason"] == "Off"
            and o
        ),
        "Autoscaling Off",
    )
    assert conditions(off)["Autoscaling"]["status"] == "False"
    wait_until(
        lambda: deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 2,  # type: ignore
        "mode Off enforces spec.decode.replicas again",
    )


def test_keda_mode_makes_scaled_objects_keda_accepts_and_prunes_them(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    install_keda_crd(cp)
    obj = tiny(
        autoscaling={
            "mode": "KEDA",
            "metrics": {"prometheus": {"url": "http://prometheus.monitoring:9090"}},
        }
    )
    obj["spec"]["prefill"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    # Zero is allowed in mode KEDA (KEDA scales a pool to zero and back).
    obj["spec"]["decode"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 6}
    apply(cp, namespace, obj)
    wait_ready(cp, namespace, "tiny")

    # KEDA's own schema (with its CEL rules) accepted what the operator applied, under the
    # chart's RBAC.
    def scaled() -> dict[str, Any]:
        items = get_json(cp, "-n", namespace, "scaledobjects.keda.sh")["items"]
        return {o["metadata"]["name"]: o for o in items}

    found = wait_until(lambda: len(s := scaled()) == 2 and s, "two ScaledObjects")
    decode = found["tiny-decode"]
    assert decode["metadata"]["ownerReferences"][0]["name"] == "tiny"
    assert decode["spec"]["scaleTargetRef"]["name"] == "tiny-decode"
    assert (decode["spec"]["minReplicaCount"], decode["spec"]["maxReplicaCount"]) == (0, 6)
    names = {t["name"] for t in decode["spec"]["triggers"]}
    assert names == {"decode-tpot-ms", "decode-kv-usage", "decode-running", "wake"}
    assert not get_json(cp, "-n", namespace, "hpa")["items"]  # the operator makes no HPA
    # Nothing reconciles them in this cluster (no KEDA operator): the condition says so,
    # and the operator leaves the replicas alone.
    pending = wait_until(
        lambda: (
            (c := conditions(llms(cp, namespace, "tiny") or {}).get("Autoscaling"))
            and c["reason"] == "KEDAPending"
            and c
        ),
        "Autoscaling KEDAPending",
    )
    assert "tiny-prefill, tiny-decode" in pending["message"]
    assert "KEDA's operator" in pending["message"]
    cp.kubectl("scale", "-n", namespace, "deployment/tiny-decode", "--replicas=3")
    obj["spec"]["image"] = "splitserve/worker:v4"
    apply(cp, namespace, obj)
    wait_until(
        lambda: (
            (d := deployment(cp, namespace, "tiny-decode"))
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == "splitserve/worker:v4"
        ),
        "image rolled out",
    )
    assert deployment(cp, namespace, "tiny-decode")["spec"]["replicas"] == 3  # type: ignore

    # Leaving mode KEDA deletes them (left behind, KEDA would keep resizing the pools).
    obj["spec"]["autoscaling"] = {"mode": "Off"}
    apply(cp, namespace, obj)
    wait_until(lambda: not scaled(), "ScaledObjects deleted after mode Off")
    events = get_json(cp, "-n", namespace, "events", "--field-selector", "reason=Deleted")
    messages = [e["message"] for e in events["items"]]
    assert any(
        f"ScaledObject {namespace}/tiny-decode" in m and "autoscaling.mode is Off" in m
        for m in messages
    ), messages


def test_disabling_monitoring_deletes_only_the_monitors_it_owns(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, namespace, TINY)
    wait_ready(cp, namespace, "tiny")

    def monitors() -> list[tuple[str, str]]:
        kinds = "servicemonitors,podmonitors,prometheusrules"
        found = get_json(cp, "-n", namespace, kinds)["items"]
        return sorted((m["kind"], m["metadata"]["name"]) for m in found)

    # Accepted by the Prometheus operator's own CRD schemas (the test plane serves them).
    wait_until(lambda: len(monitors()) == 3, "the ServiceMonitor, PodMonitor and PrometheusRule")
    rule = get_json(cp, "-n", namespace, "prometheusrule", "tiny-slo")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any(f'namespace="{namespace}",service="tiny"' in e for e in exprs), exprs

    # Alerts off: the rule goes, the monitors stay.
    apply(cp, namespace, tiny(monitoring={"alerts": {"enabled": False}}))
    wait_until(
        lambda: monitors() == [("PodMonitor", "tiny-workers"), ("ServiceMonitor", "tiny-router")],
        "the PrometheusRule deleted, the monitors kept",
    )
    apply(cp, namespace, TINY)
    wait_until(lambda: len(monitors()) == 3, "the PrometheusRule back")
    # Someone else's ServiceMonitor for the same router, with the same labels: not the
    # operator's to delete.
    router_monitor = get_json(cp, "-n", namespace, "servicemonitor", "tiny-router")
    theirs = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "tiny-router-extra", "labels": router_monitor["metadata"]["labels"]},
        "spec": router_monitor["spec"],
    }
    apply(cp, namespace, theirs)

    apply(cp, namespace, tiny(monitoring={"enabled": False}))
    wait_until(
        lambda: monitors() == [("ServiceMonitor", "tiny-router-extra")],
        "the operator's monitors deleted, the other one kept",
    )
    deleted = "involvedObject.kind=LLMService,involvedObject.name=tiny,reason=Deleted"
    events = get_json(cp, "-n", namespace, "events", "--field-selector", deleted)["items"]
    (alerts_off,) = [e["message"] for e in events if "alerts.enabled is false" in e["message"]]
    assert alerts_off.startswith(f"deleted PrometheusRule {namespace}/tiny-slo:"), alerts_off
    (message,) = [e["message"] for e in events if e["message"] != alerts_off]
    assert f"ServiceMonitor {namespace}/tiny-router" in message
    assert f"PodMonitor {namespace}/tiny-workers" in message
    assert f"PrometheusRule {namespace}/tiny-slo" in message
    assert "monitoring.enabled is false" in message

    # A namesake it did not make survives the next change too: ownership is checked, not names.
    apply(cp, namespace, {**theirs, "metadata": {**theirs["metadata"], "name": "tiny-router"}})
    obj = tiny(monitoring={"enabled": False, "interval": "30s"})
    apply(cp, namespace, obj)
    wait_until(
        lambda: (o := llms(cp, namespace, "tiny")) and o["status"]["observedGeneration"] == 5,
        "the change reconciled",
    )
    assert monitors() == [
        ("ServiceMonitor", "tiny-router"),
        ("ServiceMonitor", "tiny-router-extra"),
    ]


def test_restart_mid_reconcile_converges_without_duplicates(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    for i in range(5):
        obj = tiny()
        obj["metadata"]["name"] = f"svc-{i}"
        apply(cp, namespace, obj)
    # Kill the operator as soon as it has started creating children: some services are half
    # built, some not started.
    wait_until(
        lambda: get_json(
            cp,
            "-n",
            namespace,
            "configmaps",
            "-l",
            "app.kubernetes.io/managed-by=splitserve-operator",
        )["items"],
        "first child created",
    )
    operator.stop(signal.SIGKILL)
    operator.start()
    for i in range(5):
        wait_ready(cp, namespace, f"svc-{i}")
    deployments = get_json(cp, "-n", namespace, "deployments")["items"]
    assert len(deployments) == 15
    replicasets = get_json(cp, "-n", namespace, "replicasets")["items"]
    assert len(replicasets) == 15  # one per Deployment: no spurious template changes
    services = get_json(cp, "-n", namespace, "services")["items"]
    assert len(services) == 15


def ratio_patch(
    ratio: dict[str, Any],
    mode: str = "Builtin",
    prefill: tuple[int, int] = (1, 4),
    decode: tuple[int, int] = (1, 8),
) -> dict[str, Any]:
    """A spec patch with autoscaling.prefillPerDecode and both pools' replica bounds."""
    patch: dict[str, Any] = {"autoscaling": {"mode": mode, "prefillPerDecode": ratio}}
    for name, (low, high) in (("prefill", prefill), ("decode", decode)):
        patch[name] = {"replicas": low, "autoscaling": {"minReplicas": low, "maxReplicas": high}}
    return patch


INVALID: list[tuple[str, Any, str]] = [
    ("negative replicas", {"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
    (
        "min above max",
        {"decode": {"replicas": 2, "autoscaling": {"minReplicas": 4, "maxReplicas": 2}}},
        "spec.decode",
    ),
    (
        "replicas outside bounds",
        {"decode": {"replicas": 9, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}},
        "spec.decode",
    ),
    ("bad duration", {"slo": {"ttft": "fast"}}, "spec.slo.ttft"),
    ("zero duration", {"slo": {"tpot": "0s"}}, "spec.slo.tpot"),
    ("sub-microsecond ttft", {"slo": {"ttft": "500ns"}}, "spec.slo.ttft"),
    ("sub-microsecond tpot", {"slo": {"tpot": "0.5us"}}, "spec.slo.tpot"),
    ("percentile 150", {"slo": {"percentile": 150}}, "spec.slo.percentile"),
    ("17 draft tokens", {"decode": {"speculativeTokens": 17}}, "spec.decode.speculativeTokens"),
    ("unknown field", {"decode": {"replicas": 1, "maxBatchSise": 8}}, "maxBatchSise"),
    ("missing model", {"model": None}, "spec.model"),
    ("missing pool", {"prefill": None}, "spec.prefill"),
    ("bad autoscaling mode", {"autoscaling": {"mode": "Sometimes"}}, "spec.autoscaling.mode"),
    ("HPA without bounds", {"autoscaling": {"mode": "HPA"}}, "spec"),
    (
        "KEDA trigger without a type",
        {
            "autoscaling": {"mode": "KEDA"},
            "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
            "decode": {"autoscaling": {"triggers": [{"metadata": {"value": "1"}}]}},
        },
        "spec.decode.autoscaling.triggers[0].type",
    ),
    (
        "HPA with minReplicas 0",
        {
            "autoscaling": {"mode": "HPA"},
            "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "decode": {"replicas": 1, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
        },
        "spec.decode.autoscaling.minReplicas must be at least 1 when spec.autoscaling.mode is HPA",
    ),
    (
        "KV usage target above 1",
        {"autoscaling": {"targets": {"kvCacheUsage": 1.5}}},
        "spec.autoscaling.targets.kvCacheUsage",
    ),
    (
        "prefillPerDecode min above max",
        ratio_patch({"min": 2, "max": 0.5}),
        "prefillPerDecode.min must be <= prefillPerDecode.max",
    ),
    (
        "prefillPerDecode zero",
        ratio_patch({"max": 0}),
        "spec.autoscaling.prefillPerDecode.max",
    ),
    (
        "prefillPerDecode outside Builtin",
        ratio_patch({"max": 1}, mode="HPA"),
        "spec.autoscaling.prefillPerDecode applies only when spec.autoscaling.mode is Builtin",
    ),
    (
        "prefillPerDecode max that cannot hold",
        ratio_patch({"max": 1}, prefill=(4, 8), decode=(1, 2)),
        "spec.autoscaling.prefillPerDecode.max cannot hold",
    ),
    (
        "prefillPerDecode min that cannot hold",
        ratio_patch({"min": 0.5}, prefill=(1, 1), decode=(4, 8)),
        "spec.autoscaling.prefillPerDecode.min cannot hold",
    ),
    (
        "two volume sources",
        {
            "model": {
                "name": "m",
                "path": "/models/m",
                "volume": {"hostPath": {"path": "/a"}, "nfs": {"server": "s", "path": "/b"}},
            }
        },
        "spec.model.volume",
    ),
    (
        "requests above limits",
        {
            "decode": {
                "resources": {
                    "requests": {"memory": "2Gi", "cpu": "500m"},
                    "limits": {"memory": "1536Mi", "cpu": 1},
                }
            }
        },
        "spec.decode.resources: Invalid value",
    ),  # fmt: skip
    (
        "GPU request without a limit",
        {"decode": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
        "spec.decode.resources: Invalid value",
    ),
    (
        "GPU request below its limit",
        {
            "decode": {
                "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}
            }
        },
        "spec.decode.resources: Invalid value",
    ),
    (
        "annotation key prefix over 253 characters",
        {"prefill": {"podAnnotations": {"a" * 254 + "/x": "a"}}},
        "spec.prefill.podAnnotations: Invalid value",
    ),
    (
        "annotation key with a space",
        {"prefill": {"podAnnotations": {"team name": "a"}}},
        "spec.prefill.podAnnotations: Invalid value",
    ),
    (
        "annotation key name over 63 characters",
        {"prefill": {"podAnnotations": {"example.com/" + "a" * 64: "a"}}},
        "spec.prefill.podAnnotations: Invalid value",
    ),
    (
        "node selector value with a slash",
        {"decode": {"nodeSelector": {"pool": "gpu/a100"}}},
        "spec.decode.nodeSelector: Invalid value",
    ),
    (
        "model path beside the mount",
        {
            "model": {
                "name": "m",
                "path": "/models-old/m",
                "mountPath": "/models",
                "volume": {"emptyDir": {}},
            }
        },
        "spec.model.path must lie under spec.model.mountPath",
    ),
]


@pytest.mark.parametrize(("case", "patch", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_llmservices_are_rejected_naming_the_field(
    control_plane: Any,
    cluster_release: Any,  # installs the CRD, so the test does not depend on test order
    namespace: str,
    case: str,
    patch: dict[str, Any],
    field: str,
) -> None:
    obj = yaml.safe_load(TINY)
    obj["metadata"]["name"] = "bad"
    for key, value in patch.items():
        if value is None:
            obj["spec"].pop(key)
        elif isinstance(value, dict) and isinstance(obj["spec"].get(key), dict):
            obj["spec"][key].update(value)
        else:
            obj["spec"][key] = value
    # kubectl's default --validate=strict: the server rejects unknown fields instead of pruning.
    proc = control_plane.kubectl(
        "create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False
    )
    assert proc.returncode != 0, f"{case}: accepted\n{proc.stdout}"
    assert field in proc.stderr, proc.stderr
    assert llms(control_plane, namespace, "bad") is None


@pytest.mark.parametrize(
    ("path", "mount_path"),
    [("/models", "/models"), ("/models/m", "/models/"), ("/opt/m", "/opt/")],
)
def test_model_path_at_or_under_the_mount_is_accepted(
    control_plane: Any, cluster_release: Any, namespace: str, path: str, mount_path: str
) -> None:
    obj = yaml.safe_load(TINY)
    obj["spec"]["model"].update(path=path, mountPath=mount_path)
    proc = control_plane.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "example", sorted(p.name for p in (REPO_ROOT / "manifests" / "examples").glob("*.yaml"))
)
def test_every_example_is_accepted_and_parses(
    control_plane: Any, cluster_release: Any, namespace: str, example: str
) -> None:
    text = (REPO_ROOT / "manifests" / "examples" / example).read_text()
    proc = control_plane.kubectl(
        "create", "--dry-run=server", "-o", "json", "-n", namespace, "-f", "-", input=text,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # What the API server stored (defaults filled in) is a spec the operator accepts.
    parse_spec(json.loads(proc.stdout)["spec"])


@pytest.mark.parametrize(
    "ratio", [{"min": 1, "max": 2}, {"min": 0.25, "max": 1.5}, {"max": 1}, {"min": 0.5}]
)
def test_prefill_per_decode_bounds_that_can_hold_are_accepted(
    control_plane: Any, cluster_release: Any, namespace: str, ratio: dict[str, Any]
) -> None:
    # Integers and fractions alike (the CEL rules compare them as doubles).
    obj = yaml.safe_load(TINY)
    for key, value in ratio_patch(ratio, prefill=(1, 4), decode=(2, 4)).items():
        obj["spec"].setdefault(key, {}).update(value)
    proc = control_plane.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_resources_annotations_and_node_selectors_that_kubernetes_takes_are_accepted(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    # The CEL rules refuse only what the pods themselves would be refused for.
    obj = yaml.safe_load(TINY)
    obj["spec"]["decode"].update(
        resources={
            "requests": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": 1},
            "limits": {"cpu": 1, "memory": "1024Mi", "nvidia.com/gpu": "1"},
        },
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": ""},
        # Annotation keys are checked case-insensitively, as the API server does for pods.
        podAnnotations={"prometheus.io/scrape": "true", "Example.COM/Team": "inference a/b"},
    )
    obj["spec"]["prefill"]["resources"] = {"requests": {"cpu": 2}}  # requests without limits
    proc = control_plane.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_crd_defaults_and_printer_columns(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    minimal = {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "minimal"},
        "spec": {"model": {"name": "m", "path": "/models/m"}, "prefill": {}, "decode": {}},
    }
    apply(control_plane, namespace, minimal)
    spec = llms(control_plane, namespace, "minimal")["spec"]  # type: ignore[index]
    assert spec["router"] == {
        "replicas": 1,
        "port": 8000,
        "serviceType": "ClusterIP",
        "logRequests": False,
        "toolCallParser": "auto",
        "reasoningParser": "auto",
        "admissionTimeout": "30s",
        "writeTimeout": "60s",
        "topologySpread": {
            "enabled": True,
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
        },
    }
    assert spec["slo"] == {"ttft": "500ms", "tpot": "50ms", "percentile": 95}
    assert spec["autoscaling"]["mode"] == "Off"
    assert spec["decode"]["maxBatchSize"] == 128
    table = control_plane.kubectl("get", "-n", namespace, "llms").stdout.split("\n")[0].split()
    assert table == ["NAME", "READY", "DEGRADED", "PREFILL", "DECODE", "TTFT", "TPOT", "AGE"]
    wide = control_plane.kubectl("get", "-n", namespace, "llms", "-o", "wide").stdout
    assert wide.split("\n")[0].split()[8:] == ["REASON", "MODE", "ENDPOINT", "MESSAGE"]


def test_fifty_services_in_five_namespaces(control_plane: Any, operator: OperatorProcess) -> None:
    cp = control_plane
    run = uuid.uuid4().hex[:6]
    namespaces = [cp.create_namespace(f"fleet-{run}-{i}") for i in range(5)]
    try:
        docs = []
        for i in range(50):
            docs.append(
                {
                    "apiVersion": "splitserve.io/v1alpha1",
                    "kind": "LLMService",
                    "metadata": {"name": f"svc-{i}", "namespace": namespaces[i % 5]},
                    "spec": {
                        "model": {"name": "m", "path": "/models/m"},
                        "prefill": {},
                        "decode": {},
                    },
                }
            )
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        names = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs}

        def all_ready() -> bool:  # one list call per poll: 50 kubectl calls would eat the CPU
            items = get_json(cp, "llmservices", "-A")["items"]
            ready = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in items
                     if is_ready(o)}  # fmt: skip
            return names <= ready

        wait_until(all_ready, "50 LLMServices Ready", timeout=900)
        all_deps = get_json(
            cp, "deployments", "-A", "-l", "app.kubernetes.io/managed-by=splitserve-operator"
        )["items"]
        ours = [d for d in all_deps if d["metadata"]["namespace"] in namespaces]
        assert len(ours) == 150
    finally:
        for ns in namespaces:
            cp.kubectl("delete", "llmservices", "--all", "-n", ns, "--wait=true", check=False)
            cp.delete_namespace(ns)
