"""The LLMService schema documents itself: every spec and status field has a description, so
`kubectl explain llmservices.spec --recursive` and `kubectl explain llmservices.status` read
without `<no description>`; and status declares what the operator writes there (and nothing it
does not). Pure: reads the CRD YAML and the operator's code, no cluster."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from splitserve_operator.spec import POOLS, parse_spec
from splitserve_operator.status import compute_status, invalid_status

REPO_ROOT = Path(__file__).resolve().parents[2]
OPERATOR = REPO_ROOT / "operator" / "splitserve_operator"
CRD = OPERATOR / "crd" / "llmservices.splitserve.io.yaml"

# Subtrees passed to the pods as-is from Kubernetes types, whose innards are left undocumented
# here: a pool's affinity is a Pod's spec.affinity, and `kubectl explain pod.spec.affinity`
# documents its (many, deeply nested) fields. The nodes themselves are described; only what
# lies below them is exempt.
UNDOCUMENTED_SUBTREES = frozenset(
    f"spec.{pool}.affinity.{kind}"
    for pool in POOLS
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity")
)


def schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    root: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return root


def fields(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of every field below node: properties by name, map values as `path.*`;
    array items are walked through (`path[]`) but are no field of their own."""
    for name, sub in (node.get("properties") or {}).items():
        yield f"{path}.{name}", sub
    if isinstance(node.get("additionalProperties"), dict):
        yield f"{path}.*", node["additionalProperties"]
    if isinstance(node.get("items"), dict):
        yield from fields(node["items"], f"{path}[]")


def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for sub_path, sub in fields(node, path):
        yield sub_path, sub
        if sub_path not in UNDOCUMENTED_SUBTREES:
            yield from walk(sub, sub_path)


@pytest.mark.parametrize("top", ["spec", "status"])
def test_every_field_has_a_description(top: str) -> None:
    node = schema()["properties"][top]
    assert str(node.get("description") or "").strip(), top
    seen = dict(walk(node, top))
    missing = [path for path, sub in seen.items() if not str(sub.get("description") or "").strip()]
    assert not missing, "fields without a description:\n" + "\n".join(missing)
    # The walk really went deep (anchored pool fields, map values, array items).
    assert len(seen) > (60 if top == "spec" else 20)


def test_exempt_subtrees_exist_and_are_described_themselves() -> None:
    found = {path: sub for path, sub in walk(schema()["properties"]["spec"], "spec")}
    for path in sorted(UNDOCUMENTED_SUBTREES):
        assert path in found, f"{path} is exempt but not in the schema"
        assert str(found[path].get("description") or "").strip(), path


def test_quantities_say_they_are_quantities() -> None:
    """kubectl explain labels an int-or-string field <Object> (CRD schemas have no type for it),
    so the description says what it takes."""
    spec = schema()["properties"]["spec"]
    for path, sub in walk(spec, "spec"):
        if sub.get("x-kubernetes-int-or-string"):
            assert "quantity" in sub["description"], path


def test_status_declares_autoscaler_not_slo() -> None:
    status = schema()["properties"]["status"]
    # kopf (and any other writer) must not be pruned.
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    props = status["properties"]
    assert "slo" not in props  # nothing writes status.slo
    autoscaler = props["autoscaler"]
    assert autoscaler["type"] == "object"
    assert autoscaler["x-kubernetes-preserve-unknown-fields"] is True
    for key in ("state", "message", "metricsSource", "lastDecision", "lastScaleTime"):
        assert key in autoscaler["description"], key


def written_by_compute_status() -> set[str]:
    """Top-level status keys compute_status and invalid_status produce, in every mode."""
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "replicas": 1,
            "readyReplicas": 1,
            "updatedReplicas": 1,
            "observedGeneration": 1,
        },
    }
    keys: set[str] = set(invalid_status("bad", 1, None, "2025-01-01T00:00:00Z"))
    for mode in ("Off", "Builtin", "HPA", "KEDA"):
        spec = parse_spec(
            {
                "model": {"name": "m", "path": "/models/m"},
                "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
                "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
                "autoscaling": {"mode": mode},
            }
        )
        status = compute_status(
            service="chat",
            namespace="ns",
            spec=spec,
            generation=1,
            observed_generation=1,
            deployments=dict.fromkeys(POOLS, deployment),
            previous_conditions=None,
            now="2025-01-01T00:00:00Z",
            # What the built-in autoscaler left: removed (written as null) outside Builtin.
            autoscaler={"state": "Active", "message": ""},
        )
        keys |= set(status)
    return keys


def written_by_patch_status() -> set[str]:
    """Top-level keys of every dict literal the operator's code passes to kube.patch_status
    (scaling.py writes status.autoscaler that way)."""
    keys: set[str] = set()
    for source in sorted(OPERATOR.glob("*.py")):
        for call in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "patch_status"
                and len(call.args) >= 2
                and isinstance(call.args[1], ast.Dict)
            ):
                keys |= {k.value for k in call.args[1].keys if isinstance(k, ast.Constant)}
    return keys


def test_every_status_key_the_operator_writes_is_declared() -> None:
    declared = set(schema()["properties"]["status"]["properties"])
    from_status = written_by_compute_status()
    from_patches = written_by_patch_status()
    assert {"observedGeneration", "endpoint", "conditions", *POOLS} <= from_status
    assert "autoscaler" in from_status  # the removal outside mode Builtin
    assert "autoscaler" in from_patches  # scaling.py's report
    written = from_status | from_patches
    assert written <= declared, f"written, not declared: {sorted(written - declared)}"
    # And nothing declared that nobody writes (status.slo was such a field).
    assert declared <= written, f"declared, never written: {sorted(declared - written)}"
