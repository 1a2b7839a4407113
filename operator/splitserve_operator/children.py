"""The desired child objects of one LLMService: the worker ConfigMap, a Deployment per pool,
Services (router ClusterIP, headless pools for DNS discovery), PodDisruptionBudgets and, when
the cluster serves monitoring.coreos.com, a ServiceMonitor, a PodMonitor and a PrometheusRule
alerting on the SLO; and the children a
changed spec rules out. Pure: dicts in, dicts out; reconcile.py sends them to the API server,
handlers.py deletes the ruled-out ones."""

from __future__ import annotations

import math
from typing import Any

from . import GROUP, KIND, VERSION
from .autoscaler import hpa_behavior
from .config import OperatorConfig
from .keda import SCALED_OBJECT, keda_problem, prometheus_url, scaled_objects
from .names import (
    CONFIG_KEY,
    DECODE_PORT,
    METRICS_PORT,
    PREFILL_PORT,
    child_name,
    common_labels,
    config_map_name,
    selector_labels,
)
from .podtemplate import pod_template
from .spec import POOLS, Spec, parse_duration
from .status import pod_ended
from .workerconfig import component_configs, config_hash, serving_config


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any]) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]}


def config_map(
    service: str, namespace: str, text: str, digest: str, owner: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            config_map_name(service, digest), namespace, common_labels(service, "config"), owner
        ),
        "data": {CONFIG_KEY: text},
        "immutable": True,
    }


def deployment(
    component: str,
    service: str,
    namespace: str,
    spec: Spec,
    image: str,
    digest: str,
    owner: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(
            child_name(service, component), namespace, common_labels(service, component), owner
        ),
        "spec": {
            # reconcile.py decides whether replicas is sent (it depends on the autoscaling mode).
            "replicas": spec.pool(component).replicas,
            "selector": {"matchLabels": selector_labels(service, component)},
            "revisionHistoryLimit": 3,
            # Loading a large model from a network volume can take minutes.
            "progressDeadlineSeconds": 900,
            # Never drop below the serving capacity during a rollout; with scarce GPUs a surge
            # pod may wait for a free GPU, which stalls the rollout rather than the service.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": pod_template(component, service, spec, image, digest),
        },
    }


def router_service(service: str, namespace: str, spec: Spec, owner: dict[str, Any]) -> dict:
    port = spec.router.settings["port"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            child_name(service, "router"), namespace, common_labels(service, "router"), owner
        ),
        "spec": {
            "type": spec.router.settings["serviceType"],
            "selector": selector_labels(service, "router"),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pool_service(component: str, service: str, namespace: str, owner: dict[str, Any]) -> dict:
    """Headless: the router resolves the pods' addresses through DNS and balances itself."""
    port = PREFILL_PORT if component == "prefill" else DECODE_PORT
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            child_name(service, component), namespace, common_labels(service, component), owner
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(service, component),
            "ports": [
                {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def disruption_budget(component: str, service: str, namespace: str, owner: dict) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(
            child_name(service, component), namespace, common_labels(service, component), owner
        ),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(service, component)},
        },
    }


def network_policy(service: str, namespace: str, owner: dict) -> dict:
    """Ingress to the worker pools: their gRPC ports (unauthenticated: Reserve, Prefill, PushKV,
    Abort) only from this service's router, and decode's also from its prefill pool (the KV
    stream); the metrics and probe port from anywhere (Prometheus, the built-in autoscaler's
    own scrapes; the kubelet's probes are always admitted). Routers stay open to clients."""

    def pods(component: str) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": selector_labels(service, component)}}

    def ports(*numbers: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": n} for n in numbers]

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(
            child_name(service, "workers"), namespace, common_labels(service, "workers"), owner
        ),
        "spec": {
            "podSelector": {
                "matchLabels": {
                    k: v
                    for k, v in selector_labels(service, "workers").items()
                    if k != "app.kubernetes.io/component"
                },
                "matchExpressions": [
                    {
                        "key": "app.kubernetes.io/component",
                        "operator": "In",
                        "values": ["prefill", "decode"],
                    }
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [pods("router")], "ports": ports(PREFILL_PORT, DECODE_PORT)},
                {"from": [pods("prefill")], "ports": ports(DECODE_PORT)},
                {"ports": ports(METRICS_PORT)},
            ],
        },
    }


SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
POD_MONITOR = ("monitoring.coreos.com/v1", "PodMonitor")


