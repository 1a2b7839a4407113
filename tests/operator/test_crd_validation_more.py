"""More of the LLMService schema against the real API server: what the Deployment would be
refused for later (tolerations, affinity requirements, negative quantities, mount paths that
collide with the pod template's own mounts) is refused at apply time naming the field; the
monitoring interval is one Prometheus accepts; malformed quantities are reported by the pattern,
not as a CEL evaluation error; the router's API key Secret is a valid reference, and the
router Deployment made of it is one the API server takes. Each rule has a valid neighbour that
is accepted, and the tolerations and affinity cases are checked against a Pod too, so the rules
refuse what Kubernetes refuses and no more. Also the chart refusing serviceAccount.create=false
without a name."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_process import CHART, REPO_ROOT
from splitserve_operator.children import desired_children
from splitserve_operator.config import OperatorConfig
from splitserve_operator.podtemplate import MODEL_VOLUME, pod_template
from splitserve_operator.spec import POD_MOUNTS, SpecError, parse_spec

TINY = yaml.safe_load((REPO_ROOT / "manifests" / "examples" / "tiny-cpu.yaml").read_text())
CRD = REPO_ROOT / "operator" / "splitserve_operator" / "crd" / "llmservices.splitserve.io.yaml"
# The pod template's own mounts; the CRD's mountPath rule lists them (checked below).
TEMPLATE_MOUNTS = list(POD_MOUNTS)
NODE_TERMS = (
    "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
)


def merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        # A volume has exactly one source: a patched volume replaces the example's.
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "volume":
            merge(base[key], value)
        else:
            base[key] = value


def llmservice(patch: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(TINY)
    obj["metadata"]["name"] = "probe"
    merge(obj["spec"], patch)
    return obj


def dry_run(cp: Any, namespace: str, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    # kubectl's default --validate=strict; nothing is stored.
    return cp.kubectl(  # type: ignore[no-any-return]
        "create",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=yaml.safe_dump(obj),
        check=False,
    )


def pod_with(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe"},
        "spec": {"containers": [{"name": "c", "image": "x"}], **pod_spec},
    }


def node_requirement(operator: str, values: list[str] | None) -> dict[str, Any]:
    requirement: dict[str, Any] = {"key": "nvidia.com/gpu.product", "operator": operator}
    if values is not None:
        requirement["values"] = values
    return requirement


def node_affinity(requirement: dict[str, Any], where: str = "matchExpressions") -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{where: [requirement]}]
            }
        }
    }


def preferred_node_affinity(requirement: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [requirement]}}
            ]
        }
    }


def pod_anti_affinity(requirement: dict[str, Any]) -> dict[str, Any]:
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchExpressions": [requirement]},
                }
            ]
        }
    }


# (id, pool field, value, the field the error must name, the message)
SCHEDULING_INVALID: list[tuple[str, str, Any, str, str]] = [
    (
        "toleration Exists with a value",
        "tolerations",
        [{"key": "gpu", "operator": "Exists", "value": "a100"}],
        "tolerations[0].value",
        "value must be empty when operator is Exists",
    ),
    (
        "tolerationSeconds with NoSchedule",
        "tolerations",
        [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}],
        "tolerations[0].tolerationSeconds",
        "tolerationSeconds needs effect NoExecute",
    ),
    (
        "tolerationSeconds without an effect",
        "tolerations",
        [{"key": "gpu", "operator": "Exists"}, {"key": "b", "tolerationSeconds": 60}],
        "tolerations[1].tolerationSeconds",
        "tolerationSeconds needs effect NoExecute",
    ),
    (
        "toleration without a key and not Exists",
        "tolerations",
        [{"operator": "Equal", "value": "x"}],
        "tolerations[0].operator",
        "operator must be Exists when key is empty",
    ),
    (
        "node affinity In without values",
        "affinity",
        node_affinity(node_requirement("In", None)),
        f"{NODE_TERMS}[0].matchExpressions[0].values",
        "values must be non-empty when operator is In or NotIn",
    ),
    (
        "node affinity NotIn with empty values",
        "affinity",
        node_affinity(node_requirement("NotIn", [])),
        f"{NODE_TERMS}[0].matchExpressions[0].values",
        "values must be non-empty when operator is In or NotIn",
    ),
    (
        "node affinity Exists with values",
        "affinity",
        node_affinity(node_requirement("Exists", ["a"])),
        f"{NODE_TERMS}[0].matchExpressions[0].values",
        "values must be empty when operator is Exists or DoesNotExist",
    ),
    (
        "preferred node affinity DoesNotExist with values",
        "affinity",
        preferred_node_affinity(node_requirement("DoesNotExist", ["a"])),
        "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
        ".preference.matchExpressions[0].values",
        "values must be empty when operator is Exists or DoesNotExist",
    ),
    (
        "node affinity Gt with two values",
        "affinity",
        node_affinity(node_requirement("Gt", ["1", "2"])),
        f"{NODE_TERMS}[0].matchExpressions[0].values",
        "values must hold exactly one value (an integer) when operator is Gt or Lt",
    ),
    (
        "node affinity Gt without values",
        "affinity",
        node_affinity(node_requirement("Gt", None)),
        f"{NODE_TERMS}[0].matchExpressions[0].values",
        "values must hold exactly one value (an integer) when operator is Gt or Lt",
    ),
    (
        "node affinity matchFields In without values",
        "affinity",
        node_affinity({"key": "metadata.name", "operator": "In"}, where="matchFields"),
        f"{NODE_TERMS}[0].matchFields[0].values",
        "values must be non-empty when operator is In or NotIn",
    ),
    (
        "pod anti-affinity In without values",
        "affinity",
        pod_anti_affinity({"key": "app", "operator": "In"}),
        "affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
        ".labelSelector.matchExpressions[0].values",
        "values must be non-empty when operator is In or NotIn",
    ),
    (
        "pod anti-affinity Exists with values",
        "affinity",
        pod_anti_affinity({"key": "app", "operator": "Exists", "values": ["a"]}),
        "affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
        ".labelSelector.matchExpressions[0].values",
        "values must be empty when operator is Exists or DoesNotExist",
    ),
]

SCHEDULING_VALID: list[tuple[str, str, Any]] = [
    ("toleration Exists without a value", "tolerations", [{"key": "gpu", "operator": "Exists"}]),
    (
        "toleration Exists with an empty value",
        "tolerations",
        [{"key": "g", "operator": "Exists", "value": ""}],
    ),
    (
        "toleration Equal with a value",
        "tolerations",
        [{"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}],
    ),
    ("toleration of every taint", "tolerations", [{"operator": "Exists"}]),
    (
        "tolerationSeconds with NoExecute",
        "tolerations",
        [
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            }
        ],
    ),
    ("node affinity In with values", "affinity", node_affinity(node_requirement("In", ["H100"]))),
    (
        "node affinity Exists without values",
        "affinity",
        node_affinity(node_requirement("Exists", None)),
    ),
    (
        "node affinity DoesNotExist with empty values",
        "affinity",
        node_affinity(node_requirement("DoesNotExist", [])),
    ),
    ("node affinity Gt with one integer", "affinity", node_affinity(node_requirement("Gt", ["3"]))),
    ("node affinity Lt with an integer", "affinity", node_affinity(node_requirement("Lt", ["8"]))),
    # Pods take it (the scheduler then never matches it), so the schema does too.
    ("node affinity Lt with a word", "affinity", node_affinity(node_requirement("Lt", ["eight"]))),
    (
        "matchFields In with a node name",
        "affinity",
        node_affinity(
            {"key": "metadata.name", "operator": "In", "values": ["kwok-node-0"]},
            where="matchFields",
        ),
    ),
    (
        "pod anti-affinity NotIn with values",
        "affinity",
        pod_anti_affinity({"key": "app", "operator": "NotIn", "values": ["a"]}),
    ),
    (
        "pod anti-affinity Exists",
        "affinity",
        pod_anti_affinity({"key": "app", "operator": "Exists"}),
    ),
]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("case", "field", "value", "path", "message"),
    SCHEDULING_INVALID,
    ids=[c[0] for c in SCHEDULING_INVALID],
)
def test_scheduling_fields_pods_refuse_are_refused_naming_the_field(
    control_plane: Any,
    cluster_release: Any,  # installs the CRD
    namespace: str,
    case: str,
    field: str,
    value: Any,
    path: str,
    message: str,
) -> None:
    proc = dry_run(control_plane, namespace, llmservice({"decode": {field: value}}))
    assert proc.returncode != 0, f"{case}: accepted"
    assert f"spec.decode.{path}: Invalid value" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    # A Pod with the same field is refused too: the rule mirrors Kubernetes' own validation.
    pod = dry_run(control_plane, namespace, pod_with({field: value}))
    assert pod.returncode != 0, f"{case}: a Pod takes it, the rule is too strict"


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("case", "field", "value"), SCHEDULING_VALID, ids=[c[0] for c in SCHEDULING_VALID]
)
def test_scheduling_fields_pods_take_are_accepted(
    control_plane: Any, cluster_release: Any, namespace: str, case: str, field: str, value: Any
) -> None:
    pod = dry_run(control_plane, namespace, pod_with({field: value}))
    assert pod.returncode == 0, f"{case}: a Pod refuses it\n{pod.stderr}"
    for pool in ("router", "prefill", "decode"):
        proc = dry_run(control_plane, namespace, llmservice({pool: {field: value}}))
        assert proc.returncode == 0, f"{case} in {pool}\n{proc.stderr}"


# (id, patch, the field named, text the error must contain)
QUANTITY_INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "negative integer cpu request",
        {"decode": {"resources": {"requests": {"cpu": -1}}}},
        "spec.decode.resources.requests.cpu",
        "greater than or equal to 0",
    ),
    (
        "negative integer memory limit",
        {"prefill": {"resources": {"limits": {"memory": -1}}}},
        "spec.prefill.resources.limits.memory",
        "greater than or equal to 0",
    ),
    (
        "negative kvCacheMemory",
        {"decode": {"kvCacheMemory": -1}},
        "spec.decode.kvCacheMemory",
        "greater than or equal to 1",
    ),
    (
        # Passed the pattern, then failed the worker config's own check on every reconcile
        # (no status, no Event).
        "zero kvCacheMemory",
        {"prefill": {"kvCacheMemory": "0"}},
        "spec.prefill.kvCacheMemory",
        "must be a positive quantity such as 64Mi or 8Gi",
    ),
    (
        "kvCacheMemory under one byte",
        {"decode": {"kvCacheMemory": "0.5"}},
        "spec.decode.kvCacheMemory",
        "must be a positive quantity such as 64Mi or 8Gi",
    ),
    (
        "kvCacheMemory of 0%",
        {"decode": {"kvCacheMemory": "0%"}},
        "spec.decode.kvCacheMemory",
        "a percentage must be above 0% and at most 100%",
    ),
    (
        "kvCacheMemory over 100%",
        {"prefill": {"kvCacheMemory": "100.5%"}},
        "spec.prefill.kvCacheMemory",
        "a percentage must be above 0% and at most 100%",
    ),
    (
        "kvCacheMemory as a percentage with a unit",
        {"decode": {"kvCacheMemory": "90Gi%"}},
        "spec.decode.kvCacheMemory",
        "should match",
    ),
    (
        "negative emptyDir sizeLimit",
        {"model": {"volume": {"emptyDir": {"sizeLimit": -1}}}},
        "spec.model.volume.emptyDir.sizeLimit",
        "greater than or equal to 0",
    ),
    (
        # Decided: numbers are refused (x-kubernetes-int-or-string takes integers and strings
        # only); the type error names the field, the field's description says to quote.
        "fractional cpu as a YAML number",
        {"decode": {"resources": {"requests": {"cpu": 0.5}}}},
        "spec.decode.resources.requests.cpu",
        "must be of type integer,string",
    ),
    (
        "memory request in MB",
        {"decode": {"resources": {"requests": {"memory": "512MB"}}}},
        "spec.decode.resources.requests.memory",
        "should match",
    ),
    (
        "malformed memory limit",
        {"decode": {"resources": {"limits": {"memory": "2 Gi"}}}},
        "spec.decode.resources.limits.memory",
        "should match",
    ),
    (
        "malformed GPU request with a limit",
        {
            "decode": {
                "resources": {"requests": {"nvidia.com/gpu": "1x"}, "limits": {"nvidia.com/gpu": 1}}
            }
        },
        "spec.decode.resources.requests.nvidia.com/gpu",
        "should match",
    ),
]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("case", "patch", "field", "text"), QUANTITY_INVALID, ids=[c[0] for c in QUANTITY_INVALID]
)
def test_bad_quantities_are_refused_naming_the_field(
    control_plane: Any,
    cluster_release: Any,
    namespace: str,
    case: str,
    patch: dict[str, Any],
    field: str,
    text: str,
) -> None:
    proc = dry_run(control_plane, namespace, llmservice(patch))
    assert proc.returncode != 0, f"{case}: accepted"
    assert f"{field}: Invalid value" in proc.stderr, proc.stderr
    assert text in proc.stderr, proc.stderr
    # The CEL comparisons skip what is not a quantity instead of failing at run time.
    assert "evaluating rule" not in proc.stderr, proc.stderr
    assert "quantities must match" not in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_quantities_kubernetes_takes_are_accepted(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    proc = dry_run(
        control_plane,
        namespace,
        llmservice(
            {
                "decode": {
                    "kvCacheMemory": 1,  # the smallest (0 is refused above)
                    "resources": {
                        "requests": {"cpu": 0, "memory": "512Mi", "nvidia.com/gpu": 1},
                        "limits": {"cpu": "0.5", "memory": 1073741824, "nvidia.com/gpu": "1"},
                    },
                },
                "prefill": {
                    "kvCacheMemory": "0.5%",  # a share of the memory free after the weights
                    "resources": {"requests": {"cpu": "1.5", "memory": "1G"}},
                },
                "model": {"volume": {"emptyDir": {"sizeLimit": "10Gi"}}},
            }
        ),
    )
    assert proc.returncode == 0, proc.stderr
    for share in ("100%", "100.0%", "90%", "7.5%"):
        proc = dry_run(control_plane, namespace, llmservice({"decode": {"kvCacheMemory": share}}))
        assert proc.returncode == 0, f"{share}\n{proc.stderr}"


def test_crd_mount_rule_lists_every_mount_of_the_pod_template() -> None:
    # The mountPath rule names the template's own mounts; a new mount in podtemplate.py must
    # be added there (and to TEMPLATE_MOUNTS), or a model mounted on it is a duplicate mount.
    spec = parse_spec(TINY["spec"])
    for pool in ("router", "prefill", "decode"):
        template = pod_template(pool, "tiny", spec, "img", "hash")
        (container,) = template["spec"]["containers"]
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] != MODEL_VOLUME]
        assert sorted(mounts) == sorted(TEMPLATE_MOUNTS)
    model = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    mount_path = model["properties"]["spec"]["properties"]["model"]["properties"]["mountPath"]
    rules = " ".join(r["rule"] for r in mount_path["x-kubernetes-validations"])
    for mount in TEMPLATE_MOUNTS:
        assert f"'{mount}/'" in rules


MOUNT_PATHS_INVALID = [
    *TEMPLATE_MOUNTS,
    *(m + "/" for m in TEMPLATE_MOUNTS),
    "/etc/splitserve/models",  # under the read-only config volume: cannot be created
    "/etc",  # above /etc/splitserve: would hide the rest of /etc too
    "/",
    "models",
    "/models/../tmp",
    "/models/..",
    "/./tmp",
    "//tmp",
    "/models//m",
    "/models/.",
]
MOUNT_PATHS_VALID = [
    "/tmp/models",  # nested in the writable /tmp emptyDir: works (installs before had it)
    "/models",
    "/models/",
    "/opt/models",
    "/etc/splitserve-models",
    "/tmpfs",
    "/mnt/tmp",
]


def test_the_operator_refuses_the_same_mount_paths_as_the_crd() -> None:
    # For LLMServices stored before the CRD's rules existed: parse_spec says the same.
    for mount_path in MOUNT_PATHS_INVALID:
        path = mount_path.rstrip("/") + "/m" if mount_path.startswith("/") else "/m"
        spec = {**TINY["spec"], "model": {"name": "m", "mountPath": mount_path, "path": path}}
        with pytest.raises(SpecError, match="spec.model.mountPath"):
            parse_spec(spec)
    for mount_path in MOUNT_PATHS_VALID:
        path = mount_path.rstrip("/") + "/m"
        parse_spec({**TINY["spec"], "model": {"name": "m", "mountPath": mount_path, "path": path}})
    with pytest.raises(SpecError, match="spec.model.path"):
        parse_spec({**TINY["spec"], "model": {"name": "m", "path": "/models/../etc"}})


@pytest.mark.cluster
@pytest.mark.parametrize("mount_path", MOUNT_PATHS_INVALID)
def test_mount_paths_that_collide_or_are_not_canonical_are_refused(
    control_plane: Any, cluster_release: Any, namespace: str, mount_path: str
) -> None:
    path = mount_path.rstrip("/") + "/m" if mount_path.startswith("/") else "/m"
    proc = dry_run(
        control_plane, namespace, llmservice({"model": {"mountPath": mount_path, "path": path}})
    )
    assert proc.returncode != 0, f"{mount_path!r} accepted"
    assert "spec.model.mountPath: Invalid value" in proc.stderr, proc.stderr
    assert "spec.model.mountPath must" in proc.stderr, proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("mount_path", MOUNT_PATHS_VALID)
def test_other_mount_paths_are_accepted(
    control_plane: Any, cluster_release: Any, namespace: str, mount_path: str
) -> None:
    path = mount_path.rstrip("/") + "/m"
    proc = dry_run(
        control_plane, namespace, llmservice({"model": {"mountPath": mount_path, "path": path}})
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/models/../etc/passwd", False),
        ("/models/tiny/..", False),
        ("/models/./tiny", False),
        ("/models/tiny..v2", True),
        ("/models/.cache/tiny", True),
    ],
)
def test_model_path_without_dot_segments(
    control_plane: Any, cluster_release: Any, namespace: str, path: str, ok: bool
) -> None:
    proc = dry_run(control_plane, namespace, llmservice({"model": {"path": path}}))
    if ok:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0, f"{path!r} accepted"
        assert "spec.model.path: Invalid value" in proc.stderr, proc.stderr
        assert "must not contain '.' or '..' segments" in proc.stderr, proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("interval", "ok"),
    [
        ("15s", True),
        ("1m30s", True),
        ("500ms", True),
        ("2h", True),
        ("1.5s", False),  # no fractions in Prometheus durations
        ("500us", False),
        ("30s1m", False),  # units largest first
        ("0s", False),
        ("0", False),
        ("", False),
        ("1d", False),  # Prometheus takes it; the operator's windows read h, m, s, ms only
    ],
)
def test_monitoring_interval_is_a_positive_prometheus_duration(
    control_plane: Any, cluster_release: Any, namespace: str, interval: str, ok: bool
) -> None:
    proc = dry_run(control_plane, namespace, llmservice({"monitoring": {"interval": interval}}))
    if ok:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0, f"{interval!r} accepted"
        assert "spec.monitoring.interval: Invalid value" in proc.stderr, proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("interval", "ok"),
    [("1s", True), ("1m30s", True), ("1h", True), ("999ms", False), ("1ns", False),
     ("61m", False), ("24h", False)],
)  # fmt: skip
def test_autoscaling_interval_is_between_a_second_and_an_hour(
    control_plane: Any, cluster_release: Any, namespace: str, interval: str, ok: bool
) -> None:
    patch = {"autoscaling": {"interval": interval}}
    proc = dry_run(control_plane, namespace, llmservice(patch))
    if ok:
        assert proc.returncode == 0, proc.stderr
        parse_spec(llmservice(patch)["spec"])  # the operator agrees
    else:
        assert proc.returncode != 0, f"{interval!r} accepted"
        assert "spec.autoscaling.interval: Invalid value" in proc.stderr, proc.stderr
        assert "spec.autoscaling.interval must be between 1s and 1h" in proc.stderr, proc.stderr
        with pytest.raises(SpecError, match="^spec.autoscaling.interval: "):
            parse_spec(llmservice(patch)["spec"])


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("secret", "refused"),
    [
        ({"name": "router-keys"}, None),
        ({"name": "router-keys", "key": "keys.txt"}, None),
        ({}, "spec.router.apiKeySecret.name: Required value"),
        ({"name": "Router_Keys"}, "spec.router.apiKeySecret.name: Invalid value"),
        ({"name": "keys", "key": "a/b"}, "spec.router.apiKeySecret.key: Invalid value"),
    ],
    ids=["name", "name-and-key", "no-name", "bad-name", "bad-key"],
)
def test_api_key_secret_is_a_secret_reference(
    control_plane: Any, cluster_release: Any, namespace: str, secret: dict, refused: str | None
) -> None:
    obj = llmservice({"router": {"apiKeySecret": secret}})
    proc = dry_run(control_plane, namespace, obj)
    if refused is None:
        assert proc.returncode == 0, proc.stderr
        # The router Deployment the operator makes of it passes the API server's validation
        # (the projected config volume with the Secret's key file in it).
        children = desired_children(
            "probe", namespace, "uid-1", parse_spec(obj["spec"]), OperatorConfig(), False
        )
        (router,) = [
            c
            for c in children
            if (c["kind"], c["metadata"]["name"]) == ("Deployment", "probe-router")
        ]
        proc = dry_run(control_plane, namespace, router)
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0, f"{secret!r} accepted"
        assert refused in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_log_requests_is_a_boolean(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    assert (
        dry_run(control_plane, namespace, llmservice({"router": {"logRequests": True}})).returncode
        == 0
    )
    proc = dry_run(control_plane, namespace, llmservice({"router": {"logRequests": "yes"}}))
    assert proc.returncode != 0 and "spec.router.logRequests: Invalid value" in proc.stderr, (
        proc.stderr
    )


@pytest.mark.cluster
def test_tool_call_and_reasoning_parsers_are_ones_the_router_knows(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    ok = llmservice({"router": {"toolCallParser": "llama3_json", "reasoningParser": "qwen3"}})
    assert dry_run(control_plane, namespace, ok).returncode == 0
    for field in ("toolCallParser", "reasoningParser"):
        proc = dry_run(control_plane, namespace, llmservice({"router": {field: "xml"}}))
        assert proc.returncode != 0, field
        assert f"spec.router.{field}: Unsupported value" in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_router_timeouts_are_durations_within_bounds(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    ok = llmservice({"router": {"admissionTimeout": "1m", "writeTimeout": "0s"}})
    assert dry_run(control_plane, namespace, ok).returncode == 0
    for field, value, message in (
        ("admissionTimeout", "0s", "must be between 1s and 1h"),
        ("admissionTimeout", "2h", "must be between 1s and 1h"),
        ("writeTimeout", "500ms", "must be 0s (never) or between 1s and 1h"),
        ("writeTimeout", "soon", "should match"),
    ):
        proc = dry_run(control_plane, namespace, llmservice({"router": {field: value}}))
        assert proc.returncode != 0, (field, value)
        assert f"spec.router.{field}: " in proc.stderr, proc.stderr
        assert message in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_alert_for_is_a_prometheus_duration(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    ok = llmservice({"monitoring": {"alerts": {"enabled": True, "for": "1h30m"}}})
    assert dry_run(control_plane, namespace, ok).returncode == 0
    for value, message in (("1.5m", "should match"), ("0m", "must be a positive duration")):
        proc = dry_run(
            control_plane, namespace, llmservice({"monitoring": {"alerts": {"for": value}}})
        )
        assert proc.returncode != 0, value
        assert "spec.monitoring.alerts.for: " in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_replica_bounds_are_reported_once_each(
    control_plane: Any, cluster_release: Any, namespace: str
) -> None:
    auto = {"mode": "Builtin"}
    outside = {"prefill": {"replicas": 5, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}}
    proc = dry_run(control_plane, namespace, llmservice({"autoscaling": auto, **outside}))
    assert proc.returncode != 0
    assert "spec.prefill: Invalid value" in proc.stderr, proc.stderr
    assert "change replicas in the same edit" in proc.stderr, proc.stderr
    # Inconsistent bounds are reported alone, not also as replicas outside them.
    crossed = {"decode": {"replicas": 2, "autoscaling": {"minReplicas": 4, "maxReplicas": 3}}}
    proc = dry_run(control_plane, namespace, llmservice({"autoscaling": auto, **crossed}))
    assert proc.returncode != 0
    assert "autoscaling.minReplicas must be <= autoscaling.maxReplicas" in proc.stderr
    assert "replicas must lie within" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def helm() -> Path:
    import plane  # hack/testplane, on sys.path through tests/conftest.py

    return plane.build() / "helm"  # type: ignore[no-any-return]


def test_chart_needs_a_service_account_name_when_it_creates_none(helm: Path) -> None:
    for sets in (
        ["serviceAccount.create=false"],
        ["serviceAccount.create=false", "serviceAccount.name="],
    ):
        args = [a for s in sets for a in ("--set", s)]
        proc = subprocess.run(
            [str(helm), "template", "rel", str(CHART), "-n", "ops", *args],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode != 0, proc.stdout
        assert "serviceAccount.name is required when serviceAccount.create is false" in proc.stderr
    proc = subprocess.run(
        [
            str(helm),
            "template",
            "rel",
            str(CHART),
            "-n",
            "ops",
            "--set",
            "serviceAccount.create=false",
            "--set",
            "serviceAccount.name=splitserve-ops",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "splitserve-ops"
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings
    for binding in bindings:
        assert [s["name"] for s in binding["subjects"]] == ["splitserve-ops"], json.dumps(binding)
