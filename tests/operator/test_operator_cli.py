"""`splitserve operator` with an out-of-range flag exits 2 naming it, before kopf or the
Kubernetes client start, and without cluster credentials exits 1 with one line (no cluster
needed)."""

from __future__ import annotations

from typing import Any

import pytest
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