def monitors(service: str, namespace: str, spec: Spec, owner: dict) -> list[dict[str, Any]]:
    interval = spec.monitoring_interval
    workers = common_labels(service, "workers")
    return [
        {
            "apiVersion": SERVICE_MONITOR[0],
            "kind": SERVICE_MONITOR[1],
            "metadata": _meta(
                child_name(service, "router"), namespace, common_labels(service, "router"), owner
            ),
            "spec": {
                "selector": {"matchLabels": selector_labels(service, "router")},
                # honorLabels: the series keep our `service` label (the LLMService) instead of
                # having it renamed to exported_service by the target's `service` (the Service).
                "endpoints": [
                    {"port": "http", "path": "/metrics", "interval": interval, "honorLabels": True}
                ],
            },
        },
        {
            "apiVersion": POD_MONITOR[0],
            "kind": POD_MONITOR[1],
            "metadata": _meta(child_name(service, "workers"), namespace, workers, owner),
            "spec": {
                "selector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": workers["app.kubernetes.io/name"],
                        "app.kubernetes.io/instance": service,
                    },
                    "matchExpressions": [
                        {
                            "key": "app.kubernetes.io/component",
                            "operator": "In",
                            "values": ["prefill", "decode"],
                        }
                    ],
                },
                "podMetricsEndpoints": [
                    {
                        "port": "metrics",
                        "path": "/metrics",
                        "interval": interval,
                        "honorLabels": True,
                    }
                ],
            },
        },
    ]


PROMETHEUS_RULE = ("monitoring.coreos.com/v1", "PrometheusRule")
# The alerts' rate window: a quantile over fewer minutes swings with a handful of requests.
# Never under four scrape intervals either (autoscaler.window_seconds' rule): a rate needs two
# samples, and scraped every 4m or 5m a 5m window held two at none of promtool's evaluations,
# so no alert ever fired.
ALERT_WINDOW = "5m"
ALERT_WINDOW_SECONDS = 300
ALERT_WINDOW_SCRAPES = 4


def alert_window(spec: Spec) -> str:
    """The alerts' rate window: ALERT_WINDOW, or four scrape intervals when that is longer."""
    scrape = parse_duration(spec.monitoring_interval, "spec.monitoring.interval")
    seconds = math.ceil(ALERT_WINDOW_SCRAPES * scrape)
    return ALERT_WINDOW if seconds <= ALERT_WINDOW_SECONDS else f"{seconds}s"


# SplitserveRequestErrors fires above this share of requests ending in a server error,
# SplitserveNoCapacity above this share refused for want of capacity (503 no_capacity).
ERROR_RATIO = 0.05
NO_CAPACITY_RATIO = 0.01


def _objective(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def slo_alerts(service: str, namespace: str, spec: Spec, owner: dict) -> dict[str, Any]:
    """A PrometheusRule whose alerts say the SLO is missed, on the router's edge metrics (what
    clients felt): TTFT and TPOT at the SLO's percentile above their objectives, server errors,
    and requests refused for want of capacity, each for spec.monitoring.alerts.for."""
    router = f'namespace="{namespace}",service="{service}",pool="router"'
    q = f"{spec.percentile / 100:g}"
    pct = f"p{spec.percentile:g}"
    who = f"LLMService {namespace}/{service}"
    # `namespace` too: the expressions sum it away, and LLMServices of one name in two
    # namespaces raised alerts with one label set, which Alertmanager merges into one.
    labels = {"severity": "warning", "namespace": namespace, "llmservice": service}
    window = alert_window(spec)

    def alert(name: str, expr: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": spec.alerts_for,
            "labels": labels,
            "annotations": {"summary": f"{who}: {summary}", "description": description},
        }

    def latency(name: str, metric: str, what: str, objective: float) -> dict[str, Any]:
        rate = f"rate(splitserve_{metric}_bucket{{{router}}}[{window}])"
        return alert(
            name,
            f"histogram_quantile({q}, sum by (le) ({rate})) > {objective:g}",
            f"{pct} {what} above its {_objective(objective)} objective",
            f"{pct} {what} at the router over the last {window} is "
            "{{ $value | humanizeDuration }}, above the objective of "
            f"{_objective(objective)} for {spec.alerts_for}. The LLMService's "
            "status.autoscaler.<pool>.lastDecision says what the autoscaler made of it.",
        )

    def share(name: str, status: str, ratio: float, outcome: str, cause: str) -> dict[str, Any]:
        some = f'sum(rate(splitserve_requests_total{{{router},status="{status}"}}[{window}]))'
        every = f"sum(rate(splitserve_requests_total{{{router}}}[{window}]))"
        return alert(
            name,
            f"{some} / {every} > {ratio:g}",
            f"over {ratio:.0%} of requests {outcome}",
            "{{ $value | humanizePercentage }} of requests over the last "
            f'{window} {outcome}: {cause} (splitserve_requests_total{{status="{status}"}}).',
        )

    return {
        "apiVersion": PROMETHEUS_RULE[0],
        "kind": PROMETHEUS_RULE[1],
        "metadata": _meta(
            child_name(service, "slo"), namespace, common_labels(service, "slo"), owner
        ),
        "spec": {
            "groups": [
                {
                    "name": f"splitserve.{namespace}.{service}",
                    "rules": [
                        latency(
                            "SplitserveTTFTAboveObjective",
                            "time_to_first_token_seconds",
                            "time to first token",
                            spec.ttft_seconds,
                        ),
                        latency(
                            "SplitserveTPOTAboveObjective",
                            "time_per_output_token_seconds",
                            "time per output token",
                            spec.tpot_seconds,
                        ),
                        share(
                            "SplitserveRequestErrors",
                            "error",
                            ERROR_RATIO,
                            "end in a server error",
                            "a worker failing or unreachable; the router's log and the "
                            "workers' Events say which",
                        ),
                        share(
                            "SplitserveNoCapacity",
                            "no_capacity",
                            NO_CAPACITY_RATIO,
                            "are refused for want of capacity",
                            "no decode worker had free KV blocks within the admission "
                            "timeout, or a pool had no worker; the pools' maxReplicas or the "
                            "GPU budget may be too low",
                        ),
                    ],
                }
            ]
        },
    }


# Mode HPA's default metrics: per-pod series prometheus-adapter serves from what the workers
# export (manifests/prometheus-adapter/values.yaml has the rules), at the targets the built-in
# autoscaler sizes for. The HPA controller caps a scale-down window at one hour.
HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
HPA_BATCH_FILL = 0.8


def _pods_metric(name: str, average: str) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": average},
        },
    }


