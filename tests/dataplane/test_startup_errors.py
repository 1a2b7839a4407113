"""Commands that cannot start say why in one line and exit non-zero, without a traceback: a port
already in use (router, worker gRPC and metrics ports, `up`'s router port, checked before any
model loads), a model directory without tokenizer.json, a preset `up` cannot build."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from splitserve_workers.cli import main


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def no_tokenizer(tiny_model: Path, tmp_path: Path) -> Path:
    out = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, out)
    (out / "tokenizer.json").unlink()
    return out


def one_line_error(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("splitserve ")]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def test_router_port_in_use(
    tiny_model: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["router", "--model", str(tiny_model), "--host", "127.0.0.1"]
    args += ["--port", str(busy_port), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]
    assert main(args) == 1
    line = one_line_error(capsys, "splitserve router: port: cannot listen on ")
    assert str(busy_port) in line


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_worker_port_in_use_fails_before_loading(
    tiny_model: Path, busy_port: int, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = {"--port": "0", "--metrics-port": "0", flag: str(busy_port)}
    args = ["prefill", "--model", str(tiny_model), "--host", "127.0.0.1"]
    args += [a for pair in ports.items() for a in pair]
    assert main(args) == 1
    field = flag.removeprefix("--").replace("-", "_")
    line = one_line_error(capsys, f"splitserve prefill: {field}: cannot listen on ")
    assert str(busy_port) in line


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_worker_model_without_tokenizer_exits_2(
    role: str, no_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([role, "--model", str(no_tokenizer), "--port", "0", "--metrics-port", "0"]) == 2
    line = one_line_error(capsys, f"splitserve {role}: model.path: ")
    assert line.endswith("has no tokenizer.json")


def test_worker_unloadable_weights_is_one_line(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = ["decode", "--model", str(broken), "--port", "0", "--metrics-port", "0"]
    assert main(args) == 1
    one_line_error(capsys, f"splitserve decode: model.path: cannot load {broken}: ")


@pytest.mark.parametrize("kind", ["dangling-symlink", "directory"])
def test_worker_unreadable_weights_file_is_one_line(
    tiny_model: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A half-downloaded Hugging Face cache leaves symlinks to blobs that are not there; the
    # model fingerprint read them before the guarded load and died with a traceback.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.unlink()
    if kind == "directory":
        weights.mkdir()
    else:
        weights.symlink_to(tmp_path / "no-such-blob")
    args = ["prefill", "--model", str(broken), "--port", "0", "--metrics-port", "0"]
    assert main(args) == 1
    line = one_line_error(capsys, "splitserve prefill: model.path: cannot read ")
    assert "model.safetensors" in line


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda cfg: cfg.pop("num_hidden_layers"), "'num_hidden_layers' is missing"),
        (lambda cfg: cfg.update(num_attention_heads=None), "TypeError"),
    ],
)
def test_router_incomplete_model_config_exits_2(
    tiny_model: Path, tmp_path: Path, change: Any, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    cfg = json.loads((broken / "config.json").read_text())
    change(cfg)
    (broken / "config.json").write_text(json.dumps(cfg))
    args = ["router", "--model", str(broken), "--host", "127.0.0.1", "--port", "0"]
    assert main([*args, "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]) == 2
    line = one_line_error(capsys, "splitserve router: config.json: ")
    assert needle in line


def test_up_port_in_use_exits_2_before_starting(
    tiny_model: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(tiny_model), "--port", str(busy_port)])
    assert exit_.value.code == 2
    one_line_error(capsys, "splitserve up: --port: cannot listen on ")


def test_up_model_without_tokenizer_exits_2(
    no_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(no_tokenizer), "--port", "0"])
    assert exit_.value.code == 2
    one_line_error(capsys, "splitserve up: --model: ")


def test_up_unknown_preset_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--preset", "no-such-preset", "--port", "0"])
    assert exit_.value.code == 2
    err = capfd.readouterr().err  # make-model's own complaint comes from the child process
    assert "Traceback" not in err, err
    assert "splitserve up: --preset: building 'no-such-preset' failed" in err
    assert "invalid choice: 'no-such-preset'" in err


def test_up_bad_config_exits_2_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serving.yaml"
    config.write_text("decode:\n  port: 99999\n")
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(tmp_path), "--config", str(config), "--port", "0"])
    assert exit_.value.code == 2
    one_line_error(capsys, "splitserve up: decode.port: 99999")


def test_worker_max_model_len_past_the_model_names_the_setting(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["prefill", "--model", str(tiny_model), "--port", "0", "--metrics-port", "0"]
    assert main([*args, "--max-model-len", "4096"]) == 1
    line = one_line_error(capsys, "splitserve prefill: max_model_len: 4096 ")
    assert "1024" in line
