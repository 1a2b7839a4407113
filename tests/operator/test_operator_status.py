"""status.compute_status: conditions in metav1.Condition shape from live Deployments, and
status.pod_trouble: why a pool's pods are not running, from pod objects as the API returns them."""

from __future__ import annotations

from typing import Any

import pytest
from splitserve_operator.spec import parse_spec
from splitserve_operator.status import compute_status, failing_pods, merge_conditions, pod_trouble

SPEC = parse_spec(
    {
        "model": {"name": "m", "path": "/models/m"},
        "router": {"replicas": 1},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 3},
    }
)


def deployment(
    replicas: int,
    ready: int,
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
    stuck: bool = False,
) -> dict[str, Any]:
    conditions = []
    if stuck:
        conditions.append(
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "timed out",
            }
        )
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "observedGeneration": observed,
            "conditions": conditions,
        },
    }


def status(
    deps: dict,
    generation: int = 4,
    observed: int = 4,
    previous: Any = None,
    now: str = "2025-01-01T00:00:00Z",
    spec: Any = SPEC,
    error: str | None = None,
    trouble: dict[str, str] | None = None,
    autoscaler: dict[str, Any] | None = None,
) -> dict:
    return compute_status(
        service="chat",
        namespace="ns",
        spec=spec,
        generation=generation,
        observed_generation=observed,
        deployments=deps,
        previous_conditions=previous,
        now=now,
        error=error,
        trouble=trouble,
        autoscaler=autoscaler,
    )


def conds(st: dict) -> dict[str, dict]:
    return {c["type"]: c for c in st["conditions"]}


ALL_READY = {"router": deployment(1, 1), "prefill": deployment(2, 2), "decode": deployment(3, 3)}


def test_ready_when_every_pool_is_rolled_out() -> None:
    st = status(ALL_READY)
    c = conds(st)
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "AllPoolsReady"
    assert c["Progressing"]["status"] == "False"
    assert c["Degraded"]["status"] == "False"
    for cond in c.values():
        assert set(cond) == {
            "type",
            "status",
            "reason",
            "message",
            "observedGeneration",
            "lastTransitionTime",
        }
        assert cond["observedGeneration"] == 4
    assert st["observedGeneration"] == 4
    assert st["endpoint"] == "http://chat-router.ns.svc:8000"
    assert st["decode"] == {
        "replicas": 3,
        "readyReplicas": 3,
        "updatedReplicas": 3,
        "desiredReplicas": 3,
        "ready": "3/3",
    }


def test_not_ready_while_rolling_or_missing_or_pending() -> None:
    rolling = {**ALL_READY, "decode": deployment(3, 1)}
    c = conds(status(rolling))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "RollingOut"
    assert "decode 1/3 ready, 3/3 updated" in c["Ready"]["message"]
    # Old pods all ready, none on the new template yet: the message must not read as done.
    replacing = {**ALL_READY, "decode": deployment(3, 3, updated=0)}
    c = conds(status(replacing))
    assert c["Ready"]["message"] == "pools not ready: decode 3/3 ready, 0/3 updated"
    assert c["Progressing"]["status"] == "True"
    c = conds(status({"router": ALL_READY["router"]}))
    assert c["Ready"]["reason"] == "ChildrenMissing"
    c = conds(status(ALL_READY, generation=5, observed=4))
    assert c["Ready"]["reason"] == "Reconciling" and c["Progressing"]["status"] == "True"
    old_template = {**ALL_READY, "prefill": deployment(2, 2, generation=2, observed=1)}
    assert conds(status(old_template))["Ready"]["status"] == "False"


def test_degraded_on_stuck_rollout_or_error() -> None:
    stuck = {**ALL_READY, "prefill": deployment(2, 1, stuck=True)}
    c = conds(status(stuck))
    assert c["Degraded"]["status"] == "True"
    assert "ProgressDeadlineExceeded" in c["Degraded"]["message"]
    c = conds(status(ALL_READY, error="PATCH ...: HTTP 403: forbidden"))
    assert c["Degraded"]["reason"] == "ReconcileFailed" and c["Ready"]["status"] == "False"


