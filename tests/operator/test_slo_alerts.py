"""The PrometheusRule each LLMService gets: alerts on its SLO, built from the spec, and checked
by the real Prometheus rule engine (`promtool test rules`, from Debian's prometheus package)
against series shaped like the router's: they fire when the objective is missed for the
configured time, and not before, and not when it is met."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from splitserve_operator.children import desired_children, unwanted_children
from splitserve_operator.config import OperatorConfig
from splitserve_operator.spec import SpecError, parse_spec

SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "path": "/models/tiny"},
    "prefill": {},
    "decode": {},
    "slo": {"ttft": "300ms", "tpot": "40ms", "percentile": 99},
}
ROUTER = 'namespace="team-a",service="chat",pool="router",model="tiny"'
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def rule(spec: dict[str, Any] = SPEC, **config: Any) -> dict[str, Any] | None:
    objs = desired_children(
        "chat", "team-a", "uid-1", parse_spec(spec), OperatorConfig(**config), True,
        rules_available=True,
    )  # fmt: skip
    found = [o for o in objs if o["kind"] == "PrometheusRule"]
    return found[0] if found else None


def alerts(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (group,) = obj["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_the_rule_carries_the_slo_of_the_spec() -> None:
    obj = rule()
    assert obj is not None
    assert obj["metadata"]["name"] == "chat-slo"
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    found = alerts(obj)
    assert set(found) == {
        "SplitserveTTFTAboveObjective",
        "SplitserveTPOTAboveObjective",
        "SplitserveRequestErrors",
        "SplitserveNoCapacity",
    }
    ttft = found["SplitserveTTFTAboveObjective"]
    assert ttft["expr"].startswith("histogram_quantile(0.99, ")
    assert ttft["expr"].endswith(" > 0.3")
    assert 'service="chat"' in ttft["expr"] and 'namespace="team-a"' in ttft["expr"]
    assert found["SplitserveTPOTAboveObjective"]["expr"].endswith(" > 0.04")
    assert {r["for"] for r in found.values()} == {"10m"}
    assert ttft["labels"] == {"severity": "warning", "namespace": "team-a", "llmservice": "chat"}
    assert "300ms objective" in ttft["annotations"]["summary"]

    spec = copy.deepcopy(SPEC)
    spec["slo"] = {"ttft": "2s", "percentile": 90}
    spec["monitoring"] = {"alerts": {"for": "1h"}}
    found = alerts(rule(spec))  # type: ignore[arg-type]
    assert found["SplitserveTTFTAboveObjective"]["expr"].startswith("histogram_quantile(0.9, ")
    assert found["SplitserveTTFTAboveObjective"]["expr"].endswith(" > 2")
    assert found["SplitserveTPOTAboveObjective"]["expr"].endswith(" > 0.05")  # the default
    assert {r["for"] for r in found.values()} == {"1h"}


def test_alerts_of_namesakes_in_two_namespaces_differ_in_their_labels() -> None:
    # The expressions sum every label away: without `namespace` on the rule, "chat" in team-a
    # and "chat" in team-b raised alerts with one label set, merged into one by Alertmanager.
    def labels(namespace: str) -> list[dict[str, str]]:
        objs = desired_children(
            "chat", namespace, "uid-1", parse_spec(SPEC), OperatorConfig(), True,
            rules_available=True,
        )  # fmt: skip
        (obj,) = [o for o in objs if o["kind"] == "PrometheusRule"]
        return [r["labels"] for r in alerts(obj).values()]

    assert all(a["namespace"] == "team-a" for a in labels("team-a"))
    assert not set(map(str, labels("team-a"))) & set(map(str, labels("team-b")))


def test_the_rate_window_holds_several_scrapes() -> None:
    # A 5m rate over a series scraped every 2m holds two or three samples at best: the window
    # grows to four scrape intervals, as the autoscaler's does.
    for interval, window in (("15s", "[5m]"), ("1m15s", "[5m]"), ("2m", "[480s]")):
        spec = copy.deepcopy(SPEC)
        spec["monitoring"] = {"interval": interval}
        obj = rule(spec)
        assert obj is not None
        for r in alerts(obj).values():
            assert window in r["expr"] and "[5m]" not in r["expr"].replace(window, ""), r["expr"]
        found = alerts(obj)["SplitserveTTFTAboveObjective"]["annotations"]["description"]
        assert f"over the last {window[1:-1]} " in found
        assert "status.autoscaler.<pool>.lastDecision" in found


def test_no_rule_without_alerts_monitoring_or_the_kind_and_which_go_when_turned_off() -> None:
    spec = copy.deepcopy(SPEC)
    spec["monitoring"] = {"alerts": {"enabled": False}}
    assert rule(spec) is None
    assert unwanted_children("chat", parse_spec(spec), OperatorConfig()) == {
        "autoscaling.mode is Off": unwanted_children("chat", parse_spec(SPEC), OperatorConfig())[
            "autoscaling.mode is Off"
        ],
        "monitoring.alerts.enabled is false": [
            ("monitoring.coreos.com/v1", "PrometheusRule", "chat-slo")
        ],
    }
    spec["monitoring"] = {"enabled": False}
    assert rule(spec) is None
    gone = unwanted_children("chat", parse_spec(spec), OperatorConfig())
    assert ("monitoring.coreos.com/v1", "PrometheusRule", "chat-slo") in gone[
        "monitoring.enabled is false"
    ]
    assert rule(monitoring="off") is None
    assert "monitoring.alerts.enabled is false" not in unwanted_children(
        "chat", parse_spec(spec), OperatorConfig(monitoring="off")
    )
    # The cluster serves the monitors but not PrometheusRule: no rule, nothing else changes.
    objs = desired_children(
        "chat", "team-a", "uid-1", parse_spec(SPEC), OperatorConfig(), True,
        rules_available=False,
    )  # fmt: skip
    kinds = {o["kind"] for o in objs}
    assert "PrometheusRule" not in kinds and {"ServiceMonitor", "PodMonitor"} <= kinds


def test_an_alert_for_stored_before_the_schema_is_refused_naming_it() -> None:
    spec = copy.deepcopy(SPEC)
    for bad in ("0m", "1.5m", "soon", ""):
        spec["monitoring"] = {"alerts": {"for": bad}}
        with pytest.raises(SpecError, match=r"^spec\.monitoring\.alerts\.for: "):
            parse_spec(spec)


def _series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


def _histogram(name: str, per_minute: dict[str, int]) -> list[dict[str, str]]:
    """A cumulative histogram receiving `per_minute[le]` observations at or under each bound
    every minute for 40 minutes."""
    return [
        _series(f"splitserve_{name}_bucket", f'{ROUTER},le="{le}"', f"0+{n}x40")
        for le, n in per_minute.items()
    ]


def _requests(**per_minute: int) -> list[dict[str, str]]:
    return [
        _series("splitserve_requests_total", f'{ROUTER},status="{status}"', f"0+{n}x40")
        for status, n in per_minute.items()
    ]


def _expected(obj: dict[str, Any], alert: str, value: str) -> list[dict[str, Any]]:
    r = alerts(obj)[alert]
    annotations = {
        k: v.replace("{{ $value | humanizeDuration }}", value).replace(
            "{{ $value | humanizePercentage }}", value
        )
        for k, v in r["annotations"].items()
    }
    return [{"exp_labels": r["labels"], "exp_annotations": annotations}]


def _promtool_test(tmp_path: Path, obj: dict[str, Any], tests: list[dict[str, Any]]) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": obj["spec"]["groups"]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = tmp_path / "unit.yaml"
    unit.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    proc = subprocess.run([PROMTOOL, "test", "rules", str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_alerts_fire_in_the_real_rule_engine_only_when_the_slo_is_missed(
    tmp_path: Path,
) -> None:
    obj = rule()
    assert obj is not None
    names = list(alerts(obj))
    # Missed: every first token took 250-500 ms (p99 497.5 ms against 300 ms), every output
    # token 40-80 ms (p99 79.6 ms against 40 ms), 1 request in 10 failed and 1 in 20 was
    # refused for want of capacity (client errors, "rejected", count for neither).
    slow = (
        _histogram("time_to_first_token_seconds", {"0.25": 0, "0.5": 10, "+Inf": 10})
        + _histogram("time_per_output_token_seconds", {"0.04": 0, "0.08": 10, "+Inf": 10})
        + _requests(ok=16, error=2, no_capacity=1, rejected=1)
    )
    # Met: the same traffic inside the objectives, no errors.
    fast = (
        _histogram("time_to_first_token_seconds", {"0.25": 10, "0.5": 10, "+Inf": 10})
        + _histogram("time_per_output_token_seconds", {"0.02": 10, "0.04": 10, "+Inf": 10})
        + _requests(ok=10, error=0, no_capacity=0, rejected=5)
    )

    def at(minutes: int, expected: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        return [
            {"eval_time": f"{minutes}m", "alertname": n, "exp_alerts": expected.get(n, [])}
            for n in names
        ]

    firing = {
        "SplitserveTTFTAboveObjective": _expected(obj, "SplitserveTTFTAboveObjective", "497.5ms"),
        "SplitserveTPOTAboveObjective": _expected(obj, "SplitserveTPOTAboveObjective", "79.6ms"),
        "SplitserveRequestErrors": _expected(obj, "SplitserveRequestErrors", "10%"),
        "SplitserveNoCapacity": _expected(obj, "SplitserveNoCapacity", "5%"),
    }
    _promtool_test(
        tmp_path,
        obj,
        [
            # Pending until the breach has lasted `for` (10m), then firing.
            {"interval": "1m", "input_series": slow, "alert_rule_test": at(8, {}) + at(20, firing)},
            {"interval": "1m", "input_series": fast, "alert_rule_test": at(30, {})},
        ],
    )
