"""The built-in autoscaler end to end: the operator (chart RBAC) reads a real Prometheus, scales
the real Deployments on the real control plane, and explains itself in status, conditions and
Events. Pods on kwok nodes run no process, so the test exports their metrics (the workers' own
metric classes, tests/operator/fleet.py) under their real pod names; Prometheus scrapes those
with the namespace and pod labels a Kubernetes scrape adds."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import plane
import pytest
from fleet import Fleet
from operator_process import OperatorProcess, conditions, get_json, wait_until
from splitserve_operator.names import METRICS_PORT
from test_operator_cluster import apply, deployment, llms, tiny, wait_ready

pytestmark = pytest.mark.cluster

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def pods_of(cp: Any, namespace: str, pool: str) -> list[dict[str, Any]]:
    found = get_json(
        cp, "-n", namespace, "pods", "-l", f"app.kubernetes.io/instance=chat,"
        f"app.kubernetes.io/component={pool}",
    )  # fmt: skip
    return [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]


def last(obj: dict[str, Any] | None, pool: str) -> dict[str, Any]:
    auto = ((obj or {}).get("status") or {}).get("autoscaler") or {}
    return (auto.get(pool) or {}).get("lastDecision") or {}


def events(cp: Any, namespace: str) -> list[dict[str, Any]]:
    found = get_json(
        cp, "-n", namespace, "events", "--field-selector",
        "involvedObject.kind=LLMService,involvedObject.name=chat",
    )  # fmt: skip
    return list(found["items"])


def wait_for(
    cp: Any,
    namespace: str,
    check: Callable[[], Any],
    what: str,
    timeout: float,
    operator: OperatorProcess | None = None,
) -> Any:
    """wait_until, failing with what the autoscaler last said and the decode pods' states."""
    try:
        return wait_until(check, what, timeout)
    except AssertionError as e:
        obj = llms(cp, namespace, "chat") or {}
        pods = [
            (p["metadata"]["name"], p["status"].get("phase"), p["metadata"].get("annotations"))
            for p in pods_of(cp, namespace, "decode")
        ]
        raise AssertionError(
            f"{e}\nstatus: {json.dumps(obj.get('status'), indent=1)}\ndecode pods: {pods}\n"
            + "\n".join(
                line
                for line in (operator.tail(2000) if operator else "").splitlines()
                if "autoscal" in line or "rror" in line
            )
        ) from None


def wait_decode_replicas(
    cp: Any, namespace: str, replicas: int, timeout: float, operator: OperatorProcess
) -> None:
    wait_for(
        cp,
        namespace,
        lambda: (
            (d := deployment(cp, namespace, "chat-decode")) and d["spec"]["replicas"] == replicas
        ),
        f"decode scaled to {replicas}",
        timeout,
        operator,
    )