def test_transition_time_moves_only_when_status_changes() -> None:
    first = status(ALL_READY, now="2025-01-01T00:00:00Z")
    again = status(ALL_READY, previous=first["conditions"], now="2025-01-01T00:05:00Z")
    assert [c["lastTransitionTime"] for c in again["conditions"]] == ["2025-01-01T00:00:00Z"] * 4
    rolling = {**ALL_READY, "decode": deployment(3, 2)}
    later = status(rolling, previous=again["conditions"], now="2025-01-01T00:09:00Z")
    c = conds(later)
    assert c["Ready"]["lastTransitionTime"] == "2025-01-01T00:09:00Z"
    assert c["Progressing"]["lastTransitionTime"] == "2025-01-01T00:09:00Z"
    assert c["Degraded"]["lastTransitionTime"] == "2025-01-01T00:00:00Z"


def test_merge_conditions_stamps_new_types() -> None:
    merged = merge_conditions(None, [{"type": "Ready", "status": "True"}], "T")
    assert merged == [{"type": "Ready", "status": "True", "lastTransitionTime": "T"}]


def test_autoscaled_pools_report_the_deployments_replicas() -> None:
    spec = parse_spec(
        {
            "model": {"name": "m", "path": "/models/m"},
            "prefill": {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}},
            "decode": {"replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}},
            "autoscaling": {"mode": "HPA"},
        }
    )
    deps = {**ALL_READY, "decode": deployment(6, 6)}  # an HPA scaled decode to 6
    st = status(deps, spec=spec)
    assert st["decode"]["desiredReplicas"] == 6
    assert conds(st)["Ready"]["status"] == "True"


UNSCHEDULABLE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def pod(
    *,
    unschedulable: str | None = None,
    waiting: tuple[str, str] | None = None,
    deleting: bool = False,
    phase: str = "Pending",
    name: str = "p",
    last_exit: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """A pod shaped like the API's: PodScheduled=False/Unschedulable as the scheduler writes it,
    a container waiting as the kubelet reports it."""
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if unschedulable:
        status["conditions"].append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        )
    if waiting:
        reason, message = waiting
        status["containerStatuses"] = [
            {"name": "worker", "state": {"waiting": {"reason": reason, "message": message}}}
        ]
        if last_exit:
            ended = {"reason": last_exit[0], "exitCode": last_exit[1]}
            status["containerStatuses"][0]["lastState"] = {"terminated": ended}
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": status}


def test_pod_trouble_groups_causes_with_counts() -> None:
    assert pod_trouble([]) is None
    assert pod_trouble([pod(), pod(waiting=("ContainerCreating", ""))]) is None  # just starting
    pull = ("ImagePullBackOff", 'Back-off pulling image "ghcr.io/x/worker:nope"')
    got = pod_trouble(
        [pod(unschedulable=UNSCHEDULABLE), pod(unschedulable=UNSCHEDULABLE), pod(waiting=pull)]
    )
    assert got == (
        f"2 pods unschedulable: {UNSCHEDULABLE}; "
        '1 pod ImagePullBackOff (worker): Back-off pulling image "ghcr.io/x/worker:nope"'
    )
    # Pods being deleted (an old ReplicaSet's) are not the pool's problem.
    assert pod_trouble([pod(unschedulable=UNSCHEDULABLE, deleting=True)]) is None
    long = pod_trouble([pod(unschedulable="x" * 5000)])
    assert long is not None and len(long) < 300


def crash_looping(name: str, back_off: str, last_exit: tuple[str, int]) -> dict[str, Any]:
    # The kubelet's own message names the pod and its current back-off.
    message = (
        f"back-off {back_off} restarting failed container=worker pod={name}_team-a(uid-{name})"
    )
    return pod(name=name, waiting=("CrashLoopBackOff", message), last_exit=last_exit)


