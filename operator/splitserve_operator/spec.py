"""A typed, defaulted view of an LLMService `spec` (a plain dict from the API server).

The CRD schema already applies defaults and rejects bad values; this module applies the same
defaults again so the pure builders work on dicts that never went through an API server (tests,
`kubectl create --validate=false` on old clusters) and converts durations and quantities.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

from splitserve_workers.engine.config import MAX_SPECULATIVE_TOKENS

from .autoscaler import RatioBounds, Targets, unreachable_ratio

# spec.router.toolCallParser (the router's tool_parsers.PARSERS plus auto and none; a test
# checks they agree: the operator does not import the router).
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3_json")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")  # and reasoning.PARSERS
AUTOSCALING_MODES = ("Builtin", "HPA", "KEDA", "Off")
POOLS = ("router", "prefill", "decode")
# The pod template's own mounts (podtemplate.py; tests keep the two and the CRD's rule equal):
# the model is not mounted at, above or under them.
CONFIG_MOUNT = "/etc/splitserve"
POD_MOUNTS = (CONFIG_MOUNT, "/tmp")
_DOT_SEGMENT = re.compile(r"(^|/)\.\.?(/|$)")
_CANONICAL_PATH = re.compile(r"^(/[^/]+)+/?$")
# The router's requests when spec.router.resources is not set: it holds the tokenizer (about
# 70 MiB resident with a tiny one; it never imports torch) and runs the HTTP edge on one event
# loop.
ROUTER_DEFAULT_RESOURCES: dict[str, Any] = {"requests": {"cpu": "250m", "memory": "256Mi"}}

# Bounds of spec.autoscaling.interval and spec.router's timeouts (the CRD's rules too). A
# shorter interval runs Builtin's ~20 Prometheus queries in a hot loop; a longer one makes the
# signals' window, four intervals, span most of a day, and leaves a shortened interval waiting
# out the old one.
MIN_DURATION_SECONDS = 1.0
MAX_DURATION_SECONDS = 3600.0

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_ALERT_FOR = re.compile(r"^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?$")  # the CRD's pattern
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_QUANTITY_UNITS = {
    None: 1,
    "m": 1e-3,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


class SpecError(ValueError):
    """An LLMService spec value is invalid; the message names the field."""


def parse_duration(text: str, field_name: str, allow_zero: bool = False) -> float:
    """Go-style duration ("500ms", "1m30s") -> seconds; zero only where `allow_zero`."""
    value = str(text).strip()
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not value or pos != len(value):
        raise SpecError(f"{field_name}: {text!r} is not a duration like 500ms, 1.5s or 1m")
    if total < 0 or (total == 0 and not allow_zero):
        raise SpecError(f"{field_name}: {text!r} must be positive")
    return total


# The workers' config refuses shorter objectives (splitserve_workers.config: slo.*_seconds).
MIN_SLO_SECONDS = 1e-6


def slo_duration(slo: dict[str, Any], key: str, default: str) -> float:
    """spec.slo.<key> in seconds; at least 1us (objects stored before the CRD's rule)."""
    text = slo.get(key, default)
    seconds = parse_duration(text, f"spec.slo.{key}")
    if seconds < MIN_SLO_SECONDS:
        raise SpecError(f"spec.slo.{key}: {text!r} is below the minimum 1us")
    return seconds


def duration_within(text: str, field_name: str, off_allowed: bool = False) -> float:
    """A duration between 1s and 1h (spec.autoscaling.interval, spec.router's timeouts) in
    seconds; 0s too where `off_allowed` (writeTimeout: never cut a client)."""
    seconds = parse_duration(text, field_name, allow_zero=off_allowed)
    if seconds and not MIN_DURATION_SECONDS <= seconds <= MAX_DURATION_SECONDS:
        off = " (or 0s: never)" if off_allowed else ""
        raise SpecError(f"{field_name}: {text!r} must be between 1s and 1h{off}")
    return seconds


def autoscaling_interval(autoscaling: dict[str, Any]) -> float:
    """spec.autoscaling.interval in seconds, within its bounds."""
    return duration_within(autoscaling.get("interval", "15s"), "spec.autoscaling.interval")


def parse_quantity(value: int | float | str, field_name: str) -> int:
    """Kubernetes quantity ("8Gi", "512M", 1073741824) -> an integer count (bytes)."""
    if isinstance(value, bool):
        raise SpecError(f"{field_name}: {value!r} is not a quantity")
    if isinstance(value, int | float):
        return int(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise SpecError(f"{field_name}: {value!r} is not a quantity like 8Gi or 512Mi")
    return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])


