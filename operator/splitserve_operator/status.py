"""LLMService status from what the cluster reports: per-pool replica counts from the Deployments,
and Ready / Progressing / Degraded conditions in metav1.Condition shape, whose
lastTransitionTime moves only when a condition's status changes. Pure: handlers.py supplies the
live Deployments and the clock (now_rfc3339)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .autoscaler import ACTIVE, LIMITED
from .keda import keda_condition
from .spec import POOLS, Spec


def now_rfc3339() -> str:
    """The clock in the format of status timestamps (metav1.Time, whole seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PoolState:
    desired: int
    replicas: int
    ready: int
    updated: int
    rolled_out: bool  # the Deployment controller has seen the latest template
    failure: str | None  # why the Deployment is stuck, if it says so


def pool_state(deployment: dict[str, Any] | None, spec_replicas: int, mode: str) -> PoolState:
    if deployment is None:
        return PoolState(spec_replicas, 0, 0, 0, False, None)
    meta = deployment.get("metadata") or {}
    dspec = deployment.get("spec") or {}
    dstatus = deployment.get("status") or {}
    # In Builtin/HPA mode the autoscaler owns replicas: what the Deployment asks for is the truth.
    desired = spec_replicas if mode == "Off" else int(dspec.get("replicas", spec_replicas))
    failure = None
    for cond in dstatus.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("status") == "False":
            failure = f"{cond.get('reason')}: {cond.get('message')}"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"{cond.get('reason')}: {cond.get('message')}"
    return PoolState(
        desired=desired,
        replicas=int(dstatus.get("replicas") or 0),
        ready=int(dstatus.get("readyReplicas") or 0),
        updated=int(dstatus.get("updatedReplicas") or 0),
        rolled_out=int(dstatus.get("observedGeneration") or 0) >= int(meta.get("generation") or 0),
        failure=failure,
    )


# Container waiting reasons that waiting a few seconds does not fix: worth telling the user.
STUCK_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "RunContainerError",
    }
)
TROUBLE_MESSAGE_CHARS = 240  # per distinct cause; status stays small
TROUBLE_MAX_CAUSES = 3  # the most common ones; the rest are counted


def _waiting_detail(cs: dict[str, Any], reason: str, message: str) -> str:
    """What to quote for a stuck container. A crash loop's kubelet message names the pod and
    its growing back-off ("back-off 40s restarting failed container=worker pod=x_ns(uid)"), so
    every pod would be its own cause and the text would change at each restart: quote how the
    container last ended instead, which pods of one pool share."""
    if reason != "CrashLoopBackOff":
        return message
    ended = (cs.get("lastState") or {}).get("terminated") or {}
    if not ended:
        return ""
    return f"last exit {ended.get('reason') or 'unknown'}, code {ended.get('exitCode')}"


UNSCHEDULABLE = "unschedulable: "


def pod_ended(pod: dict[str, Any]) -> bool:
    """Phase Failed or Succeeded (evicted, its node shut down): no controller counts it as a
    replica, it never runs again, and its object lingers until pod garbage collection."""
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def pod_cause(pod: dict[str, Any]) -> str | None:
    """Why this pod is not running, from its own status (None: no cause reported, or it is on
    its way out): unschedulable, a container stuck waiting (STUCK_WAITING_REASONS), failed."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None  # an old pod on its way out
    pstatus = pod.get("status") or {}
    found: str | None = None
    for cond in pstatus.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            found = f"{UNSCHEDULABLE}{cond.get('message') or 'no reason given'}"
    statuses = (pstatus.get("initContainerStatuses") or []) + (
        pstatus.get("containerStatuses") or []
    )
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            detail = _waiting_detail(cs, waiting["reason"], waiting.get("message") or "")
            found = f"{waiting['reason']} ({cs.get('name')})" + (f": {detail}" if detail else "")
    if pstatus.get("phase") == "Failed":
        found = f"failed: {pstatus.get('reason') or ''} {pstatus.get('message') or ''}".strip()
    return " ".join(found.split())[:TROUBLE_MESSAGE_CHARS] if found else None


def failing_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods that were placed but cannot run (a crash loop, an image that does not pull, a
    container that cannot be created): waiting does not make them ready. An unschedulable pod
    is not among them: a node may yet free up or be added for it. Nor is a pod that ended
    (phase Failed or Succeeded: evicted, a node shut down): its ReplicaSet no longer counts it
    and has made another in its place, which may be starting, and such a pod object lingers
    until pod garbage collection."""
    return [
        pod
        for pod in pods
        if not pod_ended(pod)
        and (cause := pod_cause(pod)) is not None
        and not cause.startswith(UNSCHEDULABLE)
    ]


