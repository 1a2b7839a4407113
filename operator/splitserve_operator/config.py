"""Operator-wide settings, fixed once at startup from the command line (cli.py) and handed to
the handlers; the pure builders take what they need from it as plain arguments."""

from __future__ import annotations

from dataclasses import dataclass

FIELD_MANAGER = "splitserve-operator"
# Owns Deployment spec.replicas apart from everything else, so that the main apply can leave
# replicas out (Builtin/HPA modes) without server-side apply deleting the field.
REPLICAS_FIELD_MANAGER = "splitserve-operator-replicas"


@dataclass(frozen=True)
class OperatorConfig:
    worker_image: str = "splitserve/worker:dev"
    resync_seconds: float = 30.0
    cluster_domain: str = "cluster.local"
    # auto: create ServiceMonitor/PodMonitor (and the SLO's PrometheusRule) when
    # monitoring.coreos.com serves them (and delete them when an LLMService sets
    # monitoring.enabled false); off: neither create nor delete.
    monitoring: str = "auto"
    # on: a NetworkPolicy per LLMService admits only its router (and, to decode, its prefill
    # pool) to the workers' unauthenticated gRPC ports; off: none is made or deleted.
    network_policies: str = "on"
    # The built-in autoscaler's Prometheus when an LLMService names none.
    prometheus_url: str | None = None
