"""Metrics of one LLMService's router and worker pods, for a real Prometheus to scrape in the
autoscaler's tests. The families are the ones the processes export (splitserve_workers.metrics,
the same classes); the values are set by the test. Cluster tests need this because pods on kwok
nodes run no process: the fleet exports their metrics under their real pod names instead."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import plane
from prometheus_client import CollectorRegistry, start_http_server
from splitserve_workers.metrics import RouterMetrics, WorkerMetrics, router_metrics, worker_metrics

TICK_SECONDS = 0.1


class Exporter:
    """One scrape target: a registry served over HTTP on loopback (a free port on 127.0.0.1,
    or the given address: a pod's own loopback IP and port, for the operator to scrape)."""

    def __init__(self, address: tuple[str, int] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.host, self.port = address or ("127.0.0.1", plane.free_port())
        self.server, self.thread = start_http_server(
            self.port, addr=self.host, registry=self.registry
        )

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=5)


@dataclass
class Pod:
    pool: str
    exporter: Exporter
    metrics: WorkerMetrics
    busy_fraction: float = 0.5  # busy seconds per second
    running: float = 0
    waiting: float = 0
    kv_usage: float = 0.1


@dataclass
class Fleet:
    namespace: str
    service: str
    # What the router observes every tick (5 requests' worth).
    ttft: float = 0.1
    prefill_queue: float = 0.01
    tpot: float = 0.02
    decode_admission: float = 0.001
    requests_per_tick: int = 2
    pods: dict[str, Pod] = field(default_factory=dict)
    router_address: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        self.labels = {"service": self.service, "model": "m"}
        self.router = Exporter(self.router_address)
        self.router_metrics: RouterMetrics = router_metrics(self.router.registry)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def add_pod(
        self, name: str, pool: str, address: tuple[str, int] | None = None, **values: float
    ) -> Pod:
        exporter = Exporter(address)
        pod = Pod(pool, exporter, worker_metrics(exporter.registry), **values)
        with self._lock:
            self.pods[name] = pod
        return pod

    def targets(self) -> dict[str, dict[str, str]]:
        """host:port -> the labels a Kubernetes scrape adds (namespace; pod for workers)."""
        out = {self.router.target: {"namespace": self.namespace}}
        for name, pod in self.pods.items():
            out[pod.exporter.target] = {"namespace": self.namespace, "pod": name}
        return out

    def _tick(self) -> None:
        rl = {**self.labels, "pool": "router"}
        m = self.router_metrics
        last = time.monotonic()
        while not self._stop.wait(TICK_SECONDS):
            # A ticker on a loaded box wakes late, and fewer ticks than the seconds hold made
            # every rate (busy seconds, requests) read low. Counting the time that really
            # passed keeps each rate at what the test set, however late the ticks come.
            now = time.monotonic()
            elapsed, last = now - last, now
            with self._lock:
                for pod in self.pods.values():
                    wl = {**self.labels, "pool": pod.pool}
                    pod.metrics.busy_seconds.labels(**wl).inc(pod.busy_fraction * elapsed)
                    pod.metrics.requests_running.labels(**wl).set(pod.running)
                    pod.metrics.requests_waiting.labels(**wl).set(pod.waiting)
                    pod.metrics.kv_cache_usage_ratio.labels(**wl).set(pod.kv_usage)
                for _ in range(5):
                    m.ttft.labels(**rl).observe(self.ttft)
                    m.prefill_queue.labels(**rl).observe(self.prefill_queue)
                    m.tpot.labels(**rl).observe(self.tpot)
                    m.decode_admission.labels(**rl).observe(self.decode_admission)
                m.requests.labels(**rl, status="ok").inc(
                    self.requests_per_tick * elapsed / TICK_SECONDS
                )

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.router.close()
        for pod in self.pods.values():
            pod.exporter.close()
