"""The pod template of each pool (router, prefill, decode): the worker container contract
(command, ports, probes, config mount), the model volume, and the hardening every pod gets
(non-root, read-only root filesystem, no privilege escalation, no capabilities, RuntimeDefault
seccomp). Pure: spec in, dict out. children.py wraps it in a Deployment."""

from __future__ import annotations

from typing import Any

from splitserve_workers.config import CONFIG_PATH_IN_POD

from .names import (
    CONFIG_DIR,
    CONFIG_HASH_ANNOTATION,
    DECODE_PORT,
    METRICS_PORT,
    PREFILL_PORT,
    common_labels,
    config_map_name,
    selector_labels,
)
from .spec import Spec

# The writable /tmp (HOME) of every pod: Python, torch and CUDA's JIT cache (~/.nv, capped by
# the driver at CUDA_CACHE_MAXSIZE, at most 4 GiB). Bounded so a runaway writer gets its pod
# evicted instead of filling the node's disk; a model volume may still be mounted under /tmp
# (a nested mount, not counted here).
TMP_SIZE_LIMIT = "8Gi"

# The router's API keys (spec.router.apiKeySecret) are projected into the config volume under
# this name: no mount of their own, so no path a model volume could collide with.
API_KEYS_FILE = "api-keys"

RUN_AS_USER = 10001  # the worker image's USER (Dockerfile.worker); a test keeps them equal
MODEL_VOLUME = "model"


# How long a request waits for a worker of a pool at zero (router --empty-pool-wait).
EMPTY_POOL_WAIT_S = 300


def may_sleep(spec: Spec) -> bool:
    """Whether the autoscaler may take a pool to zero (an autoscaled minReplicas of 0). An
    argument of the router's, not worker configuration: changing it restarts only the router."""
    return spec.autoscaling_mode != "Off" and any(
        (bounds := spec.pool(p).bounds) is not None and bounds.min_replicas == 0
        for p in ("prefill", "decode")
    )


# Seconds of terminationGracePeriodSeconds kept back from the drain for the process to exit
# (cut what is left, tell its clients, stop its servers: ~1.5-2 s) before the kubelet's
# SIGKILL: 5, or half a short period but never under 2.
DRAIN_EXIT_MARGIN_S = 5
MIN_DRAIN_EXIT_MARGIN_S = 2


def drain_timeout(spec: Spec) -> str:
    """--drain-timeout for every container: the pod's grace period less the exit margin. The
    processes' own defaults (60 s workers, 30 s router) would outlast a short grace period, and
    the kubelet's SIGKILL would end streams with no error event, or cut a long one's drain
    short. Under 2 s of grace nothing is left to drain."""
    grace = spec.termination_grace_seconds
    margin = min(DRAIN_EXIT_MARGIN_S, max(MIN_DRAIN_EXIT_MARGIN_S, grace / 2))
    return f"{max(0.0, grace - margin):g}"


def container_args(component: str, spec: Spec) -> list[str]:
    if component == "router":
        port = spec.router.settings["port"]
        args = ["router", "--config", CONFIG_PATH_IN_POD, "--port", str(port)]
        args += ["--drain-timeout", drain_timeout(spec)]
        if "apiKeySecret" in spec.router.settings:
            args += ["--api-key-file", f"{CONFIG_DIR}/{API_KEYS_FILE}"]
        if may_sleep(spec):
            # The router must stay in its Service while a pool is at zero (the requests that
            # wake it have to reach it), and a request waits out the pool's cold start:
            # autoscaler interval, pod scheduling, image pull, model load.
            args += ["--ready-without-workers", "--empty-pool-wait", str(EMPTY_POOL_WAIT_S)]
        return args
    port = PREFILL_PORT if component == "prefill" else DECODE_PORT
    return [
        component,
        "--config",
        CONFIG_PATH_IN_POD,
        "--port",
        str(port),
        "--metrics-port",
        str(METRICS_PORT),
        "--drain-timeout",
        drain_timeout(spec),
    ]


def container_ports(component: str, spec: Spec) -> list[dict[str, Any]]:
    if component == "router":
        return [{"name": "http", "containerPort": spec.router.settings["port"], "protocol": "TCP"}]
    port = PREFILL_PORT if component == "prefill" else DECODE_PORT
    return [
        {"name": "grpc", "containerPort": port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]


def probes(component: str) -> dict[str, Any]:
    # Workers answer /health while the model loads; /ready only once it can serve (and turns
    # false again while draining), so a loading or draining pod gets no traffic but is not killed.
    port = "http" if component == "router" else "metrics"
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "failureThreshold": 120,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
    }


def model_volume(spec: Spec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the model weights; empty when they are in the image."""
    if spec.volume is None:
        return [], []
    volume = {"name": MODEL_VOLUME, **spec.volume}
    if "persistentVolumeClaim" in volume:
        volume["persistentVolumeClaim"] = {**volume["persistentVolumeClaim"], "readOnly": True}
    mount = {"name": MODEL_VOLUME, "mountPath": spec.mount_path, "readOnly": True}
    return [volume], [mount]


def topology_spread(component: str, service: str, spec: Spec) -> list[dict[str, Any]]:
    spread = spec.pool(component).topology_spread
    if not spread.enabled:
        return []
    return [
        {
            "maxSkew": spread.max_skew,
            "topologyKey": spread.topology_key,
            "whenUnsatisfiable": spread.when_unsatisfiable,
            "labelSelector": {"matchLabels": selector_labels(service, component)},
            # Count only pods of the same revision, so a rolling update spreads the new pods too.
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]


def config_volume(component: str, service: str, spec: Spec, digest: str) -> dict[str, Any]:
    """The ConfigMap with this version of the serving config; for a router with API keys,
    projected together with the Secret's key file (kubelet updates the Secret in place, which is
    how keys rotate; the ConfigMap is immutable)."""
    config_map = {"name": config_map_name(service, digest)}
    secret = spec.router.settings.get("apiKeySecret") if component == "router" else None
    if secret is None:
        return {"name": "config", "configMap": config_map}
    items = [{"key": secret["key"], "path": API_KEYS_FILE}]
    return {
        "name": "config",
        "projected": {
            "sources": [
                {"configMap": config_map},
                {"secret": {"name": secret["name"], "items": items}},
            ]
        },
    }


def pod_template(
    component: str, service: str, spec: Spec, image: str, config_hash: str
) -> dict[str, Any]:
    pool = spec.pool(component)
    volumes, mounts = model_volume(spec)
    volumes = [
        config_volume(component, service, spec, config_hash),
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        *volumes,
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        *mounts,
    ]
    container: dict[str, Any] = {
        "name": component,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["splitserve"],
        "args": container_args(component, spec),
        "ports": container_ports(component, spec),
        "env": [
            {"name": "HOME", "value": "/tmp"},
            # CPU workers build their decode-attention kernel here at first start (inside
            # the pod's own /tmp, which is world-writable as every emptyDir is).
            {"name": "SPLITSERVE_KERNEL_CACHE", "value": "/tmp/kernels"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
        "resources": pool.resources,
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        **probes(component),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    spread = topology_spread(component, service, spec)
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if pool.node_selector:
        pod_spec["nodeSelector"] = pool.node_selector
    if pool.tolerations:
        pod_spec["tolerations"] = pool.tolerations
    if pool.affinity:
        pod_spec["affinity"] = pool.affinity
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = spec.image_pull_secrets
    return {
        "metadata": {
            "labels": common_labels(service, component),
            "annotations": {**pool.pod_annotations, CONFIG_HASH_ANNOTATION: config_hash},
        },
        "spec": pod_spec,
    }