def default_hpa_metrics(pool: str, spec: Spec) -> list[dict[str, Any]]:
    if pool == "prefill":
        # Busy seconds per second per pod: engine utilization.
        return [
            _pods_metric(
                "splitserve_busy_ratio", f"{round(spec.targets.prefill_utilization * 1000)}m"
            )
        ]
    batch = int(spec.decode.settings["maxBatchSize"])
    return [
        _pods_metric(
            "splitserve_kv_cache_usage_ratio", f"{round(spec.targets.kv_cache_usage * 1000)}m"
        ),
        # Sequences per pod: a batch this full still leaves slots for arrivals.
        _pods_metric("splitserve_requests_running", str(max(1, math.ceil(batch * HPA_BATCH_FILL)))),
    ]


def autoscalers(service: str, namespace: str, spec: Spec, owner: dict) -> list[dict[str, Any]]:
    """Mode HPA: one autoscaling/v2 HorizontalPodAutoscaler per scaled pool, targeting its
    Deployment within spec.<pool>.autoscaling's bounds; it scales up by at most 2x per
    autoscaling.interval and down after autoscaling.scaleDownStabilization, like Builtin."""
    out = []
    for pool in ("prefill", "decode"):
        bounds = spec.pool(pool).bounds
        assert bounds is not None  # parse_spec requires them in mode HPA
        name = child_name(service, pool)
        out.append(
            {
                "apiVersion": HPA[0],
                "kind": HPA[1],
                "metadata": _meta(name, namespace, common_labels(service, pool), owner),
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": bounds.min_replicas,
                    "maxReplicas": bounds.max_replicas,
                    "metrics": list(bounds.metrics) or default_hpa_metrics(pool, spec),
                    "behavior": hpa_behavior(
                        spec.autoscaling_interval, spec.scale_down_stabilization
                    ),
                },
            }
        )
    return out


def desired_children(
    service: str,
    namespace: str,
    uid: str,
    spec: Spec,
    config: OperatorConfig,
    monitoring_available: bool,
    keda_available: bool = False,
    rules_available: bool = False,
) -> list[dict[str, Any]]:
    """Every child object of one LLMService, in apply order (ConfigMap before the pods)."""
    owner = owner_reference(service, uid)
    serving = serving_config(spec, service, namespace, config.cluster_domain)
    # One ConfigMap per distinct text: the prefill and decode pools read the same sections.
    texts = component_configs(serving)
    digests = {c: config_hash(text) for c, text in texts.items()}
    image = spec.image or config.worker_image
    objects: list[dict[str, Any]] = [
        config_map(service, namespace, text, digest, owner)
        for digest, text in {digests[c]: texts[c] for c in POOLS}.items()
    ]
    objects.append(router_service(service, namespace, spec, owner))
    objects += [pool_service(c, service, namespace, owner) for c in ("prefill", "decode")]
    objects += [deployment(c, service, namespace, spec, image, digests[c], owner) for c in POOLS]
    objects += [disruption_budget(c, service, namespace, owner) for c in POOLS]
    if config.network_policies == "on":
        objects.append(network_policy(service, namespace, owner))
    if monitoring_available and spec.monitoring_enabled and config.monitoring != "off":
        objects += monitors(service, namespace, spec, owner)
        if rules_available and spec.alerts_enabled:
            objects.append(slo_alerts(service, namespace, spec, owner))
    if spec.autoscaling_mode == "HPA":
        objects += autoscalers(service, namespace, spec, owner)
    if spec.autoscaling_mode == "KEDA" and not keda_problem(spec, config, keda_available):
        url = prometheus_url(spec, config) or ""  # unused when every pool has its own triggers
        objects += scaled_objects(service, namespace, spec, owner, url)
    return objects