def parse_percentage(value: str, field_name: str) -> float:
    """ "90%" -> 0.9, for a share in (0%, 100%]."""
    try:
        share = float(value.strip().removesuffix("%")) / 100
    except ValueError:
        raise SpecError(f"{field_name}: {value!r} is not a percentage like 90%") from None
    if not 0 < share <= 1:  # nan too
        raise SpecError(f"{field_name}: {value!r} must be in (0%, 100%]")
    return share


def _int(data: dict[str, Any], key: str, default: int, field_name: str, minimum: int = 0) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{field_name}.{key}: {value!r} is not an integer")
    if value < minimum:
        raise SpecError(f"{field_name}.{key}: {value} is below the minimum {minimum}")
    return value


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int
    metrics: tuple[dict[str, Any], ...] = ()  # mode HPA: MetricSpec items overriding defaults
    triggers: tuple[dict[str, Any], ...] = ()  # mode KEDA: ScaleTriggers overriding defaults


@dataclass(frozen=True)
class TopologySpread:
    enabled: bool = True
    topology_key: str = "kubernetes.io/hostname"
    max_skew: int = 1
    when_unsatisfiable: str = "ScheduleAnyway"


@dataclass(frozen=True)
class Pool:
    """Fields every pool (router, prefill, decode) shares; the pass-through ones stay dicts."""

    name: str
    replicas: int
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    topology_spread: TopologySpread = field(default_factory=TopologySpread)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    bounds: Bounds | None = None
    # Pool-specific knobs (maxBatchTokens, maxBatchSize, blockSize, kvCacheMemory, port).
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spec:
    model_name: str
    model_path: str
    model_dtype: str
    max_model_len: int | None
    mount_path: str
    volume: dict[str, Any] | None
    image: str | None
    image_pull_policy: str
    image_pull_secrets: list[dict[str, str]]
    termination_grace_seconds: int
    router: Pool
    prefill: Pool
    decode: Pool
    ttft_seconds: float
    tpot_seconds: float
    percentile: float
    autoscaling_mode: str
    monitoring_enabled: bool
    monitoring_interval: str
    alerts_enabled: bool = True  # spec.monitoring.alerts: the PrometheusRule on the SLO
    alerts_for: str = "10m"
    autoscaling_interval: float = 15.0
    scale_down_stabilization: float = 300.0
    gpu_budget: int | None = None
    prometheus_url: str | None = None
    # spec.autoscaling.prefillPerDecode: prefill replicas per decode replica (None: unbounded)
    prefill_per_decode_min: float | None = None
    prefill_per_decode_max: float | None = None
    targets: Targets = Targets()  # spec.autoscaling.targets

    def pool(self, name: str) -> Pool:
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode}[name]


