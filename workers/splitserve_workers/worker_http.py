"""A worker's HTTP side: /health (liveness), /ready (readiness: false while loading or draining)
and /metrics (Prometheus text from the worker's own registry), plus the updater that turns each
engine iteration's IterationStats into the worker_metrics() families. worker_runtime.py runs it
next to the gRPC server in the same event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from splitserve_workers.http_errors import AppRunner
from splitserve_workers.metrics import WorkerMetrics, worker_metrics

if TYPE_CHECKING:
    from splitserve_workers.engine import IterationStats


@dataclass
class WorkerStatus:
    """What the probes report; the runtime flips these."""

    loaded: bool = False
    draining: bool = False

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining


class WorkerMetricsUpdater:
    """Feeds worker_metrics() from engine.stats() after every iteration (engine thread) and counts
    rejections (event-loop thread). prometheus_client metrics are thread-safe."""

    def __init__(self, registry: CollectorRegistry, service: str, pool: str, model: str) -> None:
        self.m: WorkerMetrics = worker_metrics(registry)
        self.labels = {"service": service, "pool": pool, "model": model}
        self._lock = threading.Lock()
        self._last_totals: dict[str, float] = {}
        # Touch every labelled child so the families exist (at 0) before the first request.
        for metric in (
            self.m.requests_running,
            self.m.requests_waiting,
            self.m.max_batch_size,
            self.m.max_batch_tokens,
            self.m.kv_cache_usage_ratio,
            self.m.kv_blocks_free,
            self.m.kv_blocks_total,
            self.m.queued_prefill_tokens,
            self.m.preemptions,
            self.m.prefix_cache_hits,
            self.m.prefix_cache_queries,
            self.m.prompt_tokens_processed,
            self.m.generation_tokens_processed,
            self.m.draining,
            self.m.busy_seconds,
            self.m.draft_tokens,
            self.m.accepted_tokens,
        ):
            metric.labels(**self.labels)

    def set_limits(self, max_batch_size: int, max_batch_tokens: int) -> None:
        self.m.max_batch_size.labels(**self.labels).set(max_batch_size)
        self.m.max_batch_tokens.labels(**self.labels).set(max_batch_tokens)

    def set_draining(self, draining: bool) -> None:
        self.m.draining.labels(**self.labels).set(1 if draining else 0)

    def rejected(self, reason: str) -> None:
        self.m.requests_rejected.labels(**self.labels, reason=reason).inc()

    def _delta(self, name: str, total: float) -> float:
        # The engine reports cumulative totals; Prometheus counters want increments.
        prev = self._last_totals.get(name)
        self._last_totals[name] = total
        return max(0, total - prev) if prev is not None else max(0, total)

    def occupancy(self, s: IterationStats) -> None:
        """The gauges of what the engine holds now. Also set at every scrape: blocks reserved
        or freed between iterations (a decode worker's reservations, a released transfer)
        change them while the engine thread sleeps."""
        lb = self.labels
        m = self.m
        with self._lock:
            m.requests_running.labels(**lb).set(s.num_running)
            m.requests_waiting.labels(**lb).set(s.num_waiting)
            m.kv_cache_usage_ratio.labels(**lb).set(s.kv_usage)
            m.kv_blocks_free.labels(**lb).set(s.free_blocks)
            m.kv_blocks_total.labels(**lb).set(s.total_blocks)
            m.queued_prefill_tokens.labels(**lb).set(s.queued_prefill_tokens)

    def observe(self, s: IterationStats) -> None:
        """One engine iteration -> gauges, histograms and counter increments."""
        self.occupancy(s)
        lb = self.labels
        m = self.m
        with self._lock:
            batch = s.batch_size
            tokens = s.num_prefill_tokens + s.num_decode_tokens
            if batch > 0:
                m.batch_size.labels(**lb).observe(batch)
            if tokens > 0:
                m.iteration_tokens.labels(**lb).observe(tokens)
            m.prompt_tokens_processed.labels(**lb).inc(s.num_prefill_tokens)
            m.generation_tokens_processed.labels(**lb).inc(s.num_generated_tokens)
            m.preemptions.labels(**lb).inc(self._delta("preemptions", s.preemptions_total))
            m.prefix_cache_hits.labels(**lb).inc(self._delta("hits", s.prefix_cache_hits_total))
            m.prefix_cache_queries.labels(**lb).inc(
                self._delta("queries", s.prefix_cache_queries_total)
            )
            m.busy_seconds.labels(**lb).inc(self._delta("busy", s.busy_seconds_total))
            m.draft_tokens.labels(**lb).inc(self._delta("drafts", s.draft_tokens_total))
            m.accepted_tokens.labels(**lb).inc(self._delta("accepted", s.accepted_tokens_total))


# Probes and scrapes send a GET with a few short headers and no body, so the limits are small:
# a body is refused (413) before anything reads it, and the header limits are stated here
# rather than left to aiohttp's defaults.
MAX_BODY_BYTES = 1024
MAX_LINE_BYTES = 8190
MAX_HEADER_BYTES = 8190
MAX_HEADERS = 64


@web.middleware
async def _refuse_bodies(request: web.Request, handler: Any) -> web.StreamResponse:
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if chunked or (request.content_length or 0) > MAX_BODY_BYTES:
        # Closed without reading the body (lingering_time=0 in start_http).
        resp = web.json_response(
            {"error": f"request body over {MAX_BODY_BYTES} bytes; these endpoints take none"},
            status=413,
        )
        resp.force_close()
        return resp
    return await handler(request)


def make_app(
    status: WorkerStatus, registry: CollectorRegistry, refresh: Callable[[], None] | None = None
) -> web.Application:
    """refresh: called before each /metrics answer (the occupancy gauges, read live)."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        body = {"ready": status.ready, "loaded": status.loaded, "draining": status.draining}
        return web.json_response(body, status=200 if status.ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        if refresh is not None:
            refresh()
        resp = web.Response(body=generate_latest(registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_refuse_bodies])
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def start_http(
    status: WorkerStatus,
    registry: CollectorRegistry,
    host: str,
    port: int,
    refresh: Callable[[], None] | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the probes and metrics; returns the runner and the bound port (port 0 = any)."""
    runner = AppRunner(
        make_app(status, registry, refresh),
        access_log=None,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_HEADER_BYTES,
        max_headers=MAX_HEADERS,
        lingering_time=0,  # close on an unread body at once, instead of reading it for 10 s
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # noqa: SLF001 - aiohttp exposes the bound socket only here
    bound = port
    if server is not None and server.sockets:  # type: ignore[attr-defined]
        bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, bound