def test_pod_trouble_groups_crash_loops_of_different_pods() -> None:
    # Pods of one pool crash-looping alike are one cause, quoted by how they last ended; the
    # kubelet's message (pod name, back-off that doubles at each restart) would make each pod
    # its own clause and change the text, hence rewrite the status, on every resync.
    pods = [
        crash_looping("chat-decode-a", "40s", ("OOMKilled", 137)),
        crash_looping("chat-decode-b", "5m0s", ("OOMKilled", 137)),
    ]
    assert pod_trouble(pods) == "2 pods CrashLoopBackOff (worker): last exit OOMKilled, code 137"
    # A restart later: the back-off has doubled and the API lists the pods the other way round.
    later = [pods[1], crash_looping("chat-decode-a", "1m20s", ("OOMKilled", 137))]
    assert pod_trouble(later) == pod_trouble(pods)
    assert pod_trouble([pod(waiting=("CrashLoopBackOff", "back-off 10s"))]) == (
        "1 pod CrashLoopBackOff (worker)"
    )


def test_pod_trouble_text_does_not_depend_on_pod_order_and_stays_short() -> None:
    causes = [pod(name=f"p{i}", unschedulable=f"reason {i}") for i in range(6)]
    causes += [pod(name="q", unschedulable="reason 5")]
    got = pod_trouble(causes)
    assert got == pod_trouble(list(reversed(causes)))
    assert got is not None and got.startswith("2 pods unschedulable: reason 5; ")
    assert got.count("unschedulable") == 3 and got.endswith("; 3 more pods with other causes")


def test_ready_message_says_why_pods_are_not_running() -> None:
    why = f"2 pods unschedulable: {UNSCHEDULABLE}"
    rolling = {**ALL_READY, "decode": deployment(3, 1)}
    c = conds(status(rolling, trouble={"decode": why}))
    assert c["Ready"]["reason"] == "RollingOut"
    assert c["Ready"]["message"] == f"pools not ready: decode 1/3 ready, 3/3 updated ({why})"
    # Only pools that are not ready are explained.
    c = conds(status(ALL_READY, trouble={"decode": why}))
    assert c["Ready"]["status"] == "True" and why not in c["Ready"]["message"]


BOUNDS = {"minReplicas": 1, "maxReplicas": 8}


def spec_in(mode: str, **autoscaling: Any) -> Any:
    return parse_spec(
        {
            "model": {"name": "m", "path": "/models/m"},
            "prefill": {"replicas": 2, "autoscaling": BOUNDS},
            "decode": {"replicas": 3, "autoscaling": BOUNDS},
            "autoscaling": {"mode": mode, **autoscaling},
        }
    )


@pytest.mark.parametrize(
    ("mode", "autoscaler", "status_", "reason", "words"),
    [
        ("Off", None, "False", "Off", "the operator keeps spec.<pool>.replicas"),
        ("HPA", None, "Unknown", "HPAPending", "not created yet: chat-prefill, chat-decode"),
        ("Builtin", None, "Unknown", "Starting", "has not evaluated yet"),
        (
            "Builtin",
            {"state": "Active", "message": "prefill: Steady (...); decode: ScaleUp (...)"},
            "True",
            "Active",
            "decode: ScaleUp",
        ),
        (
            "Builtin",
            {"state": "MetricsUnavailable", "message": "http://prom:9090: connection refused"},
            "False",
            "MetricsUnavailable",
            "connection refused",
        ),
    ],
)
def test_autoscaling_condition_says_who_sizes_the_pools(
    mode: str, autoscaler: dict[str, Any] | None, status_: str, reason: str, words: str
) -> None:
    # `kubectl describe` must answer "why did it not scale": who owns replicas and, for the
    # built-in autoscaler, whether it can read its metrics and what it decided.
    st = status(ALL_READY, spec=spec_in(mode), autoscaler=autoscaler)
    c = conds(st)["Autoscaling"]
    assert (c["status"], c["reason"]) == (status_, reason)
    assert words in c["message"]
    assert c["observedGeneration"] == 4
    assert ("ScalingLimited" in conds(st)) == (mode != "Off")