def pod_trouble(pods: list[dict[str, Any]]) -> str | None:
    """Why a pool's pods are not running, from the pods' own status, one clause per distinct
    cause with its pod count ("2 pods unschedulable: 0/3 nodes are available: 3 Insufficient
    nvidia.com/gpu."), most common first and at most TROUBLE_MAX_CAUSES of them; None when no
    pod reports a cause (e.g. it is just starting). The text depends only on the causes, not
    on pod names or the order the API lists pods in, so an unchanged problem does not rewrite
    the status at every resync."""
    causes: dict[str, int] = {}
    for pod in pods:
        found = pod_cause(pod)
        if found:
            causes[found] = causes.get(found, 0) + 1
    if not causes:
        return None
    ranked = sorted(causes.items(), key=lambda item: (-item[1], item[0]))
    clauses = [f"{n} pod{'s' if n > 1 else ''} {why}" for why, n in ranked[:TROUBLE_MAX_CAUSES]]
    rest = sum(n for _, n in ranked[TROUBLE_MAX_CAUSES:])
    if rest:
        clauses.append(f"{rest} more pod{'s' if rest > 1 else ''} with other causes")
    return "; ".join(clauses)


def pool_settled(state: PoolState) -> bool:
    """Rollout done: every replica runs the latest template and is ready; no old ones remain."""
    return (
        state.rolled_out
        and state.updated >= state.desired
        and state.ready >= state.desired
        and state.replicas == state.desired
    )


