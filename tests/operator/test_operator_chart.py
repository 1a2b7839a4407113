"""The Helm chart rendered by the real helm binary: lint, the main value combinations, RBAC
without wildcards that still covers every kind the operator writes, the CRD copies, and
manifests/ kept equal to the chart's output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_process import CHART, REPO_ROOT
from splitserve_operator.kube import PLURALS

sys.path.insert(0, str(REPO_ROOT / "hack" / "testplane"))
import plane  # noqa: E402

RELEASE_NS = "splitserve-system"
MANIFEST_ARGS = ["splitserve", str(CHART), "-n", RELEASE_NS, "--set", "watch.allNamespaces=true"]
REGENERATE = (
    "helm template splitserve charts/splitserve -n splitserve-system "
    "--set watch.allNamespaces=true > manifests/operator.yaml"
)


@pytest.fixture(scope="session")
def helm() -> Path:
    return plane.build() / "helm"


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, check=check)


def render(helm: Path, *sets: str, namespace: str = RELEASE_NS) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    out = run_helm(helm, "template", "rel", str(CHART), "-n", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = by_kind(docs, "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]


def test_helm_lint_strict(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--set", "watch.allNamespaces=true",
                    "--set", "grafanaDashboard.enabled=true", check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_is_namespaced_to_the_release_namespace(helm: Path) -> None:
    docs = render(helm)
    args = operator_args(docs)
    assert f"--namespace={RELEASE_NS}" in args and "--all-namespaces" not in args
    assert "--peering=splitserve" in args and "--standalone" not in args
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    assert "--worker-image=splitserve/worker:dev" in args
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == RELEASE_NS
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == "rel-splitserve"
    (cluster_role,) = by_kind(docs, "ClusterRole")
    # Cluster-wide only reads of CRDs and namespaces (kopf's discovery); nothing else.
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {
        "customresourcedefinitions", "namespaces"}  # fmt: skip
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    (peering,) = by_kind(docs, "KopfPeering")
    assert peering["metadata"] == {**peering["metadata"], "name": "splitserve",
                                   "namespace": RELEASE_NS}  # fmt: skip
    assert not by_kind(docs, "ClusterKopfPeering")
    (sa,) = by_kind(docs, "ServiceAccount")
    assert sa["metadata"]["name"] == "rel-splitserve"


def test_listed_namespaces_get_a_role_and_peering_each(helm: Path) -> None:
    docs = render(helm, "watch.namespaces={team-a,team-b}")
    assert [a for a in operator_args(docs) if a.startswith("--namespace")] == [
        "--namespace=team-a", "--namespace=team-b"]  # fmt: skip
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == [
        "team-a", "team-b"]  # fmt: skip
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == [
        "team-a", "team-b"]  # fmt: skip


def test_all_namespaces_uses_cluster_scoped_rbac_and_peering(helm: Path) -> None:
    docs = render(helm, "watch.allNamespaces=true")
    assert "--all-namespaces" in operator_args(docs)
    assert not by_kind(docs, "Role") and not by_kind(docs, "KopfPeering")
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "splitserve"
    (role,) = by_kind(docs, "ClusterRole")
    resources = {res for r in role["rules"] for res in r["resources"]}
    assert {"llmservices", "namespaces", "clusterkopfpeerings", "deployments"} <= resources


def test_peering_off_runs_standalone(helm: Path) -> None:
    docs = render(helm, "peering.enabled=false")
    assert "--standalone" in operator_args(docs)
    assert not by_kind(docs, "KopfPeering") and not by_kind(docs, "ClusterKopfPeering")


@pytest.mark.parametrize("sets", [(), ("watch.allNamespaces=true",)])
def test_rbac_has_no_wildcards_and_covers_what_the_operator_writes(
    helm: Path, sets: tuple[str, ...]
) -> None:
    docs = render(helm, *sets)
    rules = [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "*" not in rule["apiGroups"]

    def allowed(group: str, resource: str) -> set[str]:
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"]
                for v in r["verbs"]}  # fmt: skip

    for (api_version, _kind), plural in PLURALS.items():
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        verbs = allowed(group, plural)
        needed = {
            "llmservices": {"get", "patch"},
            "pods": {"patch"},  # annotated, never made: pods belong to the ReplicaSets
        }.get(plural, {"get", "create", "patch"})
        assert needed <= verbs, f"{group}/{plural}: has {sorted(verbs)}"
    assert {"list", "watch"} <= allowed("splitserve.io", "llmservices")
    assert {"list", "watch"} <= allowed("apps", "deployments")  # the status watch
    assert {"list", "watch"} <= allowed("", "services")  # a deleted Service comes back at once
    # list: why a pool's pods are not running; patch: pod-deletion-cost before a scale-down.
    # Never create, update or delete: pods belong to the ReplicaSets.
    assert allowed("", "pods") == {"list", "patch"}
    assert allowed("splitserve.io", "llmservices/status") == {"patch"}  # read via the object
    assert allowed("", "events") == {"create"}
    assert not allowed("events.k8s.io", "events")  # kopf posts core/v1 Events only
    # What the operator deletes: HPAs and ScaledObjects it made, when an LLMService leaves
    # mode HPA or KEDA, its monitors and alert rule, when an LLMService sets monitoring.enabled
    # (or monitoring.alerts.enabled) false, and
    # superseded config versions no pod mounts (the garbage collector removes every other
    # child with its owner). Which versions a rollout still needs: its ReplicaSets, read only.
    assert allowed("apps", "replicasets") == {"list"}
    deletable = {(g, res) for r in rules if "delete" in r["verbs"]
                 for g in r["apiGroups"] for res in r["resources"]}  # fmt: skip
    assert deletable == {
        ("", "configmaps"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("keda.sh", "scaledobjects"),
        ("monitoring.coreos.com", "servicemonitors"),
        ("monitoring.coreos.com", "podmonitors"),
        ("monitoring.coreos.com", "prometheusrules"),
    }
    assert {"list", "watch", "delete"} <= allowed("autoscaling", "horizontalpodautoscalers")


def test_operator_pod_is_hardened(helm: Path) -> None:
    (dep,) = by_kind(render(helm), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]


def test_optional_dashboard_and_scrape_config(helm: Path) -> None:
    assert not by_kind(render(helm), "ConfigMap")
    docs = render(helm, "grafanaDashboard.enabled=true", "prometheusScrapeConfig.enabled=true")
    maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    dashboard = maps["rel-splitserve-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["splitserve.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "splitserve_time_to_first_token_seconds_bucket" in exprs
    assert "splitserve_time_per_output_token_seconds_bucket" in exprs
    scrape = yaml.safe_load(maps["rel-splitserve-scrape-config"]["data"]["scrape-config.yaml"])
    assert scrape["scrape_configs"][0]["job_name"] == "splitserve"


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("watch.everything=true", "everything"),
        ("replicaCount=-1", "replicaCount"),
        ("monitoring=always", "monitoring"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("peering.enabled=false,replicaCount=2", "/replicaCount': maximum"),
        ("watch.allNamespaces=true,watch.namespaces={team-a}", "/watch/namespaces': maxItems"),
    ],
)
def test_values_schema_rejects_bad_values(helm: Path, value: str, complaint: str) -> None:
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0
    assert complaint in proc.stderr


def test_chart_crds_are_the_source_of_truth(helm: Path) -> None:
    out = run_helm(helm, "show", "crds", str(CHART)).stdout
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(out) if d}
    assert names == {"llmservices.splitserve.io", "kopfpeerings.kopf.dev",
                     "clusterkopfpeerings.kopf.dev"}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO_ROOT / "hack" / "sync-crd.sh"), "--check"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_manifests_match_the_chart_and_build_with_kustomize(helm: Path) -> None:
    rendered = run_helm(helm, "template", *MANIFEST_ARGS).stdout
    committed = (REPO_ROOT / "manifests" / "operator.yaml").read_text()
    assert committed == rendered, f"manifests/operator.yaml is stale; run: {REGENERATE}"
    kubectl = helm.parent / "kubectl"
    out = subprocess.run([str(kubectl), "kustomize", str(REPO_ROOT / "manifests")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    kinds = sorted({d["kind"] for d in yaml.safe_load_all(out) if d})
    assert kinds == sorted(["CustomResourceDefinition", "Namespace", "ServiceAccount",
                            "ClusterRole", "ClusterRoleBinding", "Deployment",
                            "ClusterKopfPeering"])  # fmt: skip
    crd = next(d for d in yaml.safe_load_all(out)
               if d and d["metadata"]["name"] == "llmservices.splitserve.io")  # fmt: skip
    source = yaml.safe_load((REPO_ROOT / "operator" / "splitserve_operator" / "crd" /
                             "llmservices.splitserve.io.yaml").read_text())  # fmt: skip
    assert crd["spec"] == source["spec"]  # anchors expanded identically


def test_names_that_yaml_reads_as_booleans_stay_strings(helm: Path) -> None:
    # Release, namespace and peering names are DNS labels, and `on`, `yes`, `no` and `off` are
    # valid ones; unquoted they render as YAML booleans and the API server refuses the object.
    out = run_helm(helm, "template", "on", str(CHART), "-n", "yes",
                   "--set", "watch.namespaces={no,off}", "--set", "peering.name=on",
                   "--set", "serviceAccount.name=yes", "--set", "grafanaDashboard.enabled=true",
                   "--set", "prometheusScrapeConfig.enabled=true").stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    for doc in docs:
        meta = doc["metadata"]
        assert isinstance(meta["name"], str), meta
        assert isinstance(meta.get("namespace", ""), str), meta
        assert all(isinstance(v, str) for v in meta.get("labels", {}).values()), meta
        for subject in doc.get("subjects", []):
            assert isinstance(subject["name"], str) and isinstance(subject["namespace"], str)
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "yes"
    assert {d["metadata"]["namespace"] for d in by_kind(docs, "KopfPeering")} == {"no", "off"}


def test_operator_image_installs_the_dependency_floors_of_pyproject() -> None:
    # The operator image installs its few dependencies by hand (no torch); their floors must be
    # the package's own, or the image can get a kopf without the features the operator uses.
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {m[1]: m[2] for d in deps if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)(>=.+)", d))}
    dockerfile = (REPO_ROOT / "Dockerfile.operator").read_text()
    installed = re.findall(r'"([A-Za-z0-9_.-]+)(>=[^"]+)"', dockerfile)
    assert {name for name, _ in installed} >= {"kopf", "kubernetes"}
    for name, floor in installed:
        assert floors.get(name) == floor, (name, floor, floors.get(name))