def test_scaling_limited_names_the_bound() -> None:
    limited = {
        "state": "Active",
        "message": "...",
        "decode": {
            "lastDecision": {"verdict": "AtMaxReplicas", "reason": "TPOT ...; maxReplicas 8"}
        },
    }
    c = conds(status(ALL_READY, spec=spec_in("Builtin"), autoscaler=limited))["ScalingLimited"]
    assert (c["status"], c["reason"]) == ("True", "AtMaxReplicas")
    assert c["message"] == "decode: TPOT ...; maxReplicas 8"
    # When it can no longer measure, the old AtMaxReplicas is history, not a current limit.
    stale = {**limited, "state": "MetricsUnavailable"}
    c = conds(status(ALL_READY, spec=spec_in("Builtin"), autoscaler=stale))["ScalingLimited"]
    assert (c["status"], c["reason"]) == ("False", "MetricsUnavailable")
    free = {"state": "Active", "decode": {"lastDecision": {"verdict": "ScaleUp"}}}
    c = conds(status(ALL_READY, spec=spec_in("Builtin"), autoscaler=free))["ScalingLimited"]
    assert (c["status"], c["reason"]) == ("False", "WithinLimits")
    # A scale-up trimmed by the P:D ratio is a limit; a pool raised by it is not.
    ratio = {
        "state": "Active",
        "prefill": {"lastDecision": {"verdict": "RatioLimited", "reason": "...; limited to 2"}},
        "decode": {"lastDecision": {"verdict": "RatioBound", "reason": "...; 3 to keep"}},
    }
    c = conds(status(ALL_READY, spec=spec_in("Builtin"), autoscaler=ratio))["ScalingLimited"]
    assert (c["status"], c["reason"], c["message"]) == (
        "True",
        "RatioLimited",
        "prefill: ...; limited to 2",
    )


def test_leaving_builtin_clears_the_autoscaler_status() -> None:
    left = {"state": "Active", "decode": {"lastDecision": {"verdict": "ScaleUp"}}}
    assert status(ALL_READY, spec=spec_in("Off"), autoscaler=left)["autoscaler"] is None
    assert "autoscaler" not in status(ALL_READY, spec=spec_in("Off"))
    assert "autoscaler" not in status(ALL_READY, spec=spec_in("Builtin"), autoscaler=left)


def test_autoscaling_fields_parse() -> None:
    spec = spec_in(
        "Builtin",
        interval="5s",
        scaleDownStabilization="2m",
        gpuBudget=12,
        metrics={"prometheus": {"url": "http://prom.monitoring:9090"}},
    )
    assert (spec.autoscaling_interval, spec.scale_down_stabilization) == (5.0, 120.0)
    assert (spec.gpu_budget, spec.prometheus_url) == (12, "http://prom.monitoring:9090")
    defaults = spec_in("Builtin")
    assert (defaults.autoscaling_interval, defaults.scale_down_stabilization) == (15.0, 300.0)
    assert (defaults.gpu_budget, defaults.prometheus_url) == (None, None)


def test_a_pool_the_autoscaler_put_to_sleep_is_not_unready() -> None:
    asleep = {**ALL_READY, "decode": deployment(0, 0)}
    c = conds(status(asleep, spec=spec_in("Builtin")))["Ready"]
    assert (c["status"], c["reason"]) == ("True", "PoolsAsleep")
    assert c["message"] == "scaled to zero: decode (they wake when requests reach the router)"
    # In mode Off nobody wakes it (and spec.decode.replicas asks for 3): not ready.
    c = conds(status(asleep, spec=spec_in("Off")))["Ready"]
    assert c["status"] == "False" and c["reason"] != "PoolsAsleep"


def test_failing_pods_are_the_placed_ones_that_cannot_run() -> None:
    crash = pod(name="crash", waiting=("CrashLoopBackOff", "back-off 40s"), last_exit=("Error", 1))
    pull = pod(name="pull", waiting=("ImagePullBackOff", "Back-off pulling image"))
    # Not failing: a pod the scheduler cannot place yet (a node may free up or be added), one
    # just starting, one on its way out, one that ended (evicted: its ReplicaSet replaced it,
    # and the pod object lingers until pod garbage collection).
    evicted = pod(name="evicted", phase="Failed")
    evicted["status"].update(reason="Evicted", message="The node was low on resource: memory.")
    waiting = [
        pod(name="pending", unschedulable=UNSCHEDULABLE),
        pod(name="starting", waiting=("ContainerCreating", "")),
        pod(name="going", waiting=("CrashLoopBackOff", ""), deleting=True),
        evicted,
    ]
    got = failing_pods([crash, *waiting, pull])
    assert [p["metadata"]["name"] for p in got] == ["crash", "pull"]
    assert failing_pods(waiting) == []
