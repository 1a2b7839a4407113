"""Mode KEDA: one keda.sh/v1alpha1 ScaledObject per scaled pool, whose Prometheus triggers ask
for the same things the built-in autoscaler sizes for, and the Autoscaling condition read from
what KEDA writes back. Pure: dicts in, dicts out; reconcile.py applies them.

Unlike an HPA fed by prometheus-adapter, a KEDA trigger is any PromQL query, so the pools are
sized on the SLO itself: decode on the router's TPOT percentile against spec.slo.tpot, prefill
on the TTFT percentile against spec.slo.ttft when queueing for prefill is at least
targets.prefillQueueShare of it (the Builtin rule, written in PromQL), plus per-replica load
(prefill utilization; decode KV usage and running sequences). KEDA hands them to an HPA it owns
(`keda-hpa-<name>`), which takes the largest replica count any trigger asks for. minReplicas 0
is allowed: KEDA scales a pool to zero after `cooldownPeriod` and back when requests reach the
router."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .autoscaler import hpa_behavior, window_seconds
from .config import OperatorConfig
from .names import child_name, common_labels
from .spec import Spec, parse_duration

SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
SCALED_OBJECTS_PLURAL = "scaledobjects"
# Decode's running sequences per replica to size for: a batch this full still has free slots.
BATCH_FILL = 0.8
# The activation trigger (pools that may sit at zero) only wakes a pool: a threshold no
# in-flight count reaches, so it never asks for more than one replica.
WAKE_ONLY_THRESHOLD = 1_000_000_000


def _num(value: float) -> str:
    """A trigger threshold as KEDA parses it: a plain decimal string (no exponent)."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def queries(namespace: str, service: str, spec: Spec) -> dict[str, str]:
    """The PromQL of every default trigger, by name. Series are selected as the built-in
    autoscaler selects them (prometheus.py): the `namespace` label the scrape adds, the
    `service` and `pool` labels the processes export. Latencies are in milliseconds: KEDA
    keeps metric values and thresholds to 0.001, which in seconds would round an 8 ms objective
    by 12% (more than the HPA's tolerance) and a sub-millisecond one to zero."""
    q = spec.percentile / 100.0
    scrape = parse_duration(spec.monitoring_interval, "spec.monitoring.interval")
    w = f"{math.ceil(window_seconds(spec.autoscaling_interval, scrape))}s"
    sel = f'namespace="{namespace}",service="{service}"'
    router = f'{sel},pool="router"'

    def quantile(name: str) -> str:
        rate = f"rate(splitserve_{name}_bucket{{{router}}}[{w}])"
        return f"histogram_quantile({q}, sum by (le) ({rate}))"

    ttft = quantile("time_to_first_token_seconds")
    queue = quantile("prefill_queue_seconds")
    return {
        "prefill-utilization": (
            f'sum(rate(splitserve_busy_seconds_total{{{sel},pool="prefill"}}[{w}]))'
        ),
        # TTFT, but only while queueing for prefill is a real share of it: a TTFT made late by
        # decode admission is no reason for more prefill (the query is then empty: 0).
        "prefill-ttft-ms": (
            f"1000 * {ttft} and on () ({queue} >= {spec.targets.prefill_queue_share:g} * {ttft})"
        ),
        "decode-tpot-ms": f"1000 * {quantile('time_per_output_token_seconds')}",
        "decode-kv-usage": f'sum(splitserve_kv_cache_usage_ratio{{{sel},pool="decode"}})',
        "decode-running": f'sum(splitserve_requests_running{{{sel},pool="decode"}})',
        # Requests in flight (those waiting for the pool are) or arriving (counting ones whose
        # wait for the pool timed out).
        "wake": (
            f"(sum(rate(splitserve_requests_total{{{router}}}[{w}])) or vector(0)) + "
            f"(sum(splitserve_router_requests_in_flight{{{router}}}) or vector(0))"
        ),
    }


def _trigger(name: str, url: str, query: str, threshold: float, metric_type: str) -> dict:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": metric_type,
        "metadata": {
            "serverAddress": url,
            "query": query,
            "threshold": _num(threshold),
            # No series (a pool at zero, no traffic yet) or NaN (no latency samples) reads as
            # 0; Prometheus unreachable is still an error, which KEDA reports.
            "ignoreNullValues": "true",
        },
    }


def default_triggers(pool: str, namespace: str, service: str, spec: Spec, url: str) -> list[dict]:
    qs = queries(namespace, service, spec)
    if pool == "prefill":
        triggers = [
            _trigger(
                "prefill-utilization", url, qs["prefill-utilization"],
                spec.targets.prefill_utilization, "AverageValue",
            ),
            _trigger(
                "prefill-ttft-ms", url, qs["prefill-ttft-ms"], spec.ttft_seconds * 1000, "Value"
            ),
        ]  # fmt: skip
    else:
        batch = int(spec.decode.settings["maxBatchSize"])
        triggers = [
            _trigger(
                "decode-tpot-ms", url, qs["decode-tpot-ms"], spec.tpot_seconds * 1000, "Value"
            ),
            _trigger(
                "decode-kv-usage", url, qs["decode-kv-usage"], spec.targets.kv_cache_usage,
                "AverageValue",
            ),
            _trigger(
                "decode-running", url, qs["decode-running"], max(1, math.ceil(batch * BATCH_FILL)),
                "AverageValue",
            ),
        ]  # fmt: skip
    return triggers


