"""Worker command lines (`splitserve prefill|decode|colocated`) with a value out of range exit 2
before binding a port or loading the model, and say which field is wrong."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from splitserve_workers import worker_runtime
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
        (["--kv-cache-memory-fraction", "0"], "kv_cache_memory_fraction"),
        (["--kv-cache-memory-fraction", "1.01"], "kv_cache_memory_fraction"),
        (["--kv-cache-memory-fraction", "nan"], "kv_cache_memory_fraction"),
        (["--kv-cache-memory-fraction", "0.5", "--kv-cache-memory", "1024"], "kv_cache_memory"),
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


def engine_settings(role: str, *argv: str) -> Any:
    """The EngineConfig a worker of `role` would start its engine with."""
    parser = argparse.ArgumentParser()
    worker_runtime.add_arguments(parser)
    settings = worker_runtime.load_settings(role, parser.parse_args(list(argv)))
    return worker_runtime.engine_config(settings)


def test_kv_cache_budget_as_a_share_or_bytes_reaches_the_engine(
    model_dir: Path, tmp_path: Path
) -> None:
    (model_dir / "tokenizer.json").write_text("{}")
    config = tmp_path / "serving.yaml"
    config.write_text("decode:\n  kv_cache_memory_fraction: 0.8\n")
    base = ("--model", str(model_dir), "--config", str(config))
    # The config file's share, for the pool it is written for.
    decode = engine_settings("decode", *base)
    assert (decode.kv_cache_memory_fraction, decode.kv_cache_memory_bytes) == (0.8, 1 << 30)
    assert engine_settings("prefill", *base).kv_cache_memory_fraction is None
    # A flag wins over the file: bytes drop the file's share, a share replaces it.
    flagged = engine_settings("decode", *base, "--kv-cache-memory", "4096")
    assert (flagged.kv_cache_memory_fraction, flagged.kv_cache_memory_bytes) == (None, 4096)
    share = engine_settings("decode", *base, "--kv-cache-memory-fraction", "0.25")
    assert share.kv_cache_memory_fraction == 0.25
