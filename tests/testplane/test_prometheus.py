"""The `prometheus` fixture runs a real Prometheus that scrapes a prometheus-client endpoint
and answers PromQL over its HTTP API (fixture in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import plane
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from promserver import Prometheus

pytestmark = pytest.mark.cluster


@pytest.fixture
def exporter() -> Iterator[tuple[str, Gauge]]:
    registry = CollectorRegistry()
    gauge = Gauge(
        "splitserve_testplane_probe", "value set by the test", ["pool"], registry=registry
    )
    port = plane.free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}", gauge
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_prometheus_scrapes_and_answers_promql(
    prometheus: Callable[..., Prometheus], exporter: tuple[str, Gauge]
) -> None:
    target, gauge = exporter
    gauge.labels(pool="decode").set(42.5)
    prom = prometheus([target], scrape_interval="1s")

    def value_is(expected: float) -> Callable[[list[dict[str, Any]]], bool]:
        def check(result: list[dict[str, Any]]) -> bool:
            return len(result) == 1 and float(result[0]["value"][1]) == expected

        return check

    result = prom.wait_for('splitserve_testplane_probe{pool="decode"}', value_is(42.5))
    assert result[0]["metric"]["job"] == "test"
    # A later value shows up too: Prometheus keeps scraping, not a one-off read.
    gauge.labels(pool="decode").set(7)
    prom.wait_for('splitserve_testplane_probe{pool="decode"}', value_is(7.0))
    up = prom.query('up{job="test"}')
    assert [float(s["value"][1]) for s in up] == [1.0]


def test_prometheus_rejects_bad_targets(prometheus: Callable[..., Prometheus]) -> None:
    with pytest.raises(ValueError, match="targets"):
        prometheus(["no-port-here"])
