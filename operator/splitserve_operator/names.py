"""Names and labels of an LLMService's children: one place, so builders, status and tests agree.
Selectors use only the stable labels (name, instance, component): Deployment selectors are
immutable."""

from __future__ import annotations

from splitserve_workers.config import CONFIG_PATH_IN_POD

APP = "splitserve"
MANAGED_BY = "splitserve-operator"
CONFIG_HASH_ANNOTATION = "splitserve.io/config-hash"
CONFIG_KEY = "config.yaml"
CONFIG_DIR = CONFIG_PATH_IN_POD.rsplit("/", 1)[0]

PREFILL_PORT = 50051
DECODE_PORT = 50052
METRICS_PORT = 9100


def child_name(service: str, component: str) -> str:
    """component: router | prefill | decode | config | workers | slo (the PrometheusRule)."""
    return f"{service}-{component}"


def config_map_name(service: str, digest: str) -> str:
    """One version of the serving config: named by its content hash (the pod template's
    config-hash annotation) and immutable, so a pod always reads the config its template was
    made with, even when it restarts in the middle of a rollout to a newer one."""
    return f"{child_name(service, 'config')}-{digest}"


def selector_labels(service: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": component,
    }


def common_labels(service: str, component: str) -> dict[str, str]:
    return {
        **selector_labels(service, component),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": APP,
    }


def pool_service_host(service: str, component: str, namespace: str, domain: str) -> str:
    return f"{child_name(service, component)}.{namespace}.svc.{domain}"
