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
        (["--empty-pool-wait", "-1"], "empty_pool_wait"),
        (["--drain-timeout", "-1"], "drain_timeout"),
        (["--write-timeout", "-1"], "write_timeout"),
        # NaN compares false with everything: it used to pass `value < minimum` and start.
        (["--poll-interval", "nan"], "poll_interval"),
        (["--admission-timeout", "nan"], "admission_timeout"),
        (["--drain-timeout", "nan"], "drain_timeout"),
        (["--write-timeout", "nan"], "write_timeout"),
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
    config.write_text("router:\n  write_timeout_seconds: -1\n")
    assert main(["router", "--model", str(tmp_path), "--config", str(config)]) == 2
    assert "router.write_timeout_seconds: -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "workers file {path}: No such file or directory"),
        ("{not json", "workers file {path}: not JSON"),
        ('["a:1"]', "workers file {path}: must be an object"),
        ('{"prefil": ["a:1"]}', "workers file {path}: unknown role 'prefil'"),
        ('{"decode": "a:1"}', "workers file {path}: decode must be a list of host:port strings"),
        ('{"decode": ["a"]}', "workers file {path}: decode: endpoint 'a' is not host:port"),
    ],
    ids=["missing", "not-json", "not-object", "unknown-role", "not-list", "bad-endpoint"],
)
def test_bad_workers_file_exits_2_naming_it(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "workers.json"
    if content is not None:
        path.write_text(content)
    assert main(["router", "--model", str(tmp_path), "--workers-file", str(path)]) == 2
    assert f"splitserve router: {message.format(path=path)}" in capsys.readouterr().err


def test_workers_file_and_endpoint_flags_are_exclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "workers.json"
    path.write_text('{"prefill": ["a:1"], "decode": ["b:1"]}')
    args = ["router", "--model", str(tmp_path), "--workers-file", str(path), "--decode", "b:1"]
    assert main(args) == 2
    assert "workers_file: use --workers-file or --decode, not both" in capsys.readouterr().err


def test_timeouts_come_from_the_config_unless_a_flag_is_given(
    tiny_model: Path, tmp_path: Path
) -> None:
    # The operator writes them into the router's config (spec.router.admissionTimeout and
    # writeTimeout); a flag, 0 included, still wins.
    import argparse

    from splitserve_workers.router.app import add_arguments, options_from_args

    config = tmp_path / "serving.yaml"
    config.write_text("router:\n  admission_timeout_seconds: 7.5\n  write_timeout_seconds: 0\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(tiny_model), "--prefill", "p:1", "--decode", "d:1"]
    options, _ = options_from_args(parser.parse_args([*base, "--config", str(config)]))
    assert options.flow.admission_timeout_seconds == 7.5
    assert options.write_timeout == 0
    flags = ["--admission-timeout", "0", "--write-timeout", "3"]
    options, _ = options_from_args(parser.parse_args([*base, "--config", str(config), *flags]))
    assert (options.flow.admission_timeout_seconds, options.write_timeout) == (0, 3)
    options, _ = options_from_args(parser.parse_args(base))
    assert (options.flow.admission_timeout_seconds, options.write_timeout) == (30, 60)
