"""Engine test fixtures: tiny random-weight models written once per session by make-model into
a temporary directory (real Hugging Face files), and small engines over them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine
from splitserve_workers.engine.make_model import write_model

TINY_PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    # The CI machine is small and shared; tiny models gain nothing from more threads.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_model(name, root / name, seed=1) for name in TINY_PRESETS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["tiny-llama"]


@pytest.fixture
def make_engine(tiny_llama: Path) -> Callable[..., LLMEngine]:
    def make(model: Path | None = None, **kw: object) -> LLMEngine:
        kw.setdefault("device", "cpu")
        return LLMEngine(EngineConfig(model=str(model or tiny_llama), **kw))  # type: ignore[arg-type]

    return make


def _prompt_ids(engine: LLMEngine, n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 + salt)
    hi = engine.tokenizer.vocab_size
    return torch.randint(4, hi, (n,), generator=g).tolist()  # skip the special tokens 0..3


@pytest.fixture
def prompt_ids() -> Callable[..., list[int]]:
    """prompt_ids(engine, n, salt=0): a deterministic prompt of exactly n ordinary tokens."""
    return _prompt_ids
