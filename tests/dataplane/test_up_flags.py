"""`splitserve up` with bad input exits 2 naming the flag before it starts any process; an unknown
flag on any subcommand answers with that subcommand's usage."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_workers.cli import main


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--port", "70000"], "--port"),
        (["--stats-interval", "0"], "--stats-interval"),
        (["--max-restarts", "-1"], "--max-restarts: -1 must be >= 0"),
        (["--liveness-timeout", "-1"], "--liveness-timeout: -1.0 must be >= 0"),
        (["--liveness-timeout", "nan"], "--liveness-timeout: nan must be >= 0"),
        (["--colocated", "0"], "--colocated"),
        (["--colocated", "1", "--prefill", "1"], "use --colocated"),
        (["--prefill", "0"], "--prefill/--decode"),
        (["--decode", "-1"], "--prefill/--decode"),
        (["--max-decode", "3"], "--max-decode needs --autoscale"),
        (["--autoscale", "--colocated", "1"], "--autoscale sizes prefill and decode pools"),
        (["--autoscale", "--min-prefill", "-1"], "--min-prefill: -1 must be >= 0"),
        (["--autoscale", "--min-decode", "3", "--max-decode", "2"], "--max-decode: 2 is below"),
        (["--autoscale", "--decode", "5"], "--decode: 5 workers is outside [1, 4]"),
        (["--autoscale", "--slo-tpot", "fast"], "--slo-tpot: 'fast' is not a duration"),
        (["--autoscale", "--slo-ttft", "0ms"], "--slo-ttft: '0ms' must be positive"),
        (["--autoscale", "--slo-percentile", "100"], "--slo-percentile: 100.0 must be in"),
        (["--autoscale", "--scale-interval", "0"], "--scale-interval: 0.0 must be positive"),
        (["--autoscale", "--scale-down-stabilization", "-1"], "--scale-down-stabilization"),
        (["--max-prefill-per-decode", "1"], "--max-prefill-per-decode needs --autoscale"),
        (["--target-kv-usage", "0.5"], "--target-kv-usage needs --autoscale"),
        (["--autoscale", "--target-utilization", "0"], "--target-utilization: 0 must be in (0, 1]"),
        (["--autoscale", "--target-kv-usage", "1.5"], "--target-kv-usage: 1.5 must be in (0, 1]"),
        (["--autoscale", "--target-queue-share", "-1"], "--target-queue-share: -1 must be in"),
        (["--autoscale", "--min-prefill-per-decode", "0"], "--min-prefill-per-decode: 0 must"),
        (["--autoscale", "--max-prefill-per-decode", "inf"], "--max-prefill-per-decode: inf must"),
        (
            [
                "--autoscale",
                "--max-prefill",
                "1",
                "--min-prefill-per-decode",
                "0.4",
                "--max-prefill-per-decode",
                "0.4",
            ],
            "--min-prefill-per-decode 0.4 and --max-prefill-per-decode 0.4 cannot both hold",
        ),  # fmt: skip
        (
            ["--autoscale", "--min-prefill-per-decode", "2", "--max-prefill-per-decode", "1"],
            "--min-prefill-per-decode: 2 is above --max-prefill-per-decode 1",
        ),
        (
            [
                "--autoscale",
                "--min-prefill",
                "3",
                "--prefill",
                "3",
                "--max-prefill-per-decode",
                "0.5",
            ],
            "--max-prefill-per-decode: 0.5 cannot hold: --min-prefill 3 needs more than "
            "--max-decode 4",
        ),  # fmt: skip
        (
            [
                "--autoscale",
                "--max-prefill",
                "1",
                "--min-decode",
                "3",
                "--decode",
                "3",
                "--min-prefill-per-decode",
                "0.5",
            ],
            "--min-prefill-per-decode: 0.5 cannot hold: --min-decode 3 needs more than "
            "--max-prefill 1",
        ),  # fmt: skip
    ],
)
def test_bad_flag_exits_2_naming_it(
    flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"splitserve up: {field}"), flags


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scale-interval", "inf"], "--scale-interval: inf must be positive and finite"),
        (["--scale-interval", "nan"], "--scale-interval: nan must be positive and finite"),
        (
            ["--scale-down-stabilization", "nan"],
            "--scale-down-stabilization: nan must be >= 0 and finite",
        ),
        (
            ["--scale-down-stabilization", "inf"],
            "--scale-down-stabilization: inf must be >= 0 and finite",
        ),
    ],
)
def test_autoscale_durations_must_be_finite(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse's float() takes them. Checked on the flags alone: were one accepted, `up` itself
    # would go on to start the stack.
    import argparse

    from splitserve_workers.local import _check_autoscale, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        _check_autoscale(parser.parse_args(["--autoscale", *flags]), (1, 1, 0))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"splitserve up: {message}\n"


def test_bad_device_exits_2_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked on the flags alone: before, `up` started the stack and every worker refused it.
    import argparse

    from splitserve_workers.local import _check_counts, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        _check_counts(parser.parse_args(["--device", "tpu"]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("splitserve up: --device: 'tpu' is not one of")
    _check_counts(parser.parse_args(["--device", "cuda:1"]))  # well-formed: the workers decide


def test_cache_that_is_a_file_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(cache))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--port", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve up: SPLITSERVE_CACHE: cannot create "), err
    assert "Traceback" not in err


def test_model_without_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(tmp_path), "--port", "0"])  # 8000 may be taken
    assert exit_.value.code == 2
    assert "--model: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "required"),
    [
        ("up", []),
        ("router", []),
        ("decode", []),
        ("make-model", ["--preset", "tiny-llama", "--out", "unused"]),
    ],
)
def test_unknown_flag_shows_the_subcommands_usage(
    command: str, required: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, *required, "--bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: splitserve {command} "), err
    assert err.rstrip().endswith("unrecognized arguments: --bogus"), err


def test_autoscale_flags_reach_the_settings() -> None:
    import argparse

    from splitserve_workers.local import _check_autoscale, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--autoscale", "--target-kv-usage", "0.6", "--target-queue-share", "0",
         "--max-prefill-per-decode", "2"]
    )  # fmt: skip
    settings = _check_autoscale(args, (1, 1, 0))
    assert settings is not None
    assert settings.targets == (0.7, 0.6, 0.0)
    assert settings.prefill_per_decode == (None, 2.0)