def unwanted_children(
    service: str, spec: Spec, config: OperatorConfig
) -> dict[str, list[tuple[str, str, str]]]:
    """The children this LLMService may have made under an earlier spec and that its spec now
    rules out, as (apiVersion, kind, name) by why they go: HPAs outside mode HPA and KEDA
    ScaledObjects outside mode KEDA (they would keep resizing the pools), monitors and the
    PrometheusRule once spec.monitoring.enabled is false (they would keep being scraped and
    evaluated), the PrometheusRule alone once spec.monitoring.alerts.enabled is false.
    `--monitoring off` rules out none: the operator then leaves monitors alone, neither making
    nor deleting them. The caller deletes only those the LLMService owns."""
    unwanted: dict[str, list[tuple[str, str, str]]] = {}
    mode = f"autoscaling.mode is {spec.autoscaling_mode}"
    if spec.autoscaling_mode != "HPA":
        unwanted[mode] = [(*HPA, child_name(service, pool)) for pool in ("prefill", "decode")]
    if spec.autoscaling_mode != "KEDA":
        unwanted.setdefault(mode, []).extend(
            (*SCALED_OBJECT, child_name(service, pool)) for pool in ("prefill", "decode")
        )
    if not spec.monitoring_enabled and config.monitoring != "off":
        unwanted["monitoring.enabled is false"] = [
            (*SERVICE_MONITOR, child_name(service, "router")),
            (*POD_MONITOR, child_name(service, "workers")),
            (*PROMETHEUS_RULE, child_name(service, "slo")),
        ]
    elif not spec.alerts_enabled and config.monitoring != "off":
        unwanted["monitoring.alerts.enabled is false"] = [
            (*PROMETHEUS_RULE, child_name(service, "slo"))
        ]
    return unwanted


def mounted_config_maps(pod_spec: dict[str, Any]) -> set[str]:
    """The ConfigMaps a pod spec mounts, directly or in a projected volume."""
    names: set[str] = set()
    for volume in pod_spec.get("volumes") or []:
        if ref := volume.get("configMap"):
            names.add(str(ref.get("name")))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if ref := source.get("configMap"):
                names.add(str(ref.get("name")))
    return names


def superseded_configs(
    config_maps: list[dict[str, Any]],
    uid: str,
    deployments: list[dict[str, Any]],
    replica_sets: list[dict[str, Any]],
    pods: list[dict[str, Any]],
) -> list[str]:
    """The config ConfigMaps of the LLMService with this uid that nothing can mount any more:
    not a Deployment's template, not a ReplicaSet that still has or wants pods (a rollout's old
    side, which may yet replace a pod), not a pod that exists and has not ended (an evicted
    pod never starts again). Each config version is its own immutable ConfigMap, so these pile
    up with every config change unless collected. Empty
    ReplicaSets (the rollout history) do not keep theirs: the operator owns the template, and a
    `kubectl rollout undo` to one is reverted at the next reconcile anyway. With no Deployment
    at all (being created, or deleted and about to be repaired) nothing is judged."""
    if not deployments:
        return []
    in_use: set[str] = set()
    for deployment in deployments:
        in_use |= mounted_config_maps(deployment["spec"]["template"].get("spec") or {})
    for rs in replica_sets:
        if (rs.get("spec") or {}).get("replicas") or (rs.get("status") or {}).get("replicas"):
            in_use |= mounted_config_maps(rs["spec"]["template"].get("spec") or {})
    for pod in pods:
        if pod_ended(pod):
            continue  # evicted, say: it never starts again
        in_use |= mounted_config_maps(pod.get("spec") or {})
    return sorted(
        str(cm["metadata"]["name"])
        for cm in config_maps
        if any(o.get("uid") == uid for o in cm["metadata"].get("ownerReferences") or [])
        and cm["metadata"]["name"] not in in_use
    )