def test_builtin_autoscaler_scales_each_pool_and_explains_it(
    control_plane: Any,
    operator: OperatorProcess,
    namespace: str,
    prometheus: Callable[..., Any],
) -> None:
    cp = control_plane
    obj = tiny(slo={"ttft": "500ms", "tpot": "50ms", "percentile": 95})
    obj["metadata"]["name"] = "chat"
    obj["spec"]["prefill"].update(replicas=1, autoscaling={"minReplicas": 1, "maxReplicas": 3})
    obj["spec"]["decode"].update(replicas=2, autoscaling={"minReplicas": 1, "maxReplicas": 4})
    # No Prometheus yet: the operator scrapes the pods itself, but these kwok pods' addresses
    # (10.244.x) lead nowhere. It says so, and scales nothing.
    obj["spec"]["autoscaling"] = {"mode": "Builtin", "interval": "1s",
                                  "scaleDownStabilization": "10s"}  # fmt: skip
    apply(cp, namespace, obj)
    wait_ready(cp, namespace, "chat")
    cond = wait_until(
        lambda: (
            conditions(llms(cp, namespace, "chat") or {}).get("Autoscaling", {}).get("reason")
            == "MetricsUnavailable"
            and conditions(llms(cp, namespace, "chat") or {})["Autoscaling"]
        ),
        "Autoscaling MetricsUnavailable",
    )
    assert cond["status"] == "False"
    assert cond["message"].startswith("the pods' /metrics, scraped by the operator: ")
    assert "the router's /metrics did not answer" in cond["message"]
    assert deployment(cp, namespace, "chat-decode")["spec"]["replicas"] == 2  # type: ignore

    # The decode pool is slow (TPOT 120 ms against 50 ms); prefill is comfortable.
    fleet = Fleet(namespace, "chat", ttft=0.1, prefill_queue=0.01, tpot=0.12)
    try:
        for pod in pods_of(cp, namespace, "prefill"):
            fleet.add_pod(pod["metadata"]["name"], "prefill", busy_fraction=0.6, running=1)
        decode_pods = sorted(p["metadata"]["name"] for p in pods_of(cp, namespace, "decode"))
        busy_pod, idle_pod = decode_pods
        fleet.add_pod(busy_pod, "decode", busy_fraction=0.9, running=8, kv_usage=0.3)
        fleet.add_pod(idle_pod, "decode", busy_fraction=0.1, running=0, kv_usage=0.05)
        targets = fleet.targets()
        prom = prometheus(list(targets), scrape_interval="1s", labels=targets)
        obj["spec"]["autoscaling"]["metrics"] = {"prometheus": {"url": prom.url}}
        apply(cp, namespace, obj)

        # Up at once: TPOT 2.4x over its objective doubles decode (2 -> 4 = maxReplicas).
        wait_until(
            lambda: (d := deployment(cp, namespace, "chat-decode")) and d["spec"]["replicas"] == 4,
            f"decode scaled to 4\n{operator.tail()}",
            120,
        )
        up = wait_until(
            lambda: (
                (o := llms(cp, namespace, "chat")) and last(o, "decode").get("replicas") == 4 and o
            ),
            "decode decision in status",
        )
        decision = last(up, "decode")
        assert decision["currentReplicas"] == 2 and decision["verdict"] == "ScaleUp"
        assert "TPOT p95" in decision["reason"] and "objective 50ms" in decision["reason"]
        assert decision["inputs"]["tpotSeconds"] > 0.1 and decision["inputs"]["reportingPods"] == 2
        assert up["status"]["autoscaler"]["decode"]["lastScaleTime"]
        assert deployment(cp, namespace, "chat-prefill")["spec"]["replicas"] == 1  # type: ignore
        # Prefill at 60% of one pod, TTFT 100 ms of 500: nothing to do either way. Until the new
        # Prometheus holds two samples of its busy seconds, its utilization is unknown
        # (NoMetrics, replicas held), which may still be so when decode, sized on TPOT, scales.
        assert last(up, "prefill")["verdict"] in ("Steady", "NoMetrics")
        steady = wait_until(
            lambda: (
                (o := llms(cp, namespace, "chat"))
                and last(o, "prefill").get("verdict") == "Steady"
                and o
            ),
            f"prefill Steady\n{operator.tail()}",
        )
        assert deployment(cp, namespace, "chat-prefill")["spec"]["replicas"] == 1  # type: ignore
        assert conditions(steady)["Autoscaling"]["status"] == "True"
        scaled = [e for e in events(cp, namespace) if e["reason"] == "ScaledUp"]
        assert scaled and scaled[0]["message"].startswith("decode 2 -> 4: TPOT p95")

        # Still slow at maxReplicas: ScalingLimited says which bound holds it.
        limited = wait_for(
            cp,
            namespace,
            lambda: (
                (o := llms(cp, namespace, "chat"))
                and conditions(o).get("ScalingLimited", {}).get("status") == "True"
                and o
            ),
            "ScalingLimited",
            120,
            operator,
        )
        assert conditions(limited)["ScalingLimited"]["reason"] == "AtMaxReplicas"
        assert "maxReplicas 4" in conditions(limited)["ScalingLimited"]["message"]
        # Evaluated every second, but a state is announced once, not every evaluation.
        time.sleep(5)
        warned = [e for e in events(cp, namespace) if e["reason"] == "ScalingLimited"]
        assert len(warned) == 1 and warned[0]["type"] == "Warning"
        assert len([e for e in events(cp, namespace) if e["reason"] == "ScaledUp"]) == 1

        # Load falls: after the stabilization window decode goes down, idlest pods first.
        fleet.tpot = 0.005
        for name, pod in fleet.pods.items():
            if name != busy_pod:
                pod.running, pod.busy_fraction = 0, 0.0
        wait_decode_replicas(cp, namespace, 1, 180, operator)
        # The decision that scaled, from its Event: by the time the test reads the status,
        # the next evaluation may have replaced lastDecision (Stabilizing while the removed
        # pods still report, a flake CI hit).
        scaled_down = wait_until(
            lambda: [
                e
                for e in events(cp, namespace)
                if e["reason"] == "ScaledDown" and " -> 1: " in e["message"]
            ],
            "the ScaledDown event to 1 replica",
        )
        assert "predicted TPOT" in scaled_down[0]["message"]
        # The ReplicaSet removed the pods the autoscaler marked cheapest; the busy one stays.
        survivors = wait_until(
            lambda: (p := pods_of(cp, namespace, "decode")) and len(p) == 1 and p,
            "one decode pod left",
        )
        assert survivors[0]["metadata"]["name"] == busy_pod
        assert survivors[0]["metadata"]["annotations"][DELETION_COST] == "8"
        assert "ScaledDown" in {e["reason"] for e in events(cp, namespace)}

        # Prometheus goes away: the autoscaler holds and says so.
        obj["spec"]["autoscaling"]["metrics"] = {
            "prometheus": {"url": f"http://127.0.0.1:{plane.free_port()}"}
        }
        apply(cp, namespace, obj)
        cond = wait_until(
            lambda: (
                (c := conditions(llms(cp, namespace, "chat") or {}).get("Autoscaling"))
                and c["reason"] == "MetricsUnavailable"
                and c
            ),
            "Autoscaling MetricsUnavailable",
        )
        assert cond["status"] == "False" and "cannot query Prometheus" in cond["message"]
        held = llms(cp, namespace, "chat") or {}
        assert conditions(held)["ScalingLimited"]["status"] == "False"
        assert deployment(cp, namespace, "chat-decode")["spec"]["replicas"] == 1  # type: ignore
        assert "MetricsUnavailable" in {e["reason"] for e in events(cp, namespace)}

        # Leaving Builtin stops the daemon and clears what it wrote.
        obj["spec"]["autoscaling"] = {"mode": "Off"}
        apply(cp, namespace, obj)
        off = wait_until(
            lambda: (
                (o := llms(cp, namespace, "chat"))
                and "autoscaler" not in o["status"]
                and conditions(o)["Autoscaling"]["reason"] == "Off"
                and o
            ),
            "autoscaler status cleared",
        )
        assert "ScalingLimited" not in conditions(off)
    finally:
        fleet.close()
        # Deleted while the operator still runs, so its finalizer goes with it (a resource left
        # behind with a finalizer would hold a later CRD deletion in Terminating).
        cp.kubectl("delete", "-n", namespace, "llmservice", "chat", "--timeout=60s", check=False)


