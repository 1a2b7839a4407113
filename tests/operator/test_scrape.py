"""The direct-scrape signal source (splitserve_operator/scrape.py) that local mode's autoscaler
reads instead of Prometheus. Pages come from the processes' own metric classes
(splitserve_workers/metrics.py), served over real HTTP where fetching is what is tested; round
times are given explicitly, so every expected value below is computed by hand."""

from __future__ import annotations

import http.server
import math
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from splitserve_operator.autoscaler import STEADY, History, Objectives, PoolState, decide
from splitserve_operator.prometheus import MetricsError
from splitserve_operator.scrape import (
    MAX_PAGE_BYTES,
    DirectScraper,
    Round,
    Target,
    buckets,
    histogram_quantile,
    parse_page,
)
from splitserve_workers.metrics import router_metrics, worker_metrics

LABELS = {"service": "chat", "model": "tiny"}
ROUTER = Target("router", "router", "unused")
P0 = Target("prefill-0", "prefill", "unused")
D0 = Target("decode-0", "decode", "unused")
D1 = Target("decode-1", "decode", "unused")


class Process:
    """One process's registry with the real metric families."""

    def __init__(self, pool: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {**LABELS, "pool": pool}
        if pool == "router":
            self.m = router_metrics(self.registry)
        else:
            self.w = worker_metrics(self.registry)

    def page(self) -> dict[tuple[str, str], float]:
        return parse_page(generate_latest(self.registry).decode())


def round_at(t: float, procs: dict[Target, Process]) -> Round:
    return Round(t, {target: p.page() for target, p in procs.items()})


def test_rates_and_quantiles_cover_only_the_window() -> None:
    router, d0 = Process("router"), Process("decode")
    rl, wl = router.labels, d0.labels
    scraper = DirectScraper(keep=100)
    scraper.add(round_at(0.0, {ROUTER: router, D0: d0}))
    # Before the window: slow tokens that must not count.
    for _ in range(100):
        router.m.tpot.labels(**rl).observe(1.0)
    scraper.add(round_at(5.0, {ROUTER: router, D0: d0}))
    # In the window (5 s .. 10 s): 100 tokens at 4 ms, 20 requests, 2.5 busy seconds.
    for _ in range(100):
        router.m.tpot.labels(**rl).observe(0.004)
    router.m.requests.labels(**rl, status="ok").inc(15)
    router.m.requests.labels(**rl, status="error").inc(5)
    d0.w.busy_seconds.labels(**wl).inc(2.5)
    scraper.add(round_at(10.0, {ROUTER: router, D0: d0}))

    decode = scraper.read(95, window_seconds=5)["decode"]
    # All 100 in the (2.5 ms, 5 ms] bucket: 2.5 + 2.5 * 0.95 ms.
    assert decode.latency == pytest.approx(0.0025 + 0.0025 * 0.95)
    assert decode.request_rate == pytest.approx(20 / 5)
    assert decode.busy == pytest.approx(2.5 / 5)
    # A 10 s window also holds the slow tokens: p95 (rank 190 of 200) is one of them.
    wide = scraper.read(95, window_seconds=10)["decode"]
    assert wide.latency is not None and 0.75 < wide.latency <= 1.0
    assert wide.request_rate == pytest.approx(20 / 10)


def test_gauges_latest_and_window_mean_and_who_reports() -> None:
    router, p0, d0, d1 = (Process(p) for p in ("router", "prefill", "decode", "decode"))
    scraper = DirectScraper(keep=100)
    p0.w.requests_running.labels(**p0.labels).set(1)
    p0.w.busy_seconds.labels(**p0.labels).inc(0)
    for t, running in ((0.0, (2, 4)), (1.0, (6, 8))):
        d0.w.requests_running.labels(**d0.labels).set(running[0])
        d1.w.requests_running.labels(**d1.labels).set(running[1])
        scraper.add(round_at(t, {ROUTER: router, P0: p0, D0: d0, D1: d1}))
    d0.w.requests_waiting.labels(**d0.labels).set(3)
    d0.w.kv_cache_usage_ratio.labels(**d0.labels).set(0.5)
    d1.w.kv_cache_usage_ratio.labels(**d1.labels).set(0.7)
    router.m.requests_in_flight.labels(**router.labels).set(9)
    # d1 does not answer the last round.
    scraper.add(round_at(2.0, {ROUTER: router, P0: p0, D0: d0}))

    signals = scraper.read(95, window_seconds=10)
    decode = signals["decode"]
    assert decode.reporting == 1
    assert decode.running == 6 and decode.waiting == 3
    assert decode.mean_running == pytest.approx((6 + 14 + 6) / 3)
    assert decode.kv_usage == pytest.approx(0.5)
    assert decode.in_flight == 9
    assert decode.latency is None, "no tokens in the window: no percentile"
    assert signals["prefill"].reporting == 1 and signals["prefill"].busy_series == 1
    assert scraper.pod_load("decode") == {"decode-0": 9.0}
    assert scraper.limit("decode", "splitserve_max_batch_size") == 0


def test_a_restarted_counter_counts_from_zero() -> None:
    router, p0 = Process("router"), Process("prefill")
    scraper = DirectScraper(keep=100)
    p0.w.busy_seconds.labels(**p0.labels).inc(100)
    scraper.add(round_at(0.0, {ROUTER: router, P0: p0}))
    restarted = Process("prefill")
    restarted.w.busy_seconds.labels(**restarted.labels).inc(4)
    scraper.add(round_at(10.0, {ROUTER: router, P0: restarted}))
    assert scraper.read(95, 10)["prefill"].busy == pytest.approx(4 / 10)


def test_rounds_older_than_keep_are_dropped() -> None:
    router = Process("router")
    scraper = DirectScraper(keep=5)
    for t in (0.0, 3.0, 6.0, 9.0):
        scraper.add(round_at(t, {ROUTER: router}))
    assert [r.time for r in scraper.rounds] == [6.0, 9.0]


def test_histogram_quantile_matches_prometheus_rules() -> None:
    cumulative = [(0.1, 10.0), (0.2, 30.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.15)  # rank 20 in (0.1, 0.2]
    assert histogram_quantile(0.99, cumulative) == 0.2  # +Inf bucket: its lower bound
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    page = parse_page('# TYPE x histogram\nx_bucket{le="0.1"} 1\nx_bucket{le="+Inf"} 2\n')
    assert buckets(page, "x") == [(0.1, 1.0), (math.inf, 2.0)]


@pytest.fixture
def server() -> Iterator[tuple[str, dict[str, bytes]]]:
    pages: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    httpd.shutdown()
    httpd.server_close()


def test_scrape_over_http_and_what_it_refuses(server: tuple[str, dict[str, bytes]]) -> None:
    base, pages = server
    router, d0 = Process("router"), Process("decode")
    d0.w.requests_running.labels(**d0.labels).set(2)
    pages["/router"] = generate_latest(router.registry)
    pages["/d0"] = generate_latest(d0.registry)
    pages["/garbage"] = b"this is { not prometheus text\n"
    pages["/huge"] = b"# " + b"x" * MAX_PAGE_BYTES + b"\n"
    targets = [
        Target("router", "router", base + "/router"),
        Target("decode-0", "decode", base + "/d0"),
        Target("decode-1", "decode", base + "/garbage"),
        Target("decode-2", "decode", base + "/huge"),
        Target("decode-3", "decode", base + "/missing"),
    ]
    scraper = DirectScraper(keep=60, timeout=10)
    scraper.scrape(targets, now=0.0)
    assert scraper.read(95, 60)["decode"].reporting == 1
    assert scraper.read(95, 60)["decode"].running == 2
    errors = {t.name: e for t, e in scraper.errors.items()}
    assert sorted(errors) == ["decode-1", "decode-2", "decode-3"]
    assert "not Prometheus text" in errors["decode-1"]
    assert f"over {MAX_PAGE_BYTES} bytes" in errors["decode-2"]
    assert "404" in errors["decode-3"]

    # Without the router there are no latency signals: say so instead of guessing.
    scraper.scrape([Target("router", "router", base + "/missing"), targets[1]], now=1.0)
    with pytest.raises(MetricsError, match="the router's /metrics did not answer: .*404"):
        scraper.read(95, 60)


def test_a_restart_mid_window_is_seen_round_to_round() -> None:
    # A container restarted in place keeps its pod name (the same target); its counter climbs
    # back past the old value before the window ends.
    router, p0 = Process("router"), Process("prefill")
    scraper = DirectScraper(keep=100)
    p0.w.busy_seconds.labels(**p0.labels).inc(10)
    scraper.add(round_at(0.0, {ROUTER: router, P0: p0}))
    p0.w.busy_seconds.labels(**p0.labels).inc(2)  # 12 at 5 s
    scraper.add(round_at(5.0, {ROUTER: router, P0: p0}))
    restarted = Process("prefill")
    restarted.w.busy_seconds.labels(**restarted.labels).inc(3)  # 3 at 7 s: restarted
    scraper.add(round_at(7.0, {ROUTER: router, P0: restarted}))
    restarted.w.busy_seconds.labels(**restarted.labels).inc(12)  # 15 at 10 s
    scraper.add(round_at(10.0, {ROUTER: router, P0: restarted}))
    # 2 + 3 + 12 busy seconds; first-to-last (15 - 10) would say 5.
    assert scraper.read(95, 10)["prefill"].busy == pytest.approx((2 + 3 + 12) / 10)


def test_a_restarted_routers_histogram_stays_cumulative() -> None:
    old, new = Process("router"), Process("router")
    scraper = DirectScraper(keep=100)
    for _ in range(100):
        old.m.tpot.labels(**old.labels).observe(0.2)  # 100 slow tokens before the window
    scraper.add(round_at(0.0, {ROUTER: old}))
    for _ in range(10):
        new.m.tpot.labels(**new.labels).observe(0.004)  # after the restart: 10 fast ones
    scraper.add(round_at(5.0, {ROUTER: new}))
    # Only the 10 new tokens count, all in (2.5 ms, 5 ms].
    assert scraper.read(95, 10)["decode"].latency == pytest.approx(0.0025 + 0.0025 * 0.95)


def test_a_missed_scrape_keeps_the_last_value_and_a_removed_target_stops() -> None:
    router, d0, d1 = Process("router"), Process("decode"), Process("decode")
    d0.w.requests_running.labels(**d0.labels).set(4)
    d1.w.requests_running.labels(**d1.labels).set(6)
    scraper = DirectScraper(keep=100)
    scraper.add(round_at(0.0, {ROUTER: router, D0: d0, D1: d1}))
    # d1 times out this round: it still holds its 6 sequences as far as anyone knows.
    scraper.add(Round(1.0, {ROUTER: router.page(), D0: d0.page()}, frozenset({D1})))
    # d1 is gone (scaled down): no longer asked, no longer counted.
    scraper.add(round_at(2.0, {ROUTER: router, D0: d0}))
    assert scraper.read(95, 10)["decode"].mean_running == pytest.approx((10 + 10 + 4) / 3)


def test_a_missed_scrape_is_not_a_missing_pod() -> None:
    # Two prefill pods, each 50% busy with 2 sequences; p1 times out in the last round. It is
    # still there with its load: the pool reports 2 pods, not 1 carrying the rate of both
    # (which the decision core would then spread over "unscraped" pods as well: 100%).
    router, d0 = Process("router"), Process("decode")
    p0, p1 = Process("prefill"), Process("prefill")
    P1 = Target("prefill-1", "prefill", "unused")
    scraper = DirectScraper(keep=100)
    for t in (0.0, 5.0, 10.0, 15.0):
        for p in (p0, p1):
            p.w.requests_running.labels(**p.labels).set(2)
            if t:
                p.w.busy_seconds.labels(**p.labels).inc(2.5)
        procs = {ROUTER: router, P0: p0, P1: p1, D0: d0}
        if t < 15.0:
            scraper.add(round_at(t, procs))
        else:
            del procs[P1]
            scraper.add(Round(t, {k: p.page() for k, p in procs.items()}, frozenset({P1})))
    sig = scraper.read(95, 20)["prefill"]
    assert (sig.reporting, sig.busy, sig.running) == (2, pytest.approx(1.0), 4)
    assert scraper.pod_load("prefill") == {"prefill-0": 2, "prefill-1": 2}
    states = {
        "prefill": PoolState("prefill", 2, 2, 1, 8),
        "decode": PoolState("decode", 1, 1, 1, 8, max_batch_size=8),
    }
    d = decide(
        states, scraper.read(95, 20), Objectives(0.5, 0.05, 95), {"prefill": History()},
        15.0, 300.0, settle=20.0, source="the autoscaler",
    )["prefill"]  # fmt: skip
    assert (d.verdict, d.replicas) == (STEADY, 2)
    assert d.inputs["utilization"] == 0.5
