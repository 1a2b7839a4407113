"""`splitserve operator` with an out-of-range flag exits 2 naming it, before kopf or the
Kubernetes client start, and without cluster credentials exits 1 with one line; the kopf
settings it builds (no cluster needed)."""

from __future__ import annotations

import argparse
from typing import Any

import kopf
import pytest
from splitserve_operator import GROUP, cli
from splitserve_operator.names import MANAGED_BY
from splitserve_workers.cli import main


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--resync-seconds", "0"], "resync_seconds"),
        (["--resync-seconds", "-5"], "resync_seconds"),
        (["--workers", "0"], "workers"),
        (["--liveness", "https://0.0.0.0:8080/healthz"], "liveness"),
        (["--liveness", "0.0.0.0:8080"], "liveness"),
        (["--liveness", "http://0.0.0.0:99999/healthz"], "liveness"),
    ],
)
def test_out_of_range_flag_exits_2_naming_the_field(
    flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["operator", "--all-namespaces", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve operator: {field}: "), err


def test_no_credentials_is_one_line_not_a_traceback(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Outside a pod (no service-account env) and with a kubeconfig path that does not exist.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["operator", "--all-namespaces"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("splitserve operator: no cluster credentials: "), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_children_watches_are_filtered_by_the_api_server() -> None:
    # kopf passes these as labelSelector on its list and watch calls: the API server sends only
    # our Deployments and Services, not every one in the watched namespaces. (The cluster tests
    # show the filtered watches still see every child: status and repairs depend on them.)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    settings = cli.settings_for(parser.parse_args(["--all-namespaces"]))

    def selectors(group: str, plural: str) -> list[str]:
        resource = kopf.Resource(group, "v1", plural)
        return list(settings.watching.label_selectors.collect(resource))

    ours = [f"app.kubernetes.io/managed-by={MANAGED_BY}"]
    assert selectors("apps", "deployments") == ours
    assert selectors("", "services") == ours
    # Nothing else is narrowed: LLMServices and pods are read whatever their labels.
    assert selectors("", "pods") == [] and selectors(GROUP, "llmservices") == []


def test_a_deletion_waits_for_a_running_resync_seconds_not_a_minute() -> None:
    # kopf re-checks a timer still running at an LLMService's deletion (its finalizer stays
    # until then) after this long; its default, 60 s, held such deletions for a minute.
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    settings = cli.settings_for(parser.parse_args(["--all-namespaces"]))
    assert settings.background.cancellation_polling <= 2
