"""Mode HPA without a cluster: the HorizontalPodAutoscalers the operator builds for each pool,
the spec rules that keep them valid, and how the Autoscaling condition reads what the HPA
controller reports (the objects come from the real controller in test_operator_hpa_cluster)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from splitserve_operator.children import desired_children
from splitserve_operator.config import OperatorConfig
from splitserve_operator.spec import SpecError, parse_spec
from splitserve_operator.status import hpa_condition, hpa_limited_condition
from test_operator_children import SPEC


def hpa_spec(**autoscaling: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["prefill"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    spec["decode"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 12}
    spec["autoscaling"] = {"mode": "HPA", **autoscaling}
    return spec


def hpas(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objs = desired_children("chat", "team-a", "uid-1", parse_spec(spec), OperatorConfig(), False)
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "HorizontalPodAutoscaler"}


def test_one_hpa_per_scaled_pool_targeting_its_deployment() -> None:
    found = hpas(hpa_spec(interval="10s", scaleDownStabilization="120s"))
    assert set(found) == {"chat-prefill", "chat-decode"}
    decode = found["chat-decode"]
    assert decode["apiVersion"] == "autoscaling/v2"
    assert decode["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert decode["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    spec = decode["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "chat-decode",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 12)
    # The built-in autoscaler's targets: 80% KV usage, 80% of maxBatchSize (64) per pod.
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "splitserve_kv_cache_usage_ratio"},
                "target": {"type": "AverageValue", "averageValue": "800m"},
            },
        },
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "splitserve_requests_running"},
                "target": {"type": "AverageValue", "averageValue": "52"},
            },
        },
    ]
    prefill = found["chat-prefill"]["spec"]["metrics"]
    assert [m["pods"]["metric"]["name"] for m in prefill] == ["splitserve_busy_ratio"]
    assert prefill[0]["pods"]["target"]["averageValue"] == "700m"
    # Up by at most 2x (or +1) per interval, down after the stabilization window.
    up = spec["behavior"]["scaleUp"]
    assert up["stabilizationWindowSeconds"] == 0
    assert {(p["type"], p["value"], p["periodSeconds"]) for p in up["policies"]} == {
        ("Percent", 100, 10),
        ("Pods", 1, 10),
    }
    assert spec["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 120}


def test_default_metrics_follow_the_spec_targets() -> None:
    found = hpas(hpa_spec(targets={"prefillUtilization": 0.85, "kvCacheUsage": 0.6}))
    prefill = found["chat-prefill"]["spec"]["metrics"][0]["pods"]["target"]
    kv = found["chat-decode"]["spec"]["metrics"][0]["pods"]["target"]
    assert (prefill["averageValue"], kv["averageValue"]) == ("850m", "600m")


def test_no_hpas_outside_mode_hpa() -> None:
    builtin = hpa_spec()
    builtin["autoscaling"]["mode"] = "Builtin"
    assert hpas(builtin) == {}
    off = hpa_spec()
    off["autoscaling"]["mode"] = "Off"
    assert hpas(off) == {}


def test_own_metrics_replace_the_defaults_and_the_window_is_capped() -> None:
    target = {"type": "Utilization", "averageUtilization": 60}
    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": target}}
    spec = hpa_spec(scaleDownStabilization="2h")
    spec["prefill"]["autoscaling"]["metrics"] = [cpu]
    found = hpas(spec)
    assert found["chat-prefill"]["spec"]["metrics"] == [cpu]
    assert found["chat-decode"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == (
        "splitserve_kv_cache_usage_ratio"
    )
    # An HPA refuses a window over an hour.
    assert found["chat-decode"]["spec"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 3600
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s["decode"]["autoscaling"].update(minReplicas=0),
            "spec.decode.autoscaling.minReplicas: must be at least 1 when spec.autoscaling.mode "
            "is HPA",
        ),
        (
            lambda s: s["prefill"]["autoscaling"].update(metrics={"type": "Pods"}),
            "spec.prefill.autoscaling.metrics: must be a list of MetricSpec objects",
        ),
    ],
)
def test_invalid_hpa_specs_name_the_field(change: Any, message: str) -> None:
    spec = hpa_spec()
    change(spec)
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


def hpa(conditions: list[dict[str, str]], current: int = 2, desired: int = 2) -> dict[str, Any]:
    return {
        "status": {
            "currentReplicas": current,
            "desiredReplicas": desired,
            "conditions": [{"type": t, **c} for t, c in ((c.pop("type"), c) for c in conditions)],
        }
    }


def test_condition_says_what_the_hpa_controller_says() -> None:
    assert hpa_condition("chat", {"prefill": None, "decode": None}) == (
        None,
        "HPAPending",
        "HorizontalPodAutoscalers not created yet: chat-prefill, chat-decode",
    )
    fresh = {"prefill": {"status": {}}, "decode": {"status": {}}}
    status, reason, message = hpa_condition("chat", fresh)
    assert (status, reason) == (None, "HPAPending")
    assert "has not evaluated chat-prefill, chat-decode yet" in message

    able = {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"}
    active = {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"}
    failing = {
        "type": "ScalingActive",
        "status": "False",
        "reason": "FailedGetPodsMetric",
        "message": "unable to get metric splitserve_kv_cache_usage_ratio",
    }
    status, reason, message = hpa_condition(
        "chat",
        {"prefill": hpa([dict(able), dict(active)]), "decode": hpa([dict(able), dict(failing)])},
    )
    assert (status, reason) == (False, "FailedGetPodsMetric")
    assert message.startswith("chat-decode: unable to get metric splitserve_kv_cache_usage_ratio")
    assert "manifests/prometheus-adapter/values.yaml" in message

    status, reason, message = hpa_condition(
        "chat",
        {
            "prefill": hpa([dict(able), dict(active)], current=1, desired=1),
            "decode": hpa([dict(able), dict(active)], current=2, desired=4),
        },
    )
    assert (status, reason) == (True, "HPAActive")
    assert message.endswith("chat-prefill 1 replicas, wants 1; chat-decode 2 replicas, wants 4")


def test_scaling_limited_when_an_hpa_is_held_at_its_max() -> None:
    able = {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"}
    at_max = {
        "type": "ScalingLimited",
        "status": "True",
        "reason": "TooManyReplicas",
        "message": "the desired replica count is more than the maximum replica count",
    }
    at_min = {"type": "ScalingLimited", "status": "True", "reason": "TooFewReplicas"}
    limited = hpa_limited_condition(
        "chat", {"prefill": hpa([dict(able), at_min]), "decode": hpa([dict(able), at_max])}
    )
    assert limited == (
        True,
        "AtMaxReplicas",
        "chat-decode: the desired replica count is more than the maximum replica count",
    )
    # At minReplicas is where an idle pool belongs: not a limit worth a True.
    status, reason, _ = hpa_limited_condition(
        "chat", {"prefill": hpa([dict(able)]), "decode": None}
    )
    assert (status, reason) == (False, "WithinLimits")
