"""ServingConfig (the operator <-> worker contract): every invalid file or value is a ConfigError
whose message starts with the field it is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from splitserve_workers.config import ConfigError, ServingConfig


def test_defaults_round_trip_through_yaml() -> None:
    config = ServingConfig()
    assert ServingConfig.from_yaml(config.to_yaml()) == config


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([1, 2], "config"),
        ({"service": {"name": "x"}}, "service"),
        ({"model": 5}, "model"),
        ({"nope": {}}, "nope"),
        ({"decode": {"nope": 1}}, "decode.nope"),
        ({"model": {"dtype": "int4"}}, "model.dtype"),
        ({"model": {"max_model_len": 0}}, "model.max_model_len"),
        ({"model": {"max_model_len": "long"}}, "model.max_model_len"),
        ({"decode": {"max_batch_size": "big"}}, "decode.max_batch_size"),
        ({"decode": {"max_batch_size": 0}}, "decode.max_batch_size"),
        ({"decode": {"block_size": True}}, "decode.block_size"),
        ({"decode": {"speculative_tokens": -1}}, "decode.speculative_tokens"),
        ({"decode": {"speculative_tokens": 17}}, "decode.speculative_tokens"),
        ({"decode": {"kv_cache_memory_bytes": 0}}, "decode.kv_cache_memory_bytes"),
        ({"prefill": {"kv_cache_memory_bytes": -1}}, "prefill.kv_cache_memory_bytes"),
        ({"prefill": {"max_batch_tokens": 0}}, "prefill.max_batch_tokens"),
        ({"decode": {"kv_cache_memory_fraction": 0}}, "decode.kv_cache_memory_fraction"),
        ({"prefill": {"kv_cache_memory_fraction": 1.5}}, "prefill.kv_cache_memory_fraction"),
        ({"decode": {"kv_cache_memory_fraction": "90%"}}, "decode.kv_cache_memory_fraction"),
        (
            {"decode": {"kv_cache_memory_fraction": float("nan")}},
            "decode.kv_cache_memory_fraction",
        ),
        ({"prefill": {"port": 70000}}, "prefill.port"),
        ({"decode": {"port": -1}}, "decode.port"),
        ({"router": {"port": 65536}}, "router.port"),
        ({"router": {"max_request_bytes": 0}}, "router.max_request_bytes"),
        ({"router": {"prefill_endpoints": "a:1"}}, "router.prefill_endpoints"),
        ({"router": {"discovery": "consul"}}, "router.discovery"),
        ({"router": {"log_requests": "yes"}}, "router.log_requests"),
        ({"router": {"log_requests": 1}}, "router.log_requests"),
        ({"slo": {"percentile": 100}}, "slo.percentile"),
        ({"slo": {"ttft_seconds": "fast"}}, "slo.ttft_seconds"),
        # YAML's .nan compares false with every bound, so `value < minimum` let it through.
        (
            {"decode": {"reservation_lease_seconds": float("nan")}},
            "decode.reservation_lease_seconds",
        ),
        ({"slo": {"tpot_seconds": float("nan")}}, "slo.tpot_seconds"),
    ],
)
def test_invalid_value_names_the_field(data: Any, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ServingConfig.from_dict(data)
    assert str(err.value).startswith(f"{field}: "), str(err.value)


def test_valid_edges_are_accepted() -> None:
    config = ServingConfig.from_dict(
        {
            "model": {"max_model_len": None},
            "prefill": {"port": 0},
            "router": {"port": 65535, "prefill_endpoints": ["a:1"], "log_requests": True},
            "slo": {"ttft_seconds": 1},  # an int is a fine float
        }
    )
    assert config.router.port == 65535 and config.slo.ttft_seconds == 1
    assert config.router.log_requests is True


def test_unreadable_or_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config: cannot read .*missing\.yaml"):
        ServingConfig.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(
        ConfigError, match=r"^config: .*bad\.yaml is not valid YAML: .*\(line 2"
    ) as e:
        ServingConfig.load(bad)
    assert "\n" not in str(e.value)  # one line, not PyYAML's excerpt
    binary = tmp_path / "binary.yaml"  # e.g. a model file passed as --config by mistake
    binary.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"^config: .*binary\.yaml is not UTF-8 text"):
        ServingConfig.load(binary)
    twice = tmp_path / "twice.yaml"  # the second section would silently replace the first
    twice.write_text("decode:\n  max_batch_size: 8\nprefill:\n  port: 1\ndecode:\n  port: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"twice\.yaml is not valid YAML: the key 'decode' is given twice "
        r"\(line 5, column 1\)$",
    ):
        ServingConfig.load(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("decode:\n  port: 1\n  port: 2\n")
    with pytest.raises(ConfigError, match=r"'port' is given twice"):
        ServingConfig.load(nested)
    anchors = tmp_path / "anchors.yaml"  # merge keys still work, and a key written wins
    anchors.write_text("prefill: &w {port: 7001}\ndecode: {<<: *w, port: 7002}\n")
    config = ServingConfig.load(anchors)
    assert (config.prefill.port, config.decode.port) == (7001, 7002)


def test_the_tests_run_this_checkouts_code() -> None:
    # The cached venv is shared by every clone; tests/conftest.py puts this one first, for
    # this process and the processes the tests start.
    import subprocess
    import sys

    import splitserve_operator
    import splitserve_workers

    root = Path(__file__).resolve().parents[1]
    for module in (splitserve_workers, splitserve_operator):
        assert root in Path(module.__file__ or "").resolve().parents
    child = subprocess.run(
        [sys.executable, "-c", "import splitserve_workers; print(splitserve_workers.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert root in Path(child.stdout.strip()).resolve().parents
