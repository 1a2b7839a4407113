"""Runs the built-in autoscaler for one LLMService (autoscaling.mode Builtin; a kopf daemon per
LLMService, registered in handlers.py). Every spec.autoscaling.interval it reads the pools'
Deployments and the signals, decides (autoscaler.decide), scales the Deployments, and says why:
status.autoscaler.<pool>.lastDecision, the Autoscaling and ScalingLimited conditions, and an
Event for every scale and every change of trouble.

The signals come from Prometheus when a URL is set (spec.autoscaling.metrics.prometheus.url or
the operator's --prometheus-url), otherwise from the pods themselves: each evaluation scrapes
the /metrics page of every ready router and worker pod (scrape.py), so Builtin works on a
cluster without Prometheus as long as the operator can reach the pods' ports.

Scale-down is drain-safe: before lowering replicas it sets each pod's pod-deletion-cost to the
sequences it holds, so the ReplicaSet removes the idlest pods first, and a removed worker drains
on SIGTERM (it takes no new work and finishes what it has within terminationGracePeriodSeconds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import GROUP, VERSION
from .autoscaler import (
    ACTIVE,
    LIMITED,
    METRICS_UNAVAILABLE,
    MIN_WINDOW_SECONDS,
    Decision,
    History,
    Objectives,
    PoolState,
    RatioBounds,
    Signals,
    decide,
    hold,
    window_seconds,
)
from .config import REPLICAS_FIELD_MANAGER, OperatorConfig
from .kube import Kube, KubeError, Ref
from .names import child_name, selector_labels
from .prometheus import MetricsError, PrometheusReader
from .reconcile import replicas_patch
from .scrape import ROUTER, DirectScraper, Target
from .spec import Spec, SpecError, gpus_per_replica, parse_duration, parse_spec
from .status import failing_pods, now_rfc3339, pod_trouble

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
COMPONENT = "app.kubernetes.io/component"
SCALED_POOLS = ("prefill", "decode")
# A decision whose verdict and replicas did not change is rewritten at most this often (its
# inputs move every evaluation; status need not).
REFRESH_SECONDS = 60.0
# Until reconcile has created the Deployments, the first evaluation is retried this often, not
# a whole interval later.
FIRST_EVALUATION_RETRY_SECONDS = 5.0
# The daemon wakes at least this often (handlers.py): an evaluation not due yet under the
# spec's interval only re-reads it, so a shortened interval takes effect without waiting out
# the old one.
WAKE_SECONDS = 15.0

# (body, type, reason, message) -> None: posts an Event on the LLMService.
Emit = Callable[[dict[str, Any], str, str, str], None]


@dataclass
class ScalerState:
    """What one LLMService's daemon remembers between evaluations (lost on restart: then
    scale-down waits a whole stabilization window again, which errs on the safe side)."""

    histories: dict[str, History] = field(default_factory=dict)
    scraper: DirectScraper | None = None  # the direct source's rounds (no Prometheus URL)
    written: dict[str, Any] = field(default_factory=dict)  # what status last got, minus times
    written_at: float = 0.0
    evaluated_at: float | None = None  # when the signals were last read


class PrometheusSource:
    """Signals and per-pod load from Prometheus's HTTP API."""

    def __init__(self, url: str, namespace: str, service: str) -> None:
        self.reader = PrometheusReader(url)
        self.namespace, self.service = namespace, service
        self.name = "Prometheus"
        self.description = f"Prometheus at {url}"

    def read(self, percentile: float, window: float, now: float) -> dict[str, Signals]:
        return self.reader.read(self.namespace, self.service, percentile, window)

    def pod_load(self, pool: str) -> dict[str, float]:
        return self.reader.pod_load(self.namespace, self.service, pool)


_log = logging.getLogger("splitserve.operator")


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def scrape_target(pod: dict[str, Any], pool: str) -> Target | None:
    """The pod's /metrics URL: the router serves it on its API port ("http"), workers on
    "metrics". None while the pod has no IP or no such port."""
    ip = (pod.get("status") or {}).get("podIP")
    port_name = "http" if pool == ROUTER else "metrics"
    ports = [
        p.get("containerPort")
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if p.get("name") == port_name
    ]
    if not ip or not ports:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Target(pod["metadata"]["name"], pool, f"http://{host}:{ports[0]}/metrics")


