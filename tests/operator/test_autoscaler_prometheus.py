"""The autoscaler's Prometheus reader against a real Prometheus server scraping the metric
families the router and workers export (splitserve_workers.metrics, the same classes), with the
namespace and pod labels a Kubernetes scrape adds."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import plane
import pytest
import yaml
from fleet import Fleet
from operator_process import wait_until
from splitserve_operator.autoscaler import STEADY, History, Objectives, PoolState, decide
from splitserve_operator.children import default_hpa_metrics
from splitserve_operator.keda import queries as keda_queries
from splitserve_operator.prometheus import MetricsError, PrometheusReader
from splitserve_operator.spec import parse_spec

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cluster


@pytest.fixture
def fleets() -> Iterator[tuple[Fleet, Fleet]]:
    """chat in team-a (router, two prefill pods, one decode pod) and a decoy chat in team-b
    whose numbers must never leak in."""
    chat = Fleet("team-a", "chat", ttft=1.2, prefill_queue=0.8, tpot=0.04, decode_admission=0.002)
    chat.add_pod("chat-prefill-a", "prefill", busy_fraction=0.8, running=1)
    chat.add_pod("chat-prefill-b", "prefill", busy_fraction=0.8, running=3, waiting=2)
    chat.add_pod("chat-decode-a", "decode", busy_fraction=0.7, running=12, kv_usage=0.42)
    chat.router_metrics.requests_in_flight.labels(**chat.labels, pool="router").set(5)
    decoy = Fleet("team-b", "chat", ttft=9.0, requests_per_tick=50)
    decoy.add_pod("chat-prefill-a", "prefill", busy_fraction=0.1, running=40)
    try:
        yield chat, decoy
    finally:
        chat.close()
        decoy.close()


def test_reader_measures_each_pool_of_one_service(
    prometheus: Callable[..., Any], fleets: tuple[Fleet, Fleet]
) -> None:
    targets = fleets[0].targets() | fleets[1].targets()
    prom = prometheus(list(targets), scrape_interval="1s", labels=targets)
    reader = PrometheusReader(prom.url)

    def settled() -> Any:
        # A rate over a window that holds only a few scrapes is underestimated; wait until the
        # 5 s window is full of 1 s scrapes of every target.
        s = reader.read("team-a", "chat", 95, window_seconds=5)
        ok = s["prefill"].reporting == 2 and s["prefill"].busy > 1.0 and s["decode"].busy > 0.5
        return s if ok else None

    signals = wait_until(settled, "a full window of scrapes of every target")
    prefill, decode = signals["prefill"], signals["decode"]
    assert (prefill.reporting, decode.reporting) == (2, 1)
    # 0.8 and 0.7 busy seconds per second per pod; a ticker on a loaded box runs a little late.
    assert 1.0 < prefill.busy < 1.8 and 0.5 < decode.busy < 0.9
    assert (prefill.running, prefill.waiting, decode.running) == (4, 2, 12)
    assert decode.kv_usage == pytest.approx(0.42)
    # Every TTFT is 1.2 s: its p95 lies in the (1.0, 1.5] bucket, never the decoy's 9 s.
    assert prefill.latency is not None and 1.0 < prefill.latency <= 1.5
    assert prefill.prefill_queue is not None and 0.75 < prefill.prefill_queue <= 1.0
    assert 0.03 < decode.latency <= 0.04
    assert decode.decode_admission is not None and decode.decode_admission <= 0.0025
    assert 8 < prefill.request_rate < 30  # 20/s for chat; the decoy's 500/s stays out
    assert prefill.in_flight == 5
    assert reader.pod_load("team-a", "chat", "prefill") == {
        "chat-prefill-a": 1.0,
        "chat-prefill-b": 5.0,
    }
    # A service Prometheus knows nothing of: no pods, no latencies (None, not NaN or 0).
    empty = reader.read("team-a", "other", 95, window_seconds=30)
    assert empty["decode"].reporting == 0 and empty["decode"].latency is None


def test_reader_errors_name_the_server(
    prometheus: Callable[..., Any], fleets: tuple[Fleet, Fleet]
) -> None:
    gone = PrometheusReader(f"http://127.0.0.1:{plane.free_port()}", timeout=2)
    with pytest.raises(MetricsError, match="cannot query Prometheus"):
        gone.read("team-a", "chat", 95, 30)
    # Something that is not Prometheus (a metrics exporter answers 200 with text).
    not_prom = PrometheusReader(f"http://{fleets[0].router.target}")
    with pytest.raises(MetricsError, match="not a Prometheus query answer"):
        not_prom.query("up")
    prom = prometheus([fleets[0].router.target])
    with pytest.raises(MetricsError, match="HTTP 400"):
        PrometheusReader(prom.url).query("sum(")


def test_prometheus_adapter_rules_serve_what_the_hpas_ask_for(
    prometheus: Callable[..., Any], fleets: tuple[Fleet, Fleet]
) -> None:
    """manifests/prometheus-adapter/values.yaml: each rule's query, filled in the way
    prometheus-adapter fills it for a per-pod request, answers one value per pod of the asking
    namespace from a real Prometheus; and together the rules serve every metric the
    operator's default HPAs name."""
    values = REPO_ROOT / "manifests" / "prometheus-adapter" / "values.yaml"
    rules = yaml.safe_load(values.read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    spec = parse_spec(
        {
            "model": {"name": "m", "path": "/models/m"},
            "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "autoscaling": {"mode": "HPA"},
        }
    )
    asked = {
        m["pods"]["metric"]["name"]
        for pool in ("prefill", "decode")
        for m in default_hpa_metrics(pool, spec)
    }
    assert asked <= served, asked - served

    targets = fleets[0].targets() | fleets[1].targets()
    prom = prometheus(list(targets), scrape_interval="1s", labels=targets)
    reader = PrometheusReader(prom.url)
    pods = "chat-prefill-a|chat-prefill-b|chat-decode-a"

    def per_pod() -> dict[str, dict[str, float]] | None:
        out = {}
        for rule in rules:
            series = re.match(r"^(\w+)\{", rule["seriesQuery"])
            assert series, rule["seriesQuery"]
            query = (
                rule["metricsQuery"]
                .replace("<<.Series>>", series[1])
                .replace("<<.LabelMatchers>>", f'namespace="team-a",pod=~"{pods}"')
                .replace("<<.GroupBy>>", "pod")
            )
            out[rule["name"]["as"]] = reader.by_pod(query)
        # rate() over the rule's 1m window underestimates until the window holds a minute of
        # scrapes (0.8 busy seconds per second on chat-prefill-a).
        busy = out["splitserve_busy_ratio"]
        return out if len(busy) == 3 and busy["chat-prefill-a"] > 0.5 else None

    found = wait_until(per_pod, "a full 1m window of every rule for every pod", 180)
    kv = found["splitserve_kv_cache_usage_ratio"]
    assert set(kv) == {"chat-prefill-a", "chat-prefill-b", "chat-decode-a"}
    assert kv["chat-decode-a"] == pytest.approx(0.42)
    # team-a's pods only: the decoy in team-b has a chat-prefill-a with 40 running.
    assert found["splitserve_requests_running"] == {
        "chat-prefill-a": 1.0,
        "chat-prefill-b": 3.0,
        "chat-decode-a": 12.0,
    }
    busy = found["splitserve_busy_ratio"]
    assert 0.5 < busy["chat-prefill-a"] < 1.0 and 0.4 < busy["chat-decode-a"] < 0.9


def test_keda_trigger_queries_measure_one_service(
    prometheus: Callable[..., Any], fleets: tuple[Fleet, Fleet]
) -> None:
    """Mode KEDA's default trigger queries (keda.py), run as KEDA's Prometheus scaler runs them:
    each answers at most one sample (KEDA refuses more), for the asking service only, and the
    latency ones equal what the Builtin reader measures."""
    spec = parse_spec(
        {
            "model": {"name": "m", "path": "/models/m"},
            "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "autoscaling": {"mode": "KEDA", "interval": "1s"},
            "monitoring": {"interval": "1s"},
        }
    )
    targets = fleets[0].targets() | fleets[1].targets()
    prom = prometheus(list(targets), scrape_interval="1s", labels=targets)
    reader = PrometheusReader(prom.url)

    def run(namespace: str) -> dict[str, float | None]:
        out = {}
        for name, query in keda_queries(namespace, "chat", spec).items():
            samples = reader.query(query)
            assert len(samples) <= 1, (name, samples)
            out[name] = float(samples[0]["value"][1]) if samples else None
        return out

    def settled() -> dict[str, float | None] | None:
        # The queries' 30 s rate window underestimates until it holds 30 s of scrapes.
        got = run("team-a")
        return got if (got["prefill-utilization"] or 0) > 1.4 else None

    got = wait_until(settled, "a full 30s window of scrapes", 180)
    builtin = reader.read("team-a", "chat", spec.percentile, 30)
    # In milliseconds (KEDA keeps values to 0.001).
    assert got["prefill-ttft-ms"] == pytest.approx(1000 * builtin["prefill"].latency)
    assert got["decode-tpot-ms"] == pytest.approx(1000 * builtin["decode"].latency)
    assert got["prefill-ttft-ms"] and got["prefill-ttft-ms"] > 1000  # TTFT 1.2 s observed
    # Two prefill pods at 0.8 (above 1.4 once settled): not the decode pod's 0.7 too, nor
    # team-b's pod.
    assert got["prefill-utilization"] < 1.8
    assert got["decode-kv-usage"] == pytest.approx(0.42)
    assert got["decode-running"] == 12.0
    # 5 in flight plus the arrival rate (2 requests per 0.1 s tick).
    assert got["wake"] and 5.0 < got["wake"] < 30.0
    # team-b's chat is late (TTFT 9 s) but not for lack of prefill (queueing 10 ms of it): the
    # TTFT trigger stays empty, which KEDA reads as 0, while its own numbers are its own.
    decoy = run("team-b")
    assert decoy["prefill-ttft-ms"] is None
    assert reader.read("team-b", "chat", spec.percentile, 30)["prefill"].latency
    assert decoy["decode-running"] is None and decoy["prefill-utilization"] == pytest.approx(
        0.1, rel=0.3
    )


def test_a_pod_whose_scrape_fails_is_not_counted_twice(prometheus: Callable[..., Any]) -> None:
    # Two prefill pods, each 50% busy. b's /metrics stops answering (a timed-out scrape):
    # Prometheus marks its series stale, so it no longer reports, but its busy seconds are
    # still in the window's rate. The decision core takes a ready pod that does not report
    # to carry the reporting pods' average: busy must then be the reporting pods' only, or
    # b is counted twice (88% "above the target 70%", waiting for a "new" pod).
    fleet = Fleet("team-a", "chat", ttft=0.1, tpot=0.02)
    try:
        fleet.add_pod("chat-prefill-a", "prefill", busy_fraction=0.5, running=2)
        b = fleet.add_pod("chat-prefill-b", "prefill", busy_fraction=0.5, running=2)
        fleet.add_pod("chat-decode-a", "decode", busy_fraction=0.5, running=4)
        targets = fleet.targets()
        prom = prometheus(list(targets), scrape_interval="1s", labels=targets)
        reader = PrometheusReader(prom.url)

        def full() -> Any:
            s = reader.read("team-a", "chat", 95, window_seconds=10)
            return s if s["prefill"].reporting == 2 and s["prefill"].busy > 0.8 else None

        wait_until(full, "a window of scrapes of both prefill pods")
        b.exporter.close()

        def b_stale() -> Any:
            s = reader.read("team-a", "chat", 95, window_seconds=10)
            return s if s["prefill"].reporting == 1 else None

        signals = wait_until(b_stale, "b's series to go stale")
        assert 0.35 < signals["prefill"].busy < 0.6  # a's rate only
        states = {
            "prefill": PoolState("prefill", 2, 2, 1, 8),
            "decode": PoolState("decode", 1, 1, 1, 8, max_batch_size=32),
        }
        d = decide(
            states, signals, Objectives(0.5, 0.05, 95), {"prefill": History()}, 0.0, 300.0,
            settle=30.0,
        )["prefill"]  # fmt: skip
        assert d.verdict == STEADY and 0.35 < d.inputs["utilization"] < 0.6
    finally:
        fleet.close()