def condition(
    kind: str, status: bool | None, reason: str, message: str, generation: int
) -> dict[str, Any]:
    """A metav1.Condition; status None is "Unknown"."""
    return {
        "type": kind,
        "status": "Unknown" if status is None else "True" if status else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(
    previous: list[dict[str, Any]] | None, current: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Stamp lastTransitionTime: kept from `previous` while a condition's status is unchanged."""
    before = {c.get("type"): c for c in previous or []}
    merged = []
    for cond in current:
        old = before.get(cond["type"]) or {}
        stamp = old.get("lastTransitionTime")
        if not stamp or old.get("status") != cond["status"]:
            stamp = now
        merged.append({**cond, "lastTransitionTime": stamp})
    return merged


def autoscaling_condition(
    service: str,
    mode: str,
    autoscaler: Mapping[str, Any] | None = None,
    hpas: Mapping[str, Mapping[str, Any] | None] | None = None,
    scaled_objects: Mapping[str, Mapping[str, Any] | None] | None = None,
    keda_problem: tuple[str, str] | None = None,
) -> tuple[bool | None, str, str]:
    """Who sizes the prefill and decode pools, so `kubectl describe` answers "why did it not
    scale": the operator (Off), the HorizontalPodAutoscalers it creates (HPA) or KEDA's
    ScaledObjects (KEDA), whose own conditions say whether they can act, or the built-in
    autoscaler (Builtin), whose state (status.autoscaler, scaling.py) does."""
    if mode == "Off":
        return False, "Off", "autoscaling.mode is Off: the operator keeps spec.<pool>.replicas"
    if mode == "HPA":
        return hpa_condition(service, hpas or {})
    if mode == "KEDA":
        return keda_condition(service, scaled_objects or {}, keda_problem)
    state = (autoscaler or {}).get("state")
    message = str((autoscaler or {}).get("message") or "")
    if not state:
        return None, "Starting", "the built-in autoscaler has not evaluated yet"
    return state == ACTIVE, str(state), message


HPA_METRICS_HINT = (
    " (the default metrics come from prometheus-adapter: see "
    "manifests/prometheus-adapter/values.yaml)"
)


def hpa_condition(
    service: str, hpas: Mapping[str, Mapping[str, Any] | None]
) -> tuple[bool | None, str, str]:
    """Mode HPA: what the HorizontalPodAutoscaler controller says about each pool's HPA."""
    missing = [f"{service}-{p}" for p in ("prefill", "decode") if hpas.get(p) is None]
    if missing:
        return None, "HPAPending", f"HorizontalPodAutoscalers not created yet: {', '.join(missing)}"
    problems: list[tuple[str, str]] = []
    unevaluated: list[str] = []
    sizes: list[str] = []
    for pool in ("prefill", "decode"):
        hpa = hpas[pool] or {}
        name = f"{service}-{pool}"
        status = hpa.get("status") or {}
        conds = {c.get("type"): c for c in status.get("conditions") or []}
        if not conds:
            unevaluated.append(name)
            continue
        for kind in ("AbleToScale", "ScalingActive"):
            cond = conds.get(kind) or {}
            if cond.get("status") == "False":
                reason = str(cond.get("reason") or kind)
                hint = HPA_METRICS_HINT if reason.startswith("FailedGet") else ""
                problems.append((reason, f"{name}: {cond.get('message', '')}{hint}"))
                break
        sizes.append(
            f"{name} {status.get('currentReplicas', 0)} replicas, wants "
            f"{status.get('desiredReplicas', 0)}"
        )
    if problems:
        return False, problems[0][0], "; ".join(message for _, message in problems)
    if unevaluated:
        return (
            None,
            "HPAPending",
            "the HorizontalPodAutoscaler controller has not evaluated "
            f"{', '.join(unevaluated)} yet",
        )
    return True, "HPAActive", "HorizontalPodAutoscalers size the pools: " + "; ".join(sizes)


def hpa_limited_condition(
    service: str, hpas: Mapping[str, Mapping[str, Any] | None]
) -> tuple[bool, str, str]:
    """Mode HPA: True while an HPA wants more replicas than its maxReplicas allows (its own
    ScalingLimited condition, reason TooManyReplicas)."""
    limited = []
    for pool in ("prefill", "decode"):
        conds = ((hpas.get(pool) or {}).get("status") or {}).get("conditions") or []
        for cond in conds:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "ScalingLimited",
                "True",
                "TooManyReplicas",
            ):
                limited.append(f"{service}-{pool}: {cond.get('message', '')}")
    if limited:
        return True, "AtMaxReplicas", "; ".join(limited)
    return False, "WithinLimits", "no HorizontalPodAutoscaler wants more than its maxReplicas"


def scaling_limited_condition(autoscaler: Mapping[str, Any] | None) -> tuple[bool, str, str]:
    """True while a bound (maxReplicas, gpuBudget, prefillPerDecode) holds a pool below what it
    needs; False while the autoscaler cannot measure (its last decisions are no longer
    current)."""
    state = (autoscaler or {}).get("state")
    if state and state != ACTIVE:
        return False, str(state), "the autoscaler is not deciding: see the Autoscaling condition"
    limited = []
    for pool in ("prefill", "decode"):
        last = ((autoscaler or {}).get(pool) or {}).get("lastDecision") or {}
        if last.get("verdict") in LIMITED:
            limited.append((pool, str(last["verdict"]), str(last.get("reason", ""))))
    if not limited:
        return False, "WithinLimits", "no pool is held below what the autoscaler wants"
    return True, limited[0][1], "; ".join(f"{p}: {why}" for p, _, why in limited)


def compute_status(
    *,
    service: str,
    namespace: str,
    spec: Spec,
    generation: int,
    observed_generation: int,
    deployments: Mapping[str, dict[str, Any] | None],
    previous_conditions: list[dict[str, Any]] | None,
    now: str,
    error: str | None = None,
    error_reason: str = "ReconcileFailed",
    trouble: Mapping[str, str] | None = None,
    autoscaler: Mapping[str, Any] | None = None,
    hpas: Mapping[str, Mapping[str, Any] | None] | None = None,
    scaled_objects: Mapping[str, Mapping[str, Any] | None] | None = None,
    keda_problem: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The whole `status` (except kopf's bookkeeping) for one LLMService. trouble: per pool,
    why its pods are not running (pod_trouble), quoted in the Ready message. autoscaler: the
    built-in autoscaler's status.autoscaler (mode Builtin), for its conditions. hpas: the pools'
    HorizontalPodAutoscalers (mode HPA, or the ones KEDA made in mode KEDA), for the
    Autoscaling and ScalingLimited conditions. scaled_objects, keda_problem: mode KEDA's
    ScaledObjects, or why the operator could not make them."""
    trouble = trouble or {}

    def why(pool: str) -> str:
        return f" ({trouble[pool]})" if pool in trouble else ""

    states = {
        pool: pool_state(deployments.get(pool), spec.pool(pool).replicas, spec.autoscaling_mode)
        for pool in POOLS
    }
    missing = [pool for pool in POOLS if deployments.get(pool) is None]
    rolling = [pool for pool in POOLS if not pool_settled(states[pool])]
    failures = {pool: s.failure for pool, s in states.items() if s.failure}
    # A pool the autoscaler took to zero (outside mode Off, desired 0) is asleep, not broken:
    # the router waits for it to wake on the next request.
    asleep = [
        pool
        for pool in POOLS
        if spec.autoscaling_mode != "Off" and states[pool].desired == 0 and pool != "router"
    ]
    empty = [pool for pool in POOLS if states[pool].ready == 0 and pool not in asleep]
    pending = observed_generation < generation

    if error:
        ready = (False, error_reason, error)
    elif missing:
        ready = (False, "ChildrenMissing", f"Deployments missing for: {', '.join(missing)}")
    elif pending:
        ready = (False, "Reconciling", f"generation {generation} is not applied yet")
    elif rolling:
        ready = (
            False,
            "RollingOut",
            # Both counts: during a rollout the old pods can all be ready ("1/1") while none
            # runs the new template yet, which a ready count alone makes look finished.
            "pools not ready: "
            + ", ".join(
                f"{p} {states[p].ready}/{states[p].desired} ready, "
                f"{states[p].updated}/{states[p].desired} updated{why(p)}"
                for p in rolling
            ),
        )
    elif empty:
        ready = (False, "NoReplicas", f"no ready replicas in: {', '.join(empty)}")
    elif asleep:
        ready = (
            True,
            "PoolsAsleep",
            f"scaled to zero: {', '.join(asleep)} (they wake when requests reach the router)",
        )
    else:
        ready = (True, "AllPoolsReady", "router, prefill and decode pools are ready")

    if pending or missing or rolling:
        progressing = (True, "RollingOut", "updating: " + ", ".join(missing or rolling or ["spec"]))
    else:
        progressing = (False, "RolloutComplete", "all pools run the latest template")

    if error:
        degraded = (True, error_reason, error)
    elif failures:
        degraded = (True, "DeploymentFailing", "; ".join(f"{p}: {m}" for p, m in failures.items()))
    elif spec.autoscaling_mode == "KEDA" and keda_problem:
        # The pools run, but nothing sizes them as the spec asks.
        degraded = (True, keda_problem[0], keda_problem[1])
    else:
        degraded = (False, "AsExpected", "no failures reported")

    current = [
        condition("Ready", *ready, generation=observed_generation),
        condition("Progressing", *progressing, generation=observed_generation),
        condition("Degraded", *degraded, generation=observed_generation),
        condition(
            "Autoscaling",
            *autoscaling_condition(
                service, spec.autoscaling_mode, autoscaler, hpas, scaled_objects, keda_problem
            ),
            generation=observed_generation,
        ),
    ]
    if spec.autoscaling_mode != "Off":
        limited: tuple[bool | None, str, str]
        if spec.autoscaling_mode == "Builtin":
            limited = scaling_limited_condition(autoscaler)
        elif spec.autoscaling_mode == "KEDA" and keda_problem:
            limited = (None, keda_problem[0], "no ScaledObjects, so no limits: " + keda_problem[1])
        else:
            limited = hpa_limited_condition(service, hpas or {})
        status_, reason, message = limited
        current.append(
            condition("ScalingLimited", status_, reason, message, generation=observed_generation)
        )
    port = spec.router.settings["port"]
    status: dict[str, Any] = {
        "observedGeneration": observed_generation,
        "endpoint": f"http://{service}-router.{namespace}.svc:{port}",
        "conditions": merge_conditions(previous_conditions, current, now),
    }
    for pool, state in states.items():
        status[pool] = {
            "replicas": state.replicas,
            "readyReplicas": state.ready,
            "updatedReplicas": state.updated,
            "desiredReplicas": state.desired,
            "ready": f"{state.ready}/{state.desired}",
        }
    if spec.autoscaling_mode != "Builtin" and autoscaler:
        status["autoscaler"] = None  # a merge patch removes what the autoscaler left
    return status


def invalid_status(
    message: str, generation: int, previous_conditions: list[dict[str, Any]] | None, now: str
) -> dict[str, Any]:
    """Status for a spec the operator cannot build (the CRD schema should have rejected it)."""
    current = [
        condition("Ready", False, "InvalidSpec", message, generation),
        condition("Progressing", False, "InvalidSpec", message, generation),
        condition("Degraded", True, "InvalidSpec", message, generation),
    ]
    return {"conditions": merge_conditions(previous_conditions, current, now)}
