"""`splitserve router` with bad input exits 2 before binding or loading, naming the field, like
the workers do."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_workers.cli import main


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--port", "70000"], "port"),
        (["--max-request-bytes", "0"], "max_request_bytes"),
        (["--max-request-bytes", "-5"], "max_request_bytes"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--poll-interval", "0"], "poll_interval"),
        (["--admission-timeout", "-1"], "admission_timeout"),
        (["--drain-timeout", "-1"], "drain_timeout"),
    ],
)
def test_out_of_range_flag_exits_2_naming_the_field(
    flags: list[str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["router", "--model", str(tmp_path), "--prefill", "p:1", "--decode", "d:1", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve router: {field}: "), err


def test_missing_model_and_bad_endpoint_and_config_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["router", "--model", str(tmp_path), "--prefill", "p:1", "--decode", "d:1"]) == 2
    assert "model.path: " in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["router", "--model", str(tmp_path), "--prefill", "p", "--decode", "d:1"]) == 2
    assert "endpoint 'p' is not host:port" in capsys.readouterr().err
    config = tmp_path / "serving.yaml"
    config.write_text("router:\n  max_request_bytes: 0\n")
    assert main(["router", "--model", str(tmp_path), "--config", str(config)]) == 2
    assert "router.max_request_bytes: 0" in capsys.readouterr().err
