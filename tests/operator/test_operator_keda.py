"""Mode KEDA without a cluster: the ScaledObjects the operator builds, when it builds none, and
the Autoscaling condition read from the status KEDA writes (the shapes KEDA's controller
sets: Ready, Active, Paused and HPAActive conditions, status.hpaName)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from splitserve_operator.children import desired_children
from splitserve_operator.config import OperatorConfig
from splitserve_operator.keda import keda_condition, keda_hpa_name, keda_problem, scaled_objects
from splitserve_operator.spec import SpecError, parse_spec
from splitserve_operator.status import compute_status

URL = "http://prometheus.monitoring:9090"
OWNER = {"apiVersion": "splitserve.io/v1alpha1", "kind": "LLMService", "name": "chat", "uid": "u"}
SPEC: dict[str, Any] = {
    "model": {"name": "m", "path": "/models/m"},
    "prefill": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    "decode": {
        "replicas": 2,
        "maxBatchSize": 20,
        "autoscaling": {"minReplicas": 0, "maxReplicas": 6},
    },
    "slo": {"ttft": "800ms", "tpot": "40ms", "percentile": 99},
    "autoscaling": {
        "mode": "KEDA",
        "interval": "10s",
        "scaleDownStabilization": "2h",
        "metrics": {"prometheus": {"url": URL}},
    },
}


def built(spec: dict[str, Any] = SPEC) -> dict[str, dict[str, Any]]:
    objs = scaled_objects("chat", "team-a", parse_spec(spec), OWNER, URL)
    return {o["metadata"]["name"]: o for o in objs}


def triggers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in obj["spec"]["triggers"]}


def test_one_scaled_object_per_pool_targeting_its_deployment() -> None:
    objs = built()
    assert set(objs) == {"chat-prefill", "chat-decode"}
    decode = objs["chat-decode"]
    assert decode["apiVersion"] == "keda.sh/v1alpha1"
    assert decode["metadata"]["ownerReferences"] == [OWNER]
    assert decode["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    spec = decode["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "chat-decode",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 6)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (10, 7200)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # Up by 2x (or +1) per interval; down after the window, capped at the HPA's one hour.
    assert behavior["scaleUp"]["policies"] == [
        {"type": "Percent", "value": 100, "periodSeconds": 10},
        {"type": "Pods", "value": 1, "periodSeconds": 10},
    ]
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": 3600}


def test_default_triggers_ask_for_the_slo_and_the_builtin_targets() -> None:
    objs = built()
    prefill, decode = triggers(objs["chat-prefill"]), triggers(objs["chat-decode"])
    assert set(prefill) == {"prefill-utilization", "prefill-ttft-ms"}
    # A pool that may sit at zero gets the router's requests to wake it.
    assert set(decode) == {"decode-tpot-ms", "decode-kv-usage", "decode-running", "wake"}
    for t in [*prefill.values(), *decode.values()]:
        assert t["type"] == "prometheus"
        assert t["metadata"]["serverAddress"] == URL
        assert 'namespace="team-a",service="chat"' in t["metadata"]["query"]
        assert t["metadata"]["ignoreNullValues"] == "true"

    def threshold(t: dict[str, Any]) -> tuple[str, float]:
        return t["metricType"], float(t["metadata"]["threshold"])

    # The latency percentiles against the objectives, proportionally (metricType Value), in
    # milliseconds: KEDA keeps values to 0.001.
    assert threshold(prefill["prefill-ttft-ms"]) == ("Value", 800)
    assert threshold(decode["decode-tpot-ms"]) == ("Value", 40)
    assert decode["decode-tpot-ms"]["metadata"]["threshold"] == "40"
    tpot_query = decode["decode-tpot-ms"]["metadata"]["query"]
    assert tpot_query.startswith("1000 * histogram_quantile(0.99, ")
    assert "time_per_output_token_seconds_bucket" in tpot_query
    # TTFT scales prefill only while prefill queueing is at least 20% of it.
    ttft_query = prefill["prefill-ttft-ms"]["metadata"]["query"]
    assert "prefill_queue_seconds_bucket" in ttft_query and ">= 0.2 *" in ttft_query
    # Per-replica load (AverageValue): the Builtin targets.
    assert threshold(prefill["prefill-utilization"]) == ("AverageValue", 0.7)
    assert threshold(decode["decode-kv-usage"]) == ("AverageValue", 0.8)
    assert threshold(decode["decode-running"]) == ("AverageValue", 16)  # 80% of 20
    # Rates over max(30 s, 4 x interval, 4 x monitoring.interval) = 60 s.
    assert "[60s]" in prefill["prefill-utilization"]["metadata"]["query"]
    wake = decode["wake"]
    assert "splitserve_router_requests_in_flight" in wake["metadata"]["query"]
    assert "rate(splitserve_requests_total" in wake["metadata"]["query"]
    assert wake["metadata"]["threshold"] == "1000000000"  # wakes the pool, never sizes it


def test_default_triggers_follow_the_spec_targets() -> None:
    spec = copy.deepcopy(SPEC)
    spec["autoscaling"]["targets"] = {
        "prefillUtilization": 0.9,
        "kvCacheUsage": 0.5,
        "prefillQueueShare": 0.35,
    }
    objs = built(spec)
    prefill, decode = triggers(objs["chat-prefill"]), triggers(objs["chat-decode"])
    assert prefill["prefill-utilization"]["metadata"]["threshold"] == "0.9"
    assert decode["decode-kv-usage"]["metadata"]["threshold"] == "0.5"
    assert ">= 0.35 *" in prefill["prefill-ttft-ms"]["metadata"]["query"]


def test_pool_triggers_replace_the_defaults() -> None:
    mine = {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "60"}}
    spec = copy.deepcopy(SPEC)
    spec["decode"]["autoscaling"]["triggers"] = [mine]
    objs = built(spec)
    assert objs["chat-decode"]["spec"]["triggers"] == [mine]  # no wake trigger added either
    assert "prefill-ttft-ms" in triggers(objs["chat-prefill"])
    spec["decode"]["autoscaling"]["triggers"] = [{"metadata": {}}]
    with pytest.raises(SpecError, match=r"^spec.decode.autoscaling.triggers: .* with a type"):
        parse_spec(spec)


def test_scaled_objects_only_where_keda_and_prometheus_are() -> None:
    spec = parse_spec(SPEC)

    def kinds(config: OperatorConfig, keda: bool, s: Any = spec) -> list[str]:
        objs = desired_children("chat", "team-a", "u", s, config, False, keda)
        return [o["kind"] for o in objs if o["kind"] == "ScaledObject"]

    assert kinds(OperatorConfig(), True) == ["ScaledObject", "ScaledObject"]
    assert kinds(OperatorConfig(), False) == []
    reason, message = keda_problem(spec, OperatorConfig(), False) or ("", "")
    assert reason == "KEDANotInstalled" and "keda.sh/v1alpha1 scaledobjects" in message
    # No URL on the LLMService: the operator's --prometheus-url, else nothing to query.
    bare = copy.deepcopy(SPEC)
    del bare["autoscaling"]["metrics"]
    no_url = parse_spec(bare)
    assert kinds(OperatorConfig(), True, no_url) == []
    reason, message = keda_problem(no_url, OperatorConfig(), True) or ("", "")
    assert reason == "NoPrometheus" and "spec.autoscaling.metrics.prometheus.url" in message
    assert message.startswith("the default triggers of prefill and decode query Prometheus")
    assert kinds(OperatorConfig(prometheus_url=URL), True, no_url) == ["ScaledObject"] * 2
    assert keda_problem(no_url, OperatorConfig(prometheus_url=URL), True) is None
    # Pools with their own triggers need no Prometheus at all.
    for pool in ("prefill", "decode"):
        bare[pool]["autoscaling"]["triggers"] = [{"type": "cpu", "metadata": {"value": "60"}}]
    own = parse_spec(bare)
    assert keda_problem(own, OperatorConfig(), True) is None
    assert kinds(OperatorConfig(), True, own) == ["ScaledObject"] * 2


def keda_status(*conds: tuple[str, str, str], hpa: str = "keda-hpa-x") -> dict[str, Any]:
    return {
        "status": {
            "hpaName": hpa,
            "conditions": [
                {"type": t, "status": s, "reason": r, "message": f"{t} says {r}"}
                for t, s, r in conds
            ],
        }
    }


READY = ("Ready", "True", "ScaledObjectReady")


def keda_conditions(**scalers: Any) -> dict[str, dict[str, Any]]:
    """Status conditions of SPEC (mode KEDA, no Deployments yet) by type, given what
    compute_status hears about KEDA (scaled_objects, hpas, keda_problem)."""
    st = compute_status(
        service="chat",
        namespace="team-a",
        spec=parse_spec(SPEC),
        generation=1,
        observed_generation=1,
        deployments={},
        previous_conditions=None,
        now="2026-11-30T00:00:00Z",
        **scalers,
    )
    return {c["type"]: c for c in st["conditions"]}


def test_keda_condition_reads_what_keda_writes() -> None:
    problem = ("KEDANotInstalled", "install KEDA")
    assert keda_condition("chat", {}, problem) == (False, "KEDANotInstalled", "install KEDA")
    ok, reason, message = keda_condition("chat", {"prefill": {}, "decode": None})
    assert (ok, reason) == (None, "KEDAPending") and "chat-decode" in message
    # Created, but no KEDA operator has looked at them (Ready Unknown or no conditions).
    fresh = {"prefill": {"status": {}}, "decode": keda_status(("Ready", "Unknown", ""))}
    ok, reason, message = keda_condition("chat", fresh)
    assert (ok, reason) == (None, "KEDAPending")
    assert "chat-prefill, chat-decode" in message and "KEDA's operator" in message
    failed = {
        "prefill": keda_status(READY, ("Active", "False", "ScalerNotActive")),
        "decode": keda_status(("Ready", "False", "ScaledObjectCheckFailed")),
    }
    assert keda_condition("chat", failed) == (
        False,
        "ScaledObjectCheckFailed",
        "chat-decode: Ready says ScaledObjectCheckFailed",
    )
    blind = {
        "prefill": keda_status(READY),
        "decode": keda_status(READY, ("HPAActive", "False", "HPAMetricsUnavailable")),
    }
    ok, reason, message = keda_condition("chat", blind)
    assert (ok, reason) == (False, "HPAMetricsUnavailable")
    assert "chat-decode: HPAActive says HPAMetricsUnavailable" in message
    assert "is it reachable from KEDA" in message
    working = {
        "prefill": keda_status(READY, ("Active", "False", "ScalerNotActive")),
        "decode": keda_status(READY, ("Active", "True", "ScalerActive")),
    }
    assert keda_condition("chat", working) == (
        True,
        "KEDAActive",
        "KEDA ScaledObjects size the pools: chat-prefill triggers not active; "
        "chat-decode triggers active",
    )


def test_status_in_mode_keda_names_keda_and_its_hpas_limits() -> None:
    scaled = {"prefill": keda_status(READY), "decode": keda_status(READY)}
    limited_hpa = {
        "status": {
            "conditions": [
                {
                    "type": "ScalingLimited",
                    "status": "True",
                    "reason": "TooManyReplicas",
                    "message": "the desired replica count is more than the maximum replica count",
                }
            ]
        }
    }
    conds = keda_conditions(scaled_objects=scaled, hpas={"prefill": None, "decode": limited_hpa})
    assert (conds["Autoscaling"]["status"], conds["Autoscaling"]["reason"]) == (
        "True",
        "KEDAActive",
    )
    assert (conds["ScalingLimited"]["status"], conds["ScalingLimited"]["reason"]) == (
        "True",
        "AtMaxReplicas",
    )
    assert conds["ScalingLimited"]["message"].startswith("chat-decode: the desired replica")
    assert keda_hpa_name({"metadata": {"name": "chat-decode"}}) == "keda-hpa-chat-decode"
    assert keda_hpa_name({"metadata": {"name": "x"}, "status": {"hpaName": "h"}}) == "h"


def test_status_without_keda_is_degraded_and_says_no_limits_apply() -> None:
    # KEDA not installed: the pools run at their replicas, but nothing sizes them as the spec
    # asks. Degraded says so (Ready is about serving), and ScalingLimited does not claim that
    # an HPA is within its limits when there is none.
    problem = keda_problem(parse_spec(SPEC), OperatorConfig(), False)
    assert problem is not None
    conds = keda_conditions(keda_problem=problem)
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == (
        "True",
        "KEDANotInstalled",
    )
    assert "install KEDA" in conds["Degraded"]["message"]
    limited = conds["ScalingLimited"]
    assert (limited["status"], limited["reason"]) == ("Unknown", "KEDANotInstalled")
    assert "HorizontalPodAutoscaler" not in limited["message"]


def test_mode_keda_allows_pools_at_zero() -> None:
    spec = parse_spec(SPEC)  # decode minReplicas 0: refused in mode HPA, fine with KEDA
    assert spec.decode.bounds is not None and spec.decode.bounds.min_replicas == 0
    hpa = copy.deepcopy(SPEC)
    hpa["autoscaling"]["mode"] = "HPA"
    with pytest.raises(SpecError, match="minReplicas: must be at least 1"):
        parse_spec(hpa)


def test_the_hpa_keda_makes_leads_back_to_its_llmservice() -> None:
    import kopf
    from splitserve_operator.handlers import keda_hpa_service

    def hpa(owner_kind: str, api_version: str) -> kopf.Body:
        return kopf.Body(
            {
                "kind": "HorizontalPodAutoscaler",
                "metadata": {
                    "name": "keda-hpa-chat-decode",
                    # KEDA copies the ScaledObject's labels onto its HPA.
                    "labels": {"app.kubernetes.io/instance": "chat"},
                    "ownerReferences": [
                        {"kind": owner_kind, "apiVersion": api_version, "name": "chat-decode"}
                    ],
                },
            }
        )

    assert keda_hpa_service(hpa("ScaledObject", "keda.sh/v1alpha1")) == "chat"
    assert keda_hpa_service(hpa("ScaledObject", "example.com/v1")) is None
    assert keda_hpa_service(hpa("LLMService", "splitserve.io/v1alpha1")) is None


def test_a_failing_discovery_keeps_the_last_answer() -> None:
    from splitserve_operator.handlers import Operator
    from splitserve_operator.kube import KubeError

    class Discovery:
        answer: bool | Exception = True

        def serves(self, group_version: str, plurals: tuple[str, ...]) -> bool:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    kube = Discovery()
    op = Operator(kube, OperatorConfig())  # type: ignore[arg-type]
    assert op.keda_available() is True
    op._served = {k: (0.0, v) for k, (_, v) in op._served.items()}  # the cached answer expired
    kube.answer = KubeError(503, "GET", "/apis/keda.sh/v1alpha1", "unavailable")
    assert op.keda_available() is True  # a 503 says nothing about KEDA
    kube.answer = False  # a real answer (the API server said 404) replaces it
    op._served = {}
    assert op.keda_available() is False
