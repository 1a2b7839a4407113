"""A small synchronous Kubernetes API layer for the operator: GET, server-side apply, merge patch
and discovery on plain dicts, for any kind the operator owns. It borrows credentials and TLS from
the official client's ApiClient (kubeconfig or in-cluster) and nothing else, so dicts from
children.py go to the API server unchanged."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

# (apiVersion, kind) -> plural, for every kind the operator reads or writes.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("splitserve.io/v1alpha1", "LLMService"): "llmservices",
}


class KubeError(RuntimeError):
    """The API server refused a request; carries the HTTP status and the server's message."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message  # the server's own words

    def applying(self, what: str, doing: str = "applying") -> KubeError:
        """The same error, told as a kubectl user reads it (status, Events): which child the
        API server refused and why, e.g. "applying Deployment ns/x: Deployment.apps "x" is
        invalid: ... (HTTP 422)", instead of the request line."""
        err = KubeError(self.status, "", "", self.message)
        err.args = (f"{doing} {what}: {self.message} (HTTP {self.status})",)
        return err


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Ref:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])

    def path(self, subresource: str = "") -> str:
        plural = PLURALS[(self.api_version, self.kind)]
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        tail = f"/{subresource}" if subresource else ""
        return f"{root}/namespaces/{self.namespace}/{plural}/{self.name}{tail}"

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


class NoCredentialsError(Exception):
    """Neither in-cluster credentials nor a usable kubeconfig: the command says so in one line."""


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except ConfigException:
        try:
            # KUBECONFIG as it is now: the client reads it once, when it is imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (ConfigException, OSError) as e:
            raise NoCredentialsError(
                f"no cluster credentials: not running in a pod, and no usable kubeconfig ({e}); "
                "set KUBECONFIG or run inside the cluster"
            ) from e
    return client.ApiClient()


# (connect, read) seconds for every call. The client's default is none at all: an API server
# that stops answering without closing the connection (a network partition, a frozen or
# failed-over control plane) blocked the call for good, with the LLMService's lock held, so
# that LLMService was never reconciled again and autoscaler threads were lost one by one.
REQUEST_TIMEOUT = (10.0, 30.0)


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client
        self.timeout = REQUEST_TIMEOUT

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """One API call; returns the decoded JSON body, or None for 404 on GET."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, _, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            auth_settings=["BearerToken"],
        )
        # The REST layer serialises JSON (and apply-patch YAML) bodies itself.
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=self.timeout
        )
        raw = response.read()
        if method == "GET" and response.status == 404:
            return None
        if not 200 <= response.status < 300:
            message = raw.decode(errors="replace") if raw else response.reason
            try:
                message = json.loads(message).get("message", message)
            except (ValueError, AttributeError):
                pass
            raise KubeError(response.status, method, path, str(message))
        return json.loads(raw) if raw else None

    def get(self, ref: Ref) -> dict[str, Any] | None:
        return self.request("GET", ref.path())  # type: ignore[no-any-return]

    def list_objects(
        self,
        api_version: str,
        plural: str,
        namespace: str,
        selector: dict[str, str],
        consistent: bool = False,
    ) -> list[dict[str, Any]]:
        """The namespaced objects matching every label in `selector`, from the API server's
        watch cache (resourceVersion=0: no etcd read; a status message can be a moment old).
        consistent: as of now, every write made before the call included (no resourceVersion:
        still served from the cache once it has caught up), for decisions a stale answer would
        make wrong. Each kind has its own cache, so an rv=0 list of one kind can already show a
        write that an rv=0 list of another kind, made later, does not yet."""
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        query = [("labelSelector", labels)]
        if not consistent:
            query.append(("resourceVersion", "0"))
        doc = self.request("GET", f"{prefix}/namespaces/{namespace}/{plural}", query=query)
        items: list[dict[str, Any]] = (doc or {}).get("items") or []
        return items

    def apply(self, obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
        """Server-side apply: the API server merges `obj` into the live object, owning (for
        `manager`) exactly the fields sent; force takes over fields others changed by hand."""
        query = [("fieldManager", manager)]
        if force:
            query.append(("force", "true"))
        return self.request(  # type: ignore[no-any-return]
            "PATCH",
            Ref.of(obj).path(),
            query=query,
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def patch_status(
        self, ref: Ref, status: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        """Merge-patch .status; with resource_version the server refuses (409) if the object
        changed since it was read."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request(  # type: ignore[no-any-return]
            "PATCH", ref.path("status"), body=body, content_type="application/merge-patch+json"
        )

    def serves(self, group_version: str, plurals: tuple[str, ...]) -> bool:
        """Discovery: does the cluster serve these resources (e.g. the Prometheus operator's)?"""
        # None (404): not served. Any other failure raises: the API server erring is no answer.
        doc = self.request("GET", f"/apis/{group_version}")
        names = {r.get("name") for r in (doc or {}).get("resources", [])}
        return all(p in names for p in plurals)