class DirectSource:
    """Signals from the pods' own /metrics pages: every ready router and worker pod is scraped
    once per evaluation, and the rounds of the window are kept in the daemon's state."""

    def __init__(self, kube: Kube, namespace: str, service: str, scraper: DirectScraper) -> None:
        self.kube, self.namespace, self.service = kube, namespace, service
        self.scraper = scraper
        self.name = "the operator"
        self.description = "the pods' /metrics, scraped by the operator"

    def read(self, percentile: float, window: float, now: float) -> dict[str, Signals]:
        # One list for the whole service; each pod's component label says its pool.
        service = {k: v for k, v in selector_labels(self.service, ROUTER).items() if k != COMPONENT}
        targets: list[Target] = []
        for pod in self.kube.list_objects("v1", "pods", self.namespace, service):
            pool = (pod["metadata"].get("labels") or {}).get(COMPONENT, "")
            if pool in (ROUTER, *SCALED_POOLS) and _ready(pod):
                target = scrape_target(pod, pool)
                if target is not None:
                    targets.append(target)
        if not any(t.pool == ROUTER for t in targets):
            raise MetricsError(f"no ready {self.service}-router pod to scrape")
        self.scraper.keep = window
        self.scraper.scrape(targets, now)
        return self.scraper.read(percentile, window)

    def pod_load(self, pool: str) -> dict[str, float]:
        return self.scraper.pod_load(pool)


