"""`splitserve operator`: runs the LLMService operator (kopf) namespaced or cluster-wide, with
kopf peering so that only one of several replicas acts, and a liveness endpoint. Settings are
fixed here once and handed to handlers.register()."""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import urllib.parse

import kopf

from .config import OperatorConfig
from .handlers import Operator, register
from .kube import Kube, KubeError, NoCredentialsError, load_api_client
from .names import MANAGED_BY

KOPF_PREFIX = "kopf.splitserve.io"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable; globs such as team-* work)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--worker-image",
        default=os.environ.get("SPLITSERVE_WORKER_IMAGE", "splitserve/worker:dev"),
        help="image for LLMServices that set no spec.image (env SPLITSERVE_WORKER_IMAGE)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="period of the level-based resync that repairs drift (default 30)",
    )
    parser.add_argument("--cluster-domain", default="cluster.local")
    parser.add_argument(
        "--monitoring",
        choices=["auto", "off"],
        default="auto",
        help="auto: create ServiceMonitor/PodMonitor (and a PrometheusRule on the SLO) where "
        "monitoring.coreos.com serves them (and delete them when an LLMService disables "
        "monitoring); off: leave them alone",
    )
    parser.add_argument(
        "--network-policies",
        choices=["on", "off"],
        default="on",
        help="on: a NetworkPolicy per LLMService admits only its router (and, to decode, its "
        "prefill pool) to the workers' gRPC ports; off: leave NetworkPolicies alone",
    )
    parser.add_argument(
        "--prometheus-url",
        default=os.environ.get("SPLITSERVE_PROMETHEUS_URL", ""),
        help="Prometheus the built-in autoscaler reads when an LLMService sets no "
        "spec.autoscaling.metrics.prometheus.url (env SPLITSERVE_PROMETHEUS_URL)",
    )
    parser.add_argument(
        "--peering",
        default="splitserve",
        help="kopf peering object name (KopfPeering per namespace, or ClusterKopfPeering)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: only when exactly one operator runs (e.g. local development)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest acts, equal priorities all pause (default: random)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint URL, or '' to disable",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads running handlers (default: Python's, min(32, CPUs + 4)); on 2 CPUs, 16 "
        "threads reconciled 50 services slower than 6",
    )
    parser.add_argument("--verbose", "-v", action="store_true")


def check_flags(args: argparse.Namespace) -> str | None:
    """The first out-of-range flag as "field: why", or None; checked before kopf starts."""
    if not args.resync_seconds > 0:
        return f"resync_seconds: {args.resync_seconds} must be positive"
    if args.workers is not None and args.workers < 1:
        return f"workers: {args.workers} must be at least 1"
    if args.prometheus_url and urllib.parse.urlsplit(args.prometheus_url).scheme not in (
        "http",
        "https",
    ):
        return f"prometheus_url: {args.prometheus_url!r} is not an http(s):// URL"
    if args.liveness:
        # kopf serves plain http only and would fail on anything else after startup.
        url = urllib.parse.urlsplit(args.liveness)
        try:
            url.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        except ValueError:
            url = url._replace(scheme="")
        if url.scheme != "http":
            return f"liveness: {args.liveness!r} is not http://HOST:PORT/PATH (or '' to disable)"
    return None


def missing_peerings(kube: Kube, args: argparse.Namespace) -> list[str]:
    """The peering objects this operator needs that do not exist. kopf waits for them without a
    word (it logs the 404 at DEBUG), so an operator started by hand without one handles nothing
    and says nothing. Glob namespaces are not checked; a refused GET is left to kopf to report."""
    if args.standalone:
        return []
    name = args.peering
    if args.all_namespaces:
        wanted = [(f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}", f"ClusterKopfPeering {name}")]
    else:
        wanted = [
            (f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{name}", f"KopfPeering {ns}/{name}")
            for ns in args.namespaces
            if not any(c in ns for c in "*?[")
        ]
    missing = []
    for path, what in wanted:
        try:
            if kube.request("GET", path) is None:
                missing.append(what)
        except KubeError:
            continue
    return missing


def settings_for(args: argparse.Namespace) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Keep kopf's bookkeeping in annotations of our own prefix, out of the typed status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=KOPF_PREFIX)
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    settings.posting.level = logging.INFO
    # Events say who wrote them (`kubectl describe`'s From column): the operator, and which
    # replica (the pod's name), rather than kopf's "kopf"/"dev".
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = os.environ.get("HOSTNAME", "") or MANAGED_BY
    settings.posting.event_name_prefix = f"{MANAGED_BY}-"
    settings.watching.server_timeout = 300
    settings.peering.stealth = True
    # A deleted LLMService keeps kopf's finalizer until its resync timer has returned; a timer
    # still running when the deletion arrives (a sync handler cannot be cancelled) is checked
    # again only after this long: kopf's default, 60 s, held every such deletion for a minute.
    settings.background.cancellation_polling = 1.0
    # The API server filters the children's watches (Deployments, Services) to ours, so the
    # operator is not sent every Deployment and Service in the watched namespaces.
    managed = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    settings.watching.label_selectors["apps", "deployments"] = managed
    settings.watching.label_selectors["v1", "services"] = managed
    if args.workers:
        settings.execution.max_workers = args.workers
    return settings


def run(args: argparse.Namespace) -> int:
    error = check_flags(args)
    if error:
        print(f"splitserve operator: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = OperatorConfig(
        worker_image=args.worker_image,
        resync_seconds=args.resync_seconds,
        cluster_domain=args.cluster_domain,
        monitoring=args.monitoring,
        network_policies=args.network_policies,
        prometheus_url=args.prometheus_url or None,
    )
    try:
        api_client = load_api_client()
    except NoCredentialsError as e:
        print(f"splitserve operator: {e}", file=sys.stderr)
        return 1
    kube = Kube(api_client)
    for peering in missing_peerings(kube, args):
        logging.getLogger("splitserve.operator").warning(
            f"peering: {peering} not found: the operator stays paused, handling nothing, until "
            "it exists; create it (the Helm chart does, peering.enabled) or run with --standalone"
        )
    registry = kopf.OperatorRegistry()
    register(registry, Operator(kube, config))
    # Replicas of one Deployment share their flags; distinct random priorities make exactly one
    # of them act (kopf pauses every operator that sees a peer of equal priority).
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    kopf.run(
        registry=registry,
        settings=settings_for(args),
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespaces or (),
        standalone=True if args.standalone else None,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        liveness_endpoint=args.liveness or None,
    )
    return 0
