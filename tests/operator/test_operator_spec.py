"""spec.parse_spec: defaults, durations, quantities and errors naming the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from splitserve_operator.spec import SpecError, parse_duration, parse_quantity, parse_spec

BASE = {
    "model": {"name": "tiny", "path": "/models/tiny"},
    "prefill": {},
    "decode": {},
}


def with_(path: str, value: object) -> dict:
    spec = copy.deepcopy(BASE)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


def test_defaults_match_the_crd_schema() -> None:
    spec = parse_spec(BASE)
    assert spec.model_dtype == "auto"
    assert spec.mount_path == "/models"
    assert spec.router.replicas == spec.prefill.replicas == spec.decode.replicas == 1
    assert spec.router.settings == {
        "port": 8000,
        "serviceType": "ClusterIP",
        "logRequests": False,
        "toolCallParser": "auto",
        "reasoningParser": "auto",
        "admissionTimeoutSeconds": 30.0,
        "writeTimeoutSeconds": 60.0,
    }
    assert spec.prefill.settings == {"maxBatchTokens": 8192}
    assert spec.decode.settings == {"maxBatchSize": 128, "blockSize": 16, "speculativeTokens": 0}
    assert (spec.ttft_seconds, spec.tpot_seconds, spec.percentile) == (0.5, 0.05, 95.0)
    assert spec.autoscaling_mode == "Off"
    assert spec.termination_grace_seconds == 120
    assert spec.prefill.topology_spread.enabled
    assert spec.prefill.bounds is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("1.5s", 1.5), ("1m30s", 90.0), ("2h", 7200.0), ("250us", 0.00025)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "f") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "fast", "500", "ms", "1.s", "-1s", "0s", "5 s", "1sm"])
def test_bad_durations_name_the_field(text: str) -> None:
    with pytest.raises(SpecError, match="^spec.slo.ttft: "):
        parse_spec(with_("slo.ttft", text))


@pytest.mark.parametrize(("key", "text"), [("ttft", "500ns"), ("tpot", "0.5us")])
def test_slo_objectives_below_a_microsecond_name_the_field(key: str, text: str) -> None:
    # The workers' config refuses them (slo.*_seconds): the spec names its own field instead.
    with pytest.raises(SpecError, match=f"^spec.slo.{key}: .* below the minimum 1us"):
        parse_spec(with_(f"slo.{key}", text))
    assert parse_spec(with_(f"slo.{key}", "1us")) is not None


@pytest.mark.parametrize(
    ("value", "count"), [("8Gi", 8 << 30), ("512Mi", 512 << 20), ("1G", 10**9), (4096, 4096)]
)
def test_quantities(value: object, count: int) -> None:
    assert parse_quantity(value, "f") == count  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("prefill.replicas", -1, "spec.prefill.replicas"),
        ("decode.replicas", "two", "spec.decode.replicas"),
        ("decode.maxBatchSize", 0, "spec.decode.maxBatchSize"),
        ("decode.speculativeTokens", 17, "spec.decode.speculativeTokens"),
        ("slo.percentile", 150, "spec.slo.percentile"),
        ("slo.percentile", 0, "spec.slo.percentile"),
        ("autoscaling.mode", "Sometimes", "spec.autoscaling.mode"),
        ("model.path", "relative/dir", "spec.model.path"),
        ("prefill.kvCacheMemory", "lots", "spec.prefill.kvCacheMemory"),
        ("decode.kvCacheMemory", "0%", "spec.decode.kvCacheMemory"),
        ("decode.kvCacheMemory", "101%", "spec.decode.kvCacheMemory"),
        ("prefill.kvCacheMemory", "lots%", "spec.prefill.kvCacheMemory"),
        (
            "prefill.autoscaling",
            {"minReplicas": 4, "maxReplicas": 2},
            "spec.prefill.autoscaling.minReplicas",
        ),
        ("decode.autoscaling", {"minReplicas": 2, "maxReplicas": 4}, "spec.decode.replicas"),
    ],
)
def test_errors_name_the_field(path: str, value: object, field: str) -> None:
    with pytest.raises(SpecError, match=f"^{field}: "):
        parse_spec(with_(path, value))


@pytest.mark.parametrize(
    ("interval", "seconds"),
    [("1s", 1.0), ("15s", 15.0), ("1h", 3600.0), ("1ns", None), ("999ms", None), ("1h1s", None)],
)
def test_autoscaling_interval_is_between_a_second_and_an_hour(
    interval: str, seconds: float | None
) -> None:
    # Like the CRD's rule: shorter is a hot loop of Prometheus queries, longer a day-long window.
    spec = with_("autoscaling.interval", interval)
    if seconds is not None:
        assert parse_spec(spec).autoscaling_interval == seconds
        return
    with pytest.raises(SpecError, match="^spec.autoscaling.interval: .* must be between 1s and 1h"):
        parse_spec(spec)


def test_missing_model_and_pools_are_named() -> None:
    with pytest.raises(SpecError, match="^spec.model: is required"):
        parse_spec({"prefill": {}, "decode": {}})
    with pytest.raises(SpecError, match="^spec.decode: is required"):
        parse_spec({"model": BASE["model"], "prefill": {}})
    with pytest.raises(SpecError, match="^spec.model.name: is required"):
        parse_spec(with_("model.name", ""))


def test_builtin_mode_requires_bounds_on_both_pools() -> None:
    spec = with_("autoscaling.mode", "Builtin")
    spec["prefill"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    with pytest.raises(SpecError, match="^spec.decode.autoscaling: is required"):
        parse_spec(spec)
    spec["decode"]["autoscaling"] = {}
    parsed = parse_spec(spec)
    assert parsed.decode.bounds is not None and parsed.decode.bounds.max_replicas == 8


def ratio_spec(ratio: object, mode: str = "Builtin", prefill=(1, 4), decode=(1, 8)) -> dict:
    spec = with_("autoscaling", {"mode": mode, "prefillPerDecode": ratio})
    for name, (low, high) in (("prefill", prefill), ("decode", decode)):
        spec[name] = {"replicas": low, "autoscaling": {"minReplicas": low, "maxReplicas": high}}
    return spec


def test_prefill_per_decode_parses_and_is_checked_like_the_crd() -> None:
    parsed = parse_spec(ratio_spec({"min": 1, "max": 2.5}))
    assert (parsed.prefill_per_decode_min, parsed.prefill_per_decode_max) == (1.0, 2.5)
    assert parse_spec(ratio_spec({"max": 1})).prefill_per_decode_min is None
    unset = parse_spec(with_("autoscaling.mode", "Off"))
    assert (unset.prefill_per_decode_min, unset.prefill_per_decode_max) == (None, None)
    bad = [
        (ratio_spec({"max": 1}, mode="HPA"), "^spec.autoscaling.prefillPerDecode: applies only"),
        (
            ratio_spec({"max": 0}),
            r"^spec.autoscaling.prefillPerDecode.max: 0 must be a finite number greater",
        ),
        (ratio_spec({"min": "1:2"}), r"^spec.autoscaling.prefillPerDecode.min: '1:2' is not a"),
        (ratio_spec({"min": 2, "max": 1}), "^spec.autoscaling.prefillPerDecode: min 2 must not"),
        (
            ratio_spec({"max": 1}, prefill=(4, 8), decode=(1, 2)),
            "^spec.autoscaling.prefillPerDecode.max: 1 cannot hold: spec.prefill.autoscaling."
            "minReplicas 4 needs more than spec.decode.autoscaling.maxReplicas 2",
        ),
        (
            ratio_spec({"min": 0.5}, prefill=(1, 1), decode=(4, 8)),
            "^spec.autoscaling.prefillPerDecode.min: 0.5 cannot hold: spec.decode.autoscaling."
            "minReplicas 4 needs more than spec.prefill.autoscaling.maxReplicas 1",
        ),
    ]
    bad.append(
        (
            ratio_spec({"min": 0.4, "max": 0.4}, prefill=(1, 1), decode=(1, 10)),
            r"^spec.autoscaling.prefillPerDecode: min 0.4 and max 0.4 cannot both hold for any "
            r"whole replica counts within spec.prefill.autoscaling \[1, 1\]",
        )
    )
    for spec, message in bad:
        with pytest.raises(SpecError, match=message):
            parse_spec(spec)


def test_autoscaling_targets_parse_with_defaults_and_name_bad_values() -> None:
    default = parse_spec(BASE).targets
    assert (default.prefill_utilization, default.kv_cache_usage) == (0.7, 0.8)
    assert default.prefill_queue_share == 0.2
    mine = parse_spec(with_("autoscaling.targets", {"kvCacheUsage": 1, "prefillQueueShare": 0}))
    assert (mine.targets.kv_cache_usage, mine.targets.prefill_queue_share) == (1.0, 0.0)
    assert mine.targets.prefill_utilization == 0.7
    for key, value, message in (
        ("prefillUtilization", 0, r"0 must be in \(0, 1\]"),
        ("kvCacheUsage", 1.5, r"1.5 must be in \(0, 1\]"),
        ("prefillQueueShare", -0.1, r"-0.1 must be in \[0, 1\]"),
        ("kvCacheUsage", "80%", "'80%' is not a number"),
    ):
        with pytest.raises(SpecError, match=f"^spec.autoscaling.targets.{key}: {message}"):
            parse_spec(with_("autoscaling.targets", {key: value}))


def test_volume_needs_one_source_and_path_under_mount() -> None:
    with pytest.raises(SpecError, match="^spec.model.volume: "):
        parse_spec(with_("model.volume", {"hostPath": {"path": "/a"}, "nfs": {}}))
    spec = with_("model.volume", {"hostPath": {"path": "/a"}})
    spec["model"]["mountPath"] = "/weights"
    with pytest.raises(SpecError, match="^spec.model.path: .* must lie under"):
        parse_spec(spec)


@pytest.mark.parametrize(
    ("path", "mount_path", "ok"),
    [
        ("/models/m", "/models", True),
        ("/models", "/models", True),  # the volume is the model directory itself
        ("/models/m", "/models/", True),
        ("/opt/m", "/opt/", True),
        ("/models-old/m", "/models", False),  # a string prefix, not a directory prefix
        ("/modelsm", "/models", False),
    ],
)
def test_path_under_mount_is_a_directory_prefix(path: str, mount_path: str, ok: bool) -> None:
    spec = with_("model.volume", {"emptyDir": {}})
    spec["model"].update(path=path, mountPath=mount_path)
    if ok:
        assert parse_spec(spec).model_path == path
    else:
        with pytest.raises(SpecError, match="^spec.model.path: .* must lie under"):
            parse_spec(spec)


def test_router_gets_default_requests_unless_resources_are_set() -> None:
    base: dict[str, Any] = {
        "model": {"name": "m", "path": "/models/m"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
    }
    # Unset: requests, so router pods are not BestEffort (the workers' are the user's call).
    spec = parse_spec(base)
    assert spec.pool("router").resources == {"requests": {"cpu": "250m", "memory": "256Mi"}}
    assert spec.pool("decode").resources == {}
    # Set: taken as written, including an explicit {}.
    own = {"limits": {"cpu": "2"}}
    assert parse_spec({**base, "router": {"resources": own}}).pool("router").resources == own
    assert parse_spec({**base, "router": {"resources": {}}}).pool("router").resources == {}
    # Defaults are copies: one parsed spec's dict cannot change another's.
    spec.pool("router").resources["requests"]["cpu"] = "9"
    assert parse_spec(base).pool("router").resources["requests"]["cpu"] == "250m"


def test_tool_call_and_reasoning_parsers_are_the_routers() -> None:
    # The operator does not import the router; its list of spec.router.toolCallParser values
    # (and the CRD's enum) must still be what the router takes.
    import yaml
    from splitserve_operator.spec import REASONING_PARSERS, TOOL_CALL_PARSERS
    from splitserve_workers.router import reasoning, tool_parsers

    assert TOOL_CALL_PARSERS == ("auto", "none", *tool_parsers.PARSERS)
    crd = yaml.safe_load(
        (
            Path(__file__).parents[2]
            / "operator/splitserve_operator/crd/llmservices.splitserve.io.yaml"
        ).read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    router = schema["properties"]["spec"]["properties"]["router"]["properties"]
    assert tuple(router["toolCallParser"]["enum"]) == TOOL_CALL_PARSERS
    assert REASONING_PARSERS == ("auto", "none", *reasoning.PARSERS)
    assert tuple(router["reasoningParser"]["enum"]) == REASONING_PARSERS


def test_kv_cache_memory_as_a_percentage_is_a_share_not_bytes() -> None:
    pool = parse_spec(with_("decode.kvCacheMemory", "90%")).decode
    assert pool.settings["kvCacheMemoryFraction"] == pytest.approx(0.9)
    assert "kvCacheMemoryBytes" not in pool.settings
    pool = parse_spec(with_("decode.kvCacheMemory", "8Gi")).decode
    assert pool.settings["kvCacheMemoryBytes"] == 8 << 30
    assert "kvCacheMemoryFraction" not in pool.settings