def _pool(name: str, data: dict[str, Any] | None, required: bool) -> Pool:
    path = f"spec.{name}"
    if data is None:
        if required:
            raise SpecError(f"{path}: is required")
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: must be an object")
    replicas = _int(data, "replicas", 1, path)
    bounds = None
    if "autoscaling" in data:
        auto = data["autoscaling"] or {}
        metrics = auto.get("metrics") or []
        if not isinstance(metrics, list) or not all(isinstance(m, dict) for m in metrics):
            raise SpecError(f"{path}.autoscaling.metrics: must be a list of MetricSpec objects")
        triggers = auto.get("triggers") or []
        if not isinstance(triggers, list) or not all(
            isinstance(t, dict) and t.get("type") for t in triggers
        ):
            raise SpecError(
                f"{path}.autoscaling.triggers: must be a list of KEDA triggers, each with a type"
            )
        bounds = Bounds(
            min_replicas=_int(auto, "minReplicas", 1, f"{path}.autoscaling"),
            max_replicas=_int(auto, "maxReplicas", 8, f"{path}.autoscaling", minimum=1),
            metrics=tuple(metrics),
            triggers=tuple(triggers),
        )
        if bounds.min_replicas > bounds.max_replicas:
            raise SpecError(
                f"{path}.autoscaling.minReplicas: {bounds.min_replicas} exceeds "
                f"maxReplicas {bounds.max_replicas}"
            )
        if not bounds.min_replicas <= replicas <= bounds.max_replicas:
            raise SpecError(
                f"{path}.replicas: {replicas} is outside [{bounds.min_replicas}, "
                f"{bounds.max_replicas}] (autoscaling bounds)"
            )
    spread = data.get("topologySpread") or {}
    settings: dict[str, Any] = {}
    if name == "router":
        settings["port"] = _int(data, "port", 8000, path, minimum=1)
        settings["serviceType"] = data.get("serviceType", "ClusterIP")
        log_requests = data.get("logRequests", False)
        if not isinstance(log_requests, bool):
            raise SpecError(f"{path}.logRequests: {log_requests!r} is not a boolean")
        settings["logRequests"] = log_requests
        parser = data.get("toolCallParser", "auto")
        if parser not in TOOL_CALL_PARSERS:
            raise SpecError(
                f"{path}.toolCallParser: {parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        settings["toolCallParser"] = parser
        thinking = data.get("reasoningParser", "auto")
        if thinking not in REASONING_PARSERS:
            raise SpecError(
                f"{path}.reasoningParser: {thinking!r} is not one of {', '.join(REASONING_PARSERS)}"
            )
        settings["reasoningParser"] = thinking
        settings["admissionTimeoutSeconds"] = duration_within(
            data.get("admissionTimeout", "30s"), f"{path}.admissionTimeout"
        )
        settings["writeTimeoutSeconds"] = duration_within(
            data.get("writeTimeout", "60s"), f"{path}.writeTimeout", off_allowed=True
        )
        secret = data.get("apiKeySecret")
        if secret is not None:
            if not isinstance(secret, dict) or not secret.get("name"):
                raise SpecError(f"{path}.apiKeySecret.name: is required")
            settings["apiKeySecret"] = {
                "name": str(secret["name"]),
                "key": str(secret.get("key") or "api-key"),
            }
    elif name == "prefill":
        settings["maxBatchTokens"] = _int(data, "maxBatchTokens", 8192, path, minimum=1)
    else:
        settings["maxBatchSize"] = _int(data, "maxBatchSize", 128, path, minimum=1)
        settings["blockSize"] = _int(data, "blockSize", 16, path, minimum=1)
        settings["speculativeTokens"] = _int(data, "speculativeTokens", 0, path)
        if settings["speculativeTokens"] > MAX_SPECULATIVE_TOKENS:  # objects before the schema's
            raise SpecError(
                f"{path}.speculativeTokens: {settings['speculativeTokens']} is above the "
                f"maximum {MAX_SPECULATIVE_TOKENS}"
            )
    if name != "router" and "kvCacheMemory" in data:
        value, where = data["kvCacheMemory"], f"{path}.kvCacheMemory"
        if isinstance(value, str) and value.strip().endswith("%"):
            # A share of the memory free once the weights are loaded (the worker measures it).
            settings["kvCacheMemoryFraction"] = parse_percentage(value, where)
        else:
            kv_bytes = parse_quantity(value, where)
            if kv_bytes < 1:
                # Objects stored before the schema's rule: the worker config would refuse it.
                raise SpecError(f"{where}: {value!r} must be positive")
            settings["kvCacheMemoryBytes"] = kv_bytes
    resources = dict(data.get("resources") or {})
    if name == "router" and "resources" not in data:
        # Unset, the router pods would be BestEffort: first evicted under node pressure, and
        # placed with no room reserved. `resources: {}` keeps that choice explicit.
        resources = copy.deepcopy(ROUTER_DEFAULT_RESOURCES)
    return Pool(
        name=name,
        replicas=replicas,
        resources=resources,
        node_selector=dict(data.get("nodeSelector") or {}),
        tolerations=list(data.get("tolerations") or []),
        affinity=dict(data.get("affinity") or {}),
        topology_spread=TopologySpread(
            enabled=bool(spread.get("enabled", True)),
            topology_key=spread.get("topologyKey", "kubernetes.io/hostname"),
            max_skew=_int(spread, "maxSkew", 1, f"{path}.topologySpread", minimum=1),
            when_unsatisfiable=spread.get("whenUnsatisfiable", "ScheduleAnyway"),
        ),
        pod_annotations=dict(data.get("podAnnotations") or {}),
        bounds=bounds,
        settings=settings,
    )


def _check_model_paths(path: str, mount_path: str) -> None:
    """What the CRD's rules refuse, for objects stored before those rules existed."""
    if not _CANONICAL_PATH.match(mount_path) or _DOT_SEGMENT.search(mount_path):
        raise SpecError(
            f"spec.model.mountPath: {mount_path!r} must be an absolute path other than /, "
            "without empty, '.' or '..' segments"
        )
    mount = mount_path.rstrip("/") + "/"
    for own in POD_MOUNTS:
        # At or above a pod mount hides it; under the read-only config it cannot be created
        # (under /tmp, a writable emptyDir, is a nested mount that works).
        if (own + "/").startswith(mount) or (own == CONFIG_MOUNT and mount.startswith(own + "/")):
            raise SpecError(
                f"spec.model.mountPath: {mount_path!r} must not be or contain /etc/splitserve "
                "or /tmp, nor lie under /etc/splitserve (the pods' read-only config)"
            )
    if _DOT_SEGMENT.search(path):
        raise SpecError(f"spec.model.path: {path!r} must not contain '.' or '..' segments")


def parse_spec(spec: dict[str, Any] | None) -> Spec:
    """Validate and default an LLMService spec dict; raises SpecError naming the field."""
    if not isinstance(spec, dict):
        raise SpecError("spec: is required")
    model = spec.get("model")
    if not isinstance(model, dict):
        raise SpecError("spec.model: is required")
    for key in ("name", "path"):
        if not model.get(key):
            raise SpecError(f"spec.model.{key}: is required")
    if not str(model["path"]).startswith("/"):
        raise SpecError(f"spec.model.path: {model['path']!r} must be an absolute path")
    mount_path = model.get("mountPath", "/models")
    _check_model_paths(str(model["path"]), str(mount_path))
    volume = model.get("volume")
    if volume is not None:
        if not isinstance(volume, dict) or len(volume) != 1:
            raise SpecError("spec.model.volume: must name exactly one volume source")
        path = str(model["path"])
        # A directory prefix, not a string prefix: /models-old/x is not under /models.
        if path != mount_path and not path.startswith(str(mount_path).rstrip("/") + "/"):
            raise SpecError(
                f"spec.model.path: {model['path']!r} must lie under spec.model.mountPath "
                f"{mount_path!r}"
            )
    max_len = model.get("maxModelLen")
    if max_len is not None:
        _int(model, "maxModelLen", 1, "spec.model", minimum=1)
    slo = spec.get("slo") or {}
    percentile = float(slo.get("percentile", 95))
    if not 0 < percentile < 100:
        raise SpecError(f"spec.slo.percentile: {percentile} must be in (0, 100)")
    autoscaling = spec.get("autoscaling") or {}
    mode = autoscaling.get("mode", "Off")
    if mode not in AUTOSCALING_MODES:
        raise SpecError(f"spec.autoscaling.mode: {mode!r} is not one of Builtin, HPA, KEDA, Off")
    prefill = _pool("prefill", spec.get("prefill"), required=True)
    decode = _pool("decode", spec.get("decode"), required=True)
    if mode != "Off":
        for pool in (prefill, decode):
            if pool.bounds is None:
                raise SpecError(
                    f"spec.{pool.name}.autoscaling: is required when spec.autoscaling.mode "
                    f"is {mode}"
                )
            if mode == "HPA" and pool.bounds.min_replicas < 1:
                raise SpecError(
                    f"spec.{pool.name}.autoscaling.minReplicas: must be at least 1 when "
                    "spec.autoscaling.mode is HPA (HorizontalPodAutoscalers do not scale to zero)"
                )
    monitoring = spec.get("monitoring") or {}
    alerts = monitoring.get("alerts") or {}
    alerts_for = str(alerts.get("for", "10m"))
    if not _ALERT_FOR.match(alerts_for) or not re.search("[1-9]", alerts_for):
        # Stored before the schema's rule: Prometheus would refuse the whole rule group.
        raise SpecError(
            f"spec.monitoring.alerts.for: {alerts_for!r} is not a positive duration such as "
            "10m or 1h30m"
        )
    gpu_budget = None
    if autoscaling.get("gpuBudget") is not None:
        gpu_budget = _int(autoscaling, "gpuBudget", 0, "spec.autoscaling")
    prometheus = (autoscaling.get("metrics") or {}).get("prometheus") or {}
    ratio_min, ratio_max = _prefill_per_decode(autoscaling, mode, prefill, decode)
    targets = _targets(autoscaling.get("targets") or {})
    return Spec(
        model_name=str(model["name"]),
        model_path=str(model["path"]),
        model_dtype=str(model.get("dtype", "auto")),
        max_model_len=max_len,
        mount_path=str(mount_path),
        volume=dict(volume) if volume else None,
        image=spec.get("image") or None,
        image_pull_policy=str(spec.get("imagePullPolicy", "IfNotPresent")),
        image_pull_secrets=list(spec.get("imagePullSecrets") or []),
        termination_grace_seconds=_int(spec, "terminationGracePeriodSeconds", 120, "spec", 1),
        router=_pool("router", spec.get("router"), required=False),
        prefill=prefill,
        decode=decode,
        ttft_seconds=slo_duration(slo, "ttft", "500ms"),
        tpot_seconds=slo_duration(slo, "tpot", "50ms"),
        percentile=percentile,
        autoscaling_mode=mode,
        monitoring_enabled=bool(monitoring.get("enabled", True)),
        monitoring_interval=str(monitoring.get("interval", "15s")),
        alerts_enabled=bool(alerts.get("enabled", True)),
        alerts_for=alerts_for,
        autoscaling_interval=autoscaling_interval(autoscaling),
        scale_down_stabilization=parse_duration(
            autoscaling.get("scaleDownStabilization", "300s"),
            "spec.autoscaling.scaleDownStabilization",
        ),
        gpu_budget=gpu_budget,
        prometheus_url=prometheus.get("url") or None,
        prefill_per_decode_min=ratio_min,
        prefill_per_decode_max=ratio_max,
        targets=targets,
    )


def _targets(data: dict[str, Any]) -> Targets:
    """spec.autoscaling.targets, each a fraction: utilization and KV usage in (0, 1], the
    queue share in [0, 1]."""
    default = Targets()
    values = {}
    for key, attr, low_open in (
        ("prefillUtilization", "prefill_utilization", True),
        ("kvCacheUsage", "kv_cache_usage", True),
        ("prefillQueueShare", "prefill_queue_share", False),
    ):
        value = data.get(key, getattr(default, attr))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"spec.autoscaling.targets.{key}: {value!r} is not a number")
        if not (0 < value <= 1 if low_open else 0 <= value <= 1):
            interval = "(0, 1]" if low_open else "[0, 1]"
            raise SpecError(f"spec.autoscaling.targets.{key}: {value} must be in {interval}")
        values[attr] = float(value)
    return Targets(**values)


