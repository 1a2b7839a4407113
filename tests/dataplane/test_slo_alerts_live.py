"""The operator's SLO PrometheusRule against the series a real router exports, as a real Prometheus
scrapes them: `splitserve up` on the tiny model (its config names the service, as the operator's
does), a Prometheus that scrapes the router's /metrics adding namespace="team-a" (as the
ServiceMonitor's scrape does) and loads the rules `desired_children` builds. With an SLO the tiny
model cannot meet, the TTFT and TPOT alerts fire, labelled with the LLMService's namespace and
name, and the error and capacity alerts stay silent; the same rules with a generous SLO, loaded
from a second file into the same server, never fire on the same traffic.
tests/operator/test_slo_alerts.py checks the rules' timing on synthetic series with promtool."""

from __future__ import annotations

import copy
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from promserver import Prometheus
from splitserve_operator.children import desired_children
from splitserve_operator.config import OperatorConfig
from splitserve_operator.spec import parse_spec
from test_local_up import follow, start_up

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

SERVICE = "chat"  # the LLMService's name and the router's `service` label
NAMESPACE = "team-a"
SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "path": "/models/tiny"},
    "prefill": {},
    "decode": {},
    "slo": {"ttft": "1us", "tpot": "1us"},  # no model meets these
    "monitoring": {"interval": "1s", "alerts": {"for": "1s"}},
}
LATENCY = {"SplitserveTTFTAboveObjective", "SplitserveTPOTAboveObjective"}
SHARES = {"SplitserveRequestErrors", "SplitserveNoCapacity"}
# Bounds a hang on a loaded machine; nothing is timed.
WAIT_S = 120.0


def slo_rule(slo: dict[str, str]) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["slo"] = slo
    objs = desired_children(
        SERVICE, NAMESPACE, "uid-1", parse_spec(spec), OperatorConfig(), True,
        rules_available=True,
    )  # fmt: skip
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    return rule


def rules_of(prom: Prometheus, file: str) -> dict[str, dict[str, Any]]:
    """The rules loaded from rule file `file` (its name), by alert name, with the `lastEvaluation`
    of their group."""
    out = {}
    for group in prom.rule_groups():
        if Path(group["file"]).name == f"{file}.rules.yml":
            for r in group["rules"]:
                out[r["name"]] = {**r, "groupEvaluation": group["lastEvaluation"]}
    return out


def measured(prom: Prometheus, rule: dict[str, Any]) -> dict[str, float]:
    """What each alert of `rule` compares with its threshold, queried now (for the ratio alerts:
    their denominator, the rate of all requests), by alert name; a missing series fails."""
    out = {}
    (group,) = rule["spec"]["groups"]
    for r in group["rules"]:
        query = r["expr"].rsplit(" > ", 1)[0]
        if r["alert"] in SHARES:
            query = query.split(" / ", 1)[1]
        result = prom.query(query)
        assert len(result) == 1, f"{r['alert']}: {query} selects no series of the router"
        out[r["alert"]] = float(result[0]["value"][1])
    return out


def complete(port: int, n: int) -> None:
    for i in range(n):
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": f"hello {i}", "max_tokens": 6, "ignore_eos": True},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text


def test_slo_alerts_fire_on_a_real_routers_series(
    tmp_path: Path, tiny_model: Path, prometheus: Callable[..., Prometheus]
) -> None:
    strict = slo_rule(SPEC["slo"])
    generous = slo_rule({"ttft": "60s", "tpot": "60s"})
    config = tmp_path / "serving.yaml"
    config.write_text(f"service: {SERVICE}\n")
    up = start_up(tiny_model, tmp_path, "--colocated", "1", "--config", str(config))
    try:
        _, port = follow(up)
        target = f"127.0.0.1:{port}"
        prom = prometheus(
            [target],
            scrape_interval="1s",
            labels={target: {"namespace": NAMESPACE}},
            rules={"strict": strict["spec"], "generous": generous["spec"]},
        )
        count = (
            "splitserve_time_per_output_token_seconds_count"
            f'{{namespace="{NAMESPACE}",service="{SERVICE}",pool="router"}}'
        )

        def at_least(n: int) -> Callable[[list[dict[str, Any]]], bool]:
            return lambda result: len(result) == 1 and float(result[0]["value"][1]) >= n

        # A rate needs two samples of a series that grew between them: requests before the
        # series' first scrape, and more after it.
        complete(port, 2)
        prom.wait_for(count, at_least(2), timeout=WAIT_S)
        complete(port, 3)
        prom.wait_for(count, at_least(5), timeout=WAIT_S)

        # Every expression selects the router's series: the latencies the router measured
        # (above the strict objectives, below the generous ones), and requests for the ratios.
        for rule in (strict, generous):
            values = measured(prom, rule)
            assert all(values[name] > 0 for name in SHARES), values
            assert all(1e-6 < values[name] < 60 for name in LATENCY), values

        # The strict rules fire; the generous ones, evaluated on the same series, never leave
        # `inactive`, also for two evaluations after the strict ones fired.
        deadline = time.monotonic() + WAIT_S
        after_firing: set[str] = set()
        while True:
            found, control = rules_of(prom, "strict"), rules_of(prom, "generous")
            assert set(found) == set(control) == LATENCY | SHARES, (found, control)
            for r in [*found.values(), *control.values()]:
                assert r["health"] != "err", r  # "unknown" until its group's first evaluation
            for r in control.values():
                assert r["state"] == "inactive" and not r["alerts"], r
            firing = {name for name, r in found.items() if r["state"] == "firing"}
            assert not firing & SHARES, found
            if firing == LATENCY:
                after_firing.add(next(iter(control.values()))["groupEvaluation"])
                if len(after_firing) >= 3:
                    break
            assert time.monotonic() < deadline, (found, control, prom.rule_groups())
            time.sleep(0.5)

        assert all(r["health"] == "ok" for r in [*found.values(), *control.values()])
        for name in LATENCY:
            (alert,) = found[name]["alerts"]
            assert alert["state"] == "firing"
            assert alert["labels"] == {
                "alertname": name,
                "severity": "warning",
                "namespace": NAMESPACE,
                "llmservice": SERVICE,
            }
        # /api/v1/alerts lists them too (both from the strict file: the control has none).
        alerts = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
        assert sorted(a["labels"]["alertname"] for a in alerts) == sorted(LATENCY)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(timeout=30)
