"""The CRD upgrade docs/operator.md tells Helm users to run, against CRDs as Helm leaves them:
`helm install` writes the chart's crds/ with an update by field manager "helm", so a
server-side apply of a changed schema conflicts with it on .spec.versions unless it forces."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD = REPO_ROOT / "charts" / "splitserve" / "crds" / "llmservices.splitserve.io.yaml"


def documented_crd_upgrade() -> list[str]:
    """The kubectl command of the docs' **Upgrading:** block, its -f paths made absolute."""
    docs = (REPO_ROOT / "docs" / "operator.md").read_text()
    block = re.search(r"\*\*Upgrading:\*\*.*?```sh\n(.*?)```", docs, re.S)
    assert block, "docs/operator.md has no **Upgrading:** command block"
    (line,) = [ln for ln in block.group(1).splitlines() if ln.startswith("kubectl apply")]
    args = shlex.split(line, comments=True)[1:]
    return [str(REPO_ROOT / a) if a.endswith("/") else a for a in args]


def test_documented_crd_upgrade_applies_over_crds_helm_installed(control_plane: Any) -> None:
    cp = control_plane
    older = yaml.safe_load(CRD.read_text())
    schema = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    current = copy.deepcopy(schema)
    schema["description"] = "the schema of an older chart"
    # What `helm install` leaves: the CRD written by an update of field manager "helm".
    exists = cp.kubectl("get", "crd", older["metadata"]["name"], check=False).returncode == 0
    verb = "replace" if exists else "create"
    cp.kubectl(verb, "--field-manager=helm", "-f", "-", input=yaml.safe_dump(older))

    proc = cp.kubectl(*documented_crd_upgrade(), check=False)
    assert proc.returncode == 0, proc.stderr
    live = yaml.safe_load(cp.kubectl("get", "crd", older["metadata"]["name"], "-o", "yaml").stdout)
    assert live["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == current