class Scaler:
    def __init__(
        self,
        kube: Kube,
        config: OperatorConfig,
        refresh_status: Callable[[str, str], None],
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.config = config
        self.refresh_status = refresh_status  # recompute conditions from status.autoscaler
        self.emit = emit
        self.clock = clock

    def evaluate(
        self, namespace: str, name: str, state: ScalerState, log: logging.Logger | Any
    ) -> float:
        """One evaluation; returns the seconds until the next (spec.autoscaling.interval)."""
        try:
            return self._evaluate(namespace, name, state, log)
        except Exception:
            # Failed part way (a refused scale, an API error): the next wake evaluates again
            # instead of counting a whole interval from the attempt.
            state.evaluated_at = None
            raise

    def _evaluate(
        self, namespace: str, name: str, state: ScalerState, log: logging.Logger | Any
    ) -> float:
        ref = Ref(f"{GROUP}/{VERSION}", "LLMService", namespace, name)
        body = self.kube.get(ref)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return 5.0
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return 15.0  # the reconcile handler reports it
        if spec.autoscaling_mode != "Builtin":
            return spec.autoscaling_interval
        if state.evaluated_at is not None:
            # Woken early to re-read the interval (handlers.py): not due yet. A timer firing a
            # moment early is on time.
            due = state.evaluated_at + spec.autoscaling_interval - self.clock()
            if due > 0.5:
                return due
        deployments = {
            pool: self.kube.get(Ref("apps/v1", "Deployment", namespace, child_name(name, pool)))
            for pool in SCALED_POOLS
        }
        if any(d is None for d in deployments.values()):
            # Reconcile creates them first, usually within seconds.
            return min(spec.autoscaling_interval, FIRST_EVALUATION_RETRY_SECONDS)
        states = {
            pool: self.with_failing(pool_state(spec, pool, d), namespace, name)
            for pool, d in deployments.items()
            if d
        }
        try:
            scrape = parse_duration(spec.monitoring_interval, "spec.monitoring.interval")
        except SpecError:
            scrape = 15.0
        url = spec.prometheus_url or self.config.prometheus_url
        source: PrometheusSource | DirectSource
        if url:
            source = PrometheusSource(url, namespace, name)
            state.scraper = None
            window = window_seconds(spec.autoscaling_interval, scrape)
        else:
            if state.scraper is None:
                state.scraper = DirectScraper(keep=MIN_WINDOW_SECONDS)
            source = DirectSource(self.kube, namespace, name, state.scraper)
            window = window_seconds(spec.autoscaling_interval, spec.autoscaling_interval)
        state.evaluated_at = self.clock()
        try:
            signals = source.read(spec.percentile, window, state.evaluated_at)
        except (MetricsError, KubeError) as e:
            message = (
                f"{source.description}: {e}; replicas stay as they are, within minReplicas and "
                "maxReplicas"
            )
            log.warning(f"autoscaler: {e}")
            held = hold(
                states,
                state.histories,
                self.clock(),
                spec.scale_down_stabilization,
                f"no metrics from {source.description}: replicas stay as they are",
                settle=window,
            )
            scaled = self.apply(body, source, namespace, name, deployments, held, log)
            self.report(body, state, METRICS_UNAVAILABLE, message, held, scaled, source.description)
            return spec.autoscaling_interval
        objectives = Objectives(spec.ttft_seconds, spec.tpot_seconds, spec.percentile)
        decisions = decide(
            states,
            signals,
            objectives,
            state.histories,
            self.clock(),
            spec.scale_down_stabilization,
            spec.gpu_budget,
            settle=window,
            source=source.name,
            ratio=RatioBounds(spec.prefill_per_decode_min, spec.prefill_per_decode_max),
            targets=spec.targets,
        )
        scaled = self.apply(body, source, namespace, name, deployments, decisions, log)
        summary = "; ".join(f"{p}: {d.verdict} ({d.reason})" for p, d in decisions.items())
        self.report(body, state, ACTIVE, summary, decisions, scaled, source.description)
        return spec.autoscaling_interval

    def with_failing(self, state: PoolState, namespace: str, name: str) -> PoolState:
        """The pool's pods that fail to run (status.failing_pods), read only when some pods
        are not ready; a failed read (an older ClusterRole without `list pods`) counts none."""
        if state.ready >= state.replicas:
            return state
        try:
            pods = self.kube.list_objects(
                "v1", "pods", namespace, selector_labels(name, state.name)
            )
        except KubeError as e:
            _log.debug("cannot list %s pods of %s/%s: %s", state.name, namespace, name, e)
            return state
        failing = failing_pods([p for p in pods if not _ready(p)])
        if not failing:
            return state
        return replace(state, failing=len(failing), failing_why=pod_trouble(failing) or "")

    def apply(
        self,
        body: dict[str, Any],
        source: PrometheusSource | DirectSource,
        namespace: str,
        name: str,
        deployments: dict[str, dict[str, Any] | None],
        decisions: dict[str, Decision],
        log: logging.Logger | Any,
    ) -> dict[str, str]:
        """Scale the pools whose decision changes replicas, each with an Event; returns when,
        by pool."""
        scaled: dict[str, str] = {}
        for pool, decision in decisions.items():
            if decision.changes:
                dep = deployments[pool]
                assert dep is not None
                self.scale(source, namespace, name, dep, decision, log)
                scaled[pool] = now_rfc3339()
                kind = "ScaledUp" if decision.replicas > decision.current else "ScaledDown"
                message = f"{pool} {decision.current} -> {decision.replicas}: {decision.reason}"
                self.emit(body, "Normal", kind, message)
                log.info(f"autoscaler: {message}")
        return scaled

    def scale(
        self,
        source: PrometheusSource | DirectSource,
        namespace: str,
        name: str,
        deployment: dict[str, Any],
        decision: Decision,
        log: logging.Logger | Any,
    ) -> None:
        if decision.replicas < decision.current:
            try:
                self.mark_idlest(source.pod_load(decision.pool), namespace, name, decision.pool)
            except (KubeError, MetricsError) as e:
                # Still safe (workers drain on SIGTERM), only not the idlest pods first.
                log.warning(f"autoscaler: pod-deletion-cost not set for {decision.pool}: {e}")
        self.kube.apply(replicas_patch(deployment, decision.replicas), REPLICAS_FIELD_MANAGER)

    def mark_idlest(self, load: dict[str, float], namespace: str, name: str, pool: str) -> None:
        """pod-deletion-cost = sequences the pod holds now (load, by pod name), so the idlest
        go first."""
        for pod in self.kube.list_objects("v1", "pods", namespace, selector_labels(name, pool)):
            meta = pod["metadata"]
            cost = str(round(load.get(meta["name"], 0.0)))
            if (meta.get("annotations") or {}).get(DELETION_COST) == cost:
                continue
            self.kube.request(
                "PATCH",
                Ref("v1", "Pod", namespace, meta["name"]).path(),
                body={"metadata": {"annotations": {DELETION_COST: cost}}},
                content_type="application/merge-patch+json",
            )

    def report(
        self,
        body: dict[str, Any],
        state: ScalerState,
        verdict_state: str,
        message: str,
        decisions: dict[str, Decision],
        scaled: dict[str, str] | None = None,
        metrics_source: str = "",
    ) -> None:
        """Write status.autoscaler when something a reader cares about changed (or its numbers
        are over REFRESH_SECONDS old), then let the conditions follow."""
        scaled = scaled or {}
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        previous = (body.get("status") or {}).get("autoscaler") or {}
        key = {
            "state": verdict_state,
            "message": message if verdict_state != ACTIVE else "",
            "source": metrics_source,
            **{p: (d.verdict, d.current, d.replicas) for p, d in decisions.items()},
        }
        now = self.clock()
        if not scaled and key == state.written and now - state.written_at < REFRESH_SECONDS:
            return
        if verdict_state != (previous.get("state") or ACTIVE) and verdict_state != ACTIVE:
            self.emit(body, "Warning", verdict_state, message)
        stamp = now_rfc3339()
        # A merge patch keeps what it does not name: null (delete) what this write lacks.
        fresh: dict[str, Any] = {
            "state": verdict_state,
            "message": message,
            "metricsSource": metrics_source or None,
        }
        for pool, d in decisions.items():
            before = previous.get(pool) or {}
            last = before.get("lastDecision") or {}
            same = (last.get("verdict"), last.get("replicas")) == (d.verdict, d.replicas)
            decision = {
                "time": last.get("time", stamp) if same and pool not in scaled else stamp,
                "evaluated": stamp,
                "verdict": d.verdict,
                "currentReplicas": d.current,
                "replicas": d.replicas,
                "reason": d.reason,
                "inputs": d.inputs,
            }
            # lastScaleTime stays until the next scale; the decision is replaced whole (an input
            # the last one had, a tpotModel say, must not outlive it).
            entry: dict[str, Any] = {"lastDecision": replacing(last, decision)}
            if pool in scaled:
                entry["lastScaleTime"] = scaled[pool]
            if d.verdict in LIMITED and last.get("verdict") != d.verdict:
                self.emit(body, "Warning", "ScalingLimited", f"{pool}: {d.reason}")
            fresh[pool] = entry
        ref = Ref(f"{GROUP}/{VERSION}", "LLMService", namespace, name)
        try:
            self.kube.patch_status(ref, {"autoscaler": fresh})
        except KubeError as e:
            if e.status != 404:
                raise
            return
        state.written, state.written_at = key, now
        self.refresh_status(namespace, name)


def replacing(before: Any, after: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that turns `before` into `after`, not a union of the two: the keys
    of `before` that `after` lacks are set to null, at every level of nested objects."""
    old = before if isinstance(before, dict) else {}
    patch: dict[str, Any] = {key: None for key in old if key not in after}
    for key, value in after.items():
        patch[key] = replacing(old.get(key), value) if isinstance(value, dict) else value
    return patch


def pool_state(spec: Spec, pool: str, deployment: dict[str, Any]) -> PoolState:
    settings = spec.pool(pool)
    bounds = settings.bounds
    assert bounds is not None  # parse_spec requires them in mode Builtin
    replicas = int((deployment.get("spec") or {}).get("replicas", settings.replicas))
    status = deployment.get("status") or {}
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    rolling_out = (
        int(status.get("observedGeneration") or 0) < generation
        or int(status.get("updatedReplicas") or 0) < replicas
        or int(status.get("replicas") or 0) > replicas  # old pods still terminating or surging
    )
    return PoolState(
        name=pool,
        replicas=replicas,
        ready=int(status.get("readyReplicas") or 0),
        min_replicas=bounds.min_replicas,
        max_replicas=bounds.max_replicas,
        gpus_per_replica=gpus_per_replica(settings),
        max_batch_size=int(settings.settings.get("maxBatchSize", 0)),
        rolling_out=rolling_out,
    )