def test_deleting_an_autoscaled_llmservice_stops_its_daemon(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    obj = tiny()
    obj["metadata"]["name"] = "chat"
    for pool in ("prefill", "decode"):
        obj["spec"][pool]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2}
    obj["spec"]["autoscaling"] = {"mode": "Builtin", "interval": "1s"}
    apply(cp, namespace, obj)
    wait_until(
        lambda: (llms(cp, namespace, "chat") or {}).get("status", {}).get("autoscaler"),
        "the daemon's first evaluation",
    )
    # kopf stops the daemon before it lets the finalizer go; a daemon that did not stop would
    # hold the deletion until kubectl gives up (and fail this call).
    cp.kubectl("delete", "-n", namespace, "llmservice", "chat", "--timeout=60s")
    assert llms(cp, namespace, "chat") is None
    assert "autoscaler evaluation failed" not in operator.tail(400)


def test_without_prometheus_the_operator_scrapes_the_pods(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    """No Prometheus anywhere: the operator reads the router's and workers' /metrics pages
    itself. The pods run on a kwok node whose pod network is a loopback /24, so each pod's IP
    is an address this test listens on, at the pod's own ports, with the workers' metric
    classes behind it."""
    cp = control_plane
    node = f"kwok-loopback-{namespace[-6:]}"
    net = f"127.{random.randint(100, 250)}.{random.randint(0, 255)}"
    taint = {"key": "splitserve.test/loopback", "value": "true", "effect": "NoSchedule"}
    cp.create_node(node, pod_cidr=f"{net}.0/24", taints=[taint])
    placement = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"key": "splitserve.test/loopback", "operator": "Exists"}],
    }
    router_port = plane.free_port()
    obj = tiny(slo={"ttft": "500ms", "tpot": "50ms", "percentile": 95})
    obj["metadata"]["name"] = "chat"
    obj["spec"]["router"].update(port=router_port, **placement)
    obj["spec"]["prefill"].update(
        replicas=1, autoscaling={"minReplicas": 1, "maxReplicas": 1}, **placement
    )
    obj["spec"]["decode"].update(
        replicas=2, autoscaling={"minReplicas": 1, "maxReplicas": 3}, **placement
    )
    obj["spec"]["autoscaling"] = {"mode": "Builtin", "interval": "1s",
                                  "scaleDownStabilization": "10s"}  # fmt: skip
    fleet: Fleet | None = None
    try:
        apply(cp, namespace, obj)
        wait_ready(cp, namespace, "chat")
        ip = {
            p["metadata"]["name"]: p["status"]["podIP"]
            for pool in ("router", "prefill", "decode")
            for p in pods_of(cp, namespace, pool)
        }
        assert all(a.startswith(net + ".") for a in ip.values()), ip
        (router,) = pods_of(cp, namespace, "router")
        fleet = Fleet(
            namespace, "chat", ttft=0.1, prefill_queue=0.01, tpot=0.12,
            router_address=(ip[router["metadata"]["name"]], router_port),
        )  # fmt: skip
        (prefill,) = pods_of(cp, namespace, "prefill")
        name = prefill["metadata"]["name"]
        fleet.add_pod(name, "prefill", (ip[name], METRICS_PORT), busy_fraction=0.3, running=1)
        busy_pod, idle_pod = sorted(p["metadata"]["name"] for p in pods_of(cp, namespace, "decode"))
        fleet.add_pod(busy_pod, "decode", (ip[busy_pod], METRICS_PORT), running=8, kv_usage=0.3)
        fleet.add_pod(idle_pod, "decode", (ip[idle_pod], METRICS_PORT), running=0, kv_usage=0.05)

        # TPOT 120 ms against 50 ms: decode grows (2 -> 3, its maxReplicas), on pages the
        # operator fetched itself.
        wait_decode_replicas(cp, namespace, 3, 120, operator)
        obj_now = llms(cp, namespace, "chat") or {}
        auto = obj_now["status"]["autoscaler"]
        assert auto["metricsSource"] == "the pods' /metrics, scraped by the operator"
        up = next(e for e in events(cp, namespace) if e["reason"] == "ScaledUp")
        assert up["message"].startswith("decode 2 -> 3: TPOT p95")
        assert conditions(obj_now)["Autoscaling"]["status"] == "True"

        # Load falls: the idle pods go, and the busy one survives (its deletion cost comes from
        # the sequences its page reports).
        fleet.tpot = 0.005
        for name, pod in fleet.pods.items():
            if name != busy_pod:
                pod.running = 0
        wait_decode_replicas(cp, namespace, 1, 180, operator)
        survivors = wait_until(
            lambda: (p := pods_of(cp, namespace, "decode")) and len(p) == 1 and p,
            "one decode pod left",
        )
        assert survivors[0]["metadata"]["name"] == busy_pod
        assert survivors[0]["metadata"]["annotations"][DELETION_COST] == "8"
        down = last(llms(cp, namespace, "chat"), "decode")
        assert down["verdict"] == "ScaleDown" and down["inputs"]["reportingPods"] >= 1
    finally:
        if fleet is not None:
            fleet.close()
        cp.kubectl("delete", "-n", namespace, "llmservice", "chat", "--timeout=60s", check=False)
        cp.kubectl("delete", "node", node, "--timeout=60s", check=False)
