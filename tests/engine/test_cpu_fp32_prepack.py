"""float32 on CPU with the projections prepacked for oneDNN (layers/linear.py): the packed
kernel against nn.Linear, the load-time probe that decides whether float32 is packed, and a
packed engine against a plain one. SPLITSERVE_CPU_FP32_PREPACK forces the decision, so the
packed path is tested on every CPU, whichever way this one's probe goes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
from splitserve_workers.engine.layers.linear import (
    FLOAT32_PREPACK_ENV,
    FLOAT32_PREPACK_MIN_ELEMENTS,
    PackedLinear,
    float32_prepack_pays,
)
from splitserve_workers.engine.make_model import write_model
from torch import nn


def test_packed_float32_linear_matches_linear() -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(48, 80, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=g))
        linear.bias.copy_(torch.randn(80, generator=g))
    packed = PackedLinear.from_linear(linear)
    for shape in [(1, 48), (7, 48), (2, 3, 48), (33, 48)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_the_environment_decides_without_timing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    weight = torch.randn(2048, 1024)  # large enough to be probed
    caplog.set_level(logging.INFO, logger="splitserve_workers.engine.layers.linear")
    monkeypatch.setenv(FLOAT32_PREPACK_ENV, "1")
    assert float32_prepack_pays(weight) is True
    monkeypatch.setenv(FLOAT32_PREPACK_ENV, "0")
    assert float32_prepack_pays(weight) is False
    assert not caplog.records  # forced: nothing was timed


def test_the_probe_times_large_projections_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(FLOAT32_PREPACK_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="splitserve_workers.engine.layers.linear")
    small = torch.randn(64, FLOAT32_PREPACK_MIN_ELEMENTS // 64 - 1)
    assert float32_prepack_pays(small) is False
    assert not caplog.records
    large = torch.randn(8192, 512)  # over the threshold; only 4096 rows are timed
    decision = float32_prepack_pays(large)
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("float32 (4096, 512) at 16 rows: torch matmul ")
    assert message.endswith("not prepacking" if not decision else ": prepacking")


@pytest.fixture(scope="module")
def fp32_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("tiny-llama", tmp_path_factory.mktemp("fp32") / "m", seed=6)


def test_fp32_engine_prepacked_matches_plain(
    fp32_llama: Path, monkeypatch: pytest.MonkeyPatch, prompt_ids: Callable[..., list[int]]
) -> None:
    """Forced on, every projection and the output projection are packed, and a batch of
    different lengths greedy-decodes to the same tokens as plain float32 weights; the packed
    output projection's logits are within float32 rounding of the plain one's."""
    monkeypatch.setenv(FLOAT32_PREPACK_ENV, "1")
    packed = LLMEngine(EngineConfig(model=str(fp32_llama), device="cpu", dtype="float32"))
    monkeypatch.setenv(FLOAT32_PREPACK_ENV, "0")
    plain = LLMEngine(EngineConfig(model=str(fp32_llama), device="cpu", dtype="float32"))
    layers = [m for m in packed.model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert layers and all(isinstance(m, PackedLinear) for m in layers)
    assert packed.model.logits_head is not None
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    prompts = [prompt_ids(packed, n, salt=n) for n in (5, 19, 33, 2)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert packed.generate(prompts, params) == plain.generate(prompts, params)
    hidden = torch.randn(7, packed.model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            packed.model.compute_logits(hidden),
            plain.model.compute_logits(hidden),
            atol=1e-4,
            rtol=1e-4,
        )
