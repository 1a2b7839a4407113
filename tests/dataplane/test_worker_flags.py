"""Worker command lines (`splitserve prefill|decode|colocated`) with a value out of range exit 2
before binding a port or loading the model, and say which field is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_workers.cli import main


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    # load_settings only checks that the directory holds a config.json; nothing gets loaded.
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--port", "70000"], "port"),
        (["--port", "-1"], "port"),
        (["--metrics-port", "65536"], "metrics_port"),
        (["--drain-timeout", "-1"], "drain_timeout"),
        (["--threads", "0"], "threads"),
        (["--num-kv-blocks", "0"], "num_kv_blocks"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--block-size", "4096"], "block_size"),
        (["--max-batch-size", "0"], "max_batch_size"),
        (["--dtype", "int4"], "dtype"),
        (["--device", "tpu"], "device"),
        (["--lease-seconds", "0"], "lease_seconds"),
        # inf failed every Reserve (int(inf) for lease_ms) and leaked its blocks; nan never
        # expired a lease; nan as the drain timeout cut every stream at once.
        (["--lease-seconds", "inf"], "lease_seconds"),
        (["--lease-seconds", "nan"], "lease_seconds"),
        (["--lease-seconds", "1e300"], "lease_seconds"),
        (["--drain-timeout", "nan"], "drain_timeout"),
    ],
)
@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_out_of_range_flag_exits_2_naming_the_field(
    role: str, flags: list[str], field: str, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([role, "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve {role}: {field}: "), err


def test_bad_config_file_exits_2_naming_the_field(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serving.yaml"
    config.write_text("decode:\n  port: 99999\n")
    assert main(["decode", "--model", str(model_dir), "--config", str(config)]) == 2
    assert "decode.port: 99999" in capsys.readouterr().err
    assert main(["decode", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config: cannot read" in capsys.readouterr().err