def scaled_objects(
    service: str, namespace: str, spec: Spec, owner: dict[str, Any], prometheus_url: str
) -> list[dict[str, Any]]:
    """One ScaledObject per scaled pool, targeting its Deployment within
    spec.<pool>.autoscaling's bounds; KEDA polls every autoscaling.interval, and its HPA scales
    up by at most 2x (or +1) per interval and down after autoscaling.scaleDownStabilization,
    like Builtin. `<pool>.autoscaling.triggers` replaces the default triggers."""
    interval = max(1, round(spec.autoscaling_interval))
    out = []
    for pool in ("prefill", "decode"):
        bounds = spec.pool(pool).bounds
        assert bounds is not None  # parse_spec requires them outside mode Off
        name = child_name(service, pool)
        triggers = list(bounds.triggers) or default_triggers(
            pool, namespace, service, spec, prometheus_url
        )
        if bounds.min_replicas == 0 and not bounds.triggers:
            wake = queries(namespace, service, spec)["wake"]
            triggers.append(
                _trigger("wake", prometheus_url, wake, WAKE_ONLY_THRESHOLD, "AverageValue")
            )
        out.append(
            {
                "apiVersion": SCALED_OBJECT[0],
                "kind": SCALED_OBJECT[1],
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": common_labels(service, pool),
                    "ownerReferences": [owner],
                },
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicaCount": bounds.min_replicas,
                    "maxReplicaCount": bounds.max_replicas,
                    "pollingInterval": interval,
                    # How long a pool stays at one replica with nothing active before zero.
                    "cooldownPeriod": max(1, round(spec.scale_down_stabilization)),
                    "advanced": {
                        "horizontalPodAutoscalerConfig": {
                            "behavior": hpa_behavior(
                                spec.autoscaling_interval, spec.scale_down_stabilization
                            )
                        }
                    },
                    "triggers": triggers,
                },
            }
        )
    return out


def prometheus_url(spec: Spec, config: OperatorConfig) -> str | None:
    return spec.prometheus_url or config.prometheus_url


def keda_problem(spec: Spec, config: OperatorConfig, served: bool) -> tuple[str, str] | None:
    """(reason, message) when mode KEDA cannot get ScaledObjects here; None when it can."""
    if not served:
        return (
            "KEDANotInstalled",
            f"the cluster does not serve {SCALED_OBJECT[0]} {SCALED_OBJECTS_PLURAL}: install KEDA "
            "(its CRDs and operator), or choose autoscaling.mode Builtin",
        )
    defaults = [p for p in ("prefill", "decode") if not _own_triggers(spec, p)]
    if defaults and not prometheus_url(spec, config):
        return (
            "NoPrometheus",
            f"the default triggers of {' and '.join(defaults)} query Prometheus: set "
            "spec.autoscaling.metrics.prometheus.url (or the chart's prometheusUrl), or give "
            "the pool its own autoscaling.triggers",
        )
    return None


def _own_triggers(spec: Spec, pool: str) -> bool:
    bounds = spec.pool(pool).bounds
    return bool(bounds and bounds.triggers)


def keda_hpa_name(scaled_object: Mapping[str, Any]) -> str:
    """The HPA KEDA creates for a ScaledObject (status.hpaName, else KEDA's naming rule)."""
    status = scaled_object.get("status") or {}
    return str(status.get("hpaName") or f"keda-hpa-{scaled_object['metadata']['name']}")


KEDA_TRIGGER_HINT = " (the triggers query Prometheus: is it reachable from KEDA?)"


def keda_condition(
    service: str,
    scaled: Mapping[str, Mapping[str, Any] | None],
    problem: tuple[str, str] | None = None,
) -> tuple[bool | None, str, str]:
    """Mode KEDA: what KEDA says about each pool's ScaledObject. problem: (reason, message)
    when the operator could not create them (KEDA not installed, no Prometheus)."""
    if problem:
        return False, problem[0], problem[1]
    missing = [f"{service}-{p}" for p in ("prefill", "decode") if scaled.get(p) is None]
    if missing:
        return None, "KEDAPending", f"ScaledObjects not created yet: {', '.join(missing)}"
    problems: list[tuple[str, str]] = []
    pending: list[str] = []
    states: list[str] = []
    for pool in ("prefill", "decode"):
        obj = scaled[pool] or {}
        name = f"{service}-{pool}"
        conds = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
        ready = conds.get("Ready") or {}
        if ready.get("status") == "False":
            problems.append(
                (str(ready.get("reason") or "NotReady"), f"{name}: {ready.get('message', '')}")
            )
            continue
        hpa = conds.get("HPAActive") or {}
        if hpa.get("status") == "False":
            reason = str(hpa.get("reason") or "HPAActive")
            problems.append((reason, f"{name}: {hpa.get('message', '')}{KEDA_TRIGGER_HINT}"))
            continue
        if ready.get("status") != "True":
            pending.append(name)
            continue
        active = (conds.get("Active") or {}).get("status") == "True"
        paused = (conds.get("Paused") or {}).get("status") == "True"
        states.append(
            f"{name} "
            + ("paused" if paused else "triggers active" if active else "triggers not active")
        )
    if problems:
        return False, problems[0][0], "; ".join(message for _, message in problems)
    if pending:
        return (
            None,
            "KEDAPending",
            f"KEDA has not reconciled {', '.join(pending)} yet (is KEDA's operator running?)",
        )
    return True, "KEDAActive", "KEDA ScaledObjects size the pools: " + "; ".join(states)