def _prefill_per_decode(
    autoscaling: dict[str, Any], mode: str, prefill: Pool, decode: Pool
) -> tuple[float | None, float | None]:
    """spec.autoscaling.prefillPerDecode {min, max}: checked as the CRD's CEL rules do."""
    ratio = autoscaling.get("prefillPerDecode")
    if ratio is None:
        return None, None
    path = "spec.autoscaling.prefillPerDecode"
    if mode != "Builtin":
        raise SpecError(f"{path}: applies only when spec.autoscaling.mode is Builtin")
    out: list[float | None] = []
    for key in ("min", "max"):
        value = ratio.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise SpecError(f"{path}.{key}: {value!r} is not a number")
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise SpecError(f"{path}.{key}: {value} must be a finite number greater than 0")
        out.append(None if value is None else float(value))
    low, high = out
    if low is not None and high is not None and low > high:
        raise SpecError(f"{path}: min {low:g} must not exceed max {high:g}")
    p, d = prefill.bounds, decode.bounds
    if p is not None and d is not None:
        ranges = (p.min_replicas, p.max_replicas), (d.min_replicas, d.max_replicas)
        which = unreachable_ratio(RatioBounds(low, high), *ranges)
        if which == "max":
            raise SpecError(
                f"{path}.max: {high:g} cannot hold: spec.prefill.autoscaling.minReplicas "
                f"{p.min_replicas} needs more than spec.decode.autoscaling.maxReplicas "
                f"{d.max_replicas} decode replicas"
            )
        if which == "min":
            raise SpecError(
                f"{path}.min: {low:g} cannot hold: spec.decode.autoscaling.minReplicas "
                f"{d.min_replicas} needs more than spec.prefill.autoscaling.maxReplicas "
                f"{p.max_replicas} prefill replicas"
            )
        if which == "both":
            raise SpecError(
                f"{path}: min {low:g} and max {high:g} cannot both hold for any whole replica "
                f"counts within spec.prefill.autoscaling [{p.min_replicas}, {p.max_replicas}] "
                f"and spec.decode.autoscaling [{d.min_replicas}, {d.max_replicas}]"
            )
    return low, high


def gpus_per_replica(pool: Pool) -> int:
    """Accelerators one replica asks for: every extended resource named <vendor>/gpu."""
    total = 0
    for section in ("limits", "requests"):
        for key, value in (pool.resources.get(section) or {}).items():
            if str(key).endswith("/gpu"):
                total = max(total, parse_quantity(value, f"spec.{pool.name}.resources.{key}"))
    return total
