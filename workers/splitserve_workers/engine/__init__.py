"""The inference engine: Llama/Qwen2/Qwen3/Mistral models from a local Hugging Face directory,
paged KV cache with prefix caching, batched/chunked prefill and continuous-batching decode.

One idea per file: config.py (EngineConfig), model_config.py, loader.py, tokenizer.py,
models/llama.py, layers/ (rmsnorm, rope, attention), sequence.py, block_manager.py,
scheduler.py, speculative.py (n-gram drafts), sampling.py, model_runner.py, llm_engine.py
(LLMEngine), make_model.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve_workers.engine.config import EngineConfig
    from splitserve_workers.engine.llm_engine import IterationStats, LLMEngine
    from splitserve_workers.engine.model_config import ModelConfig
    from splitserve_workers.engine.sampling import SamplingParams
    from splitserve_workers.engine.sequence import Priority, TokenOutput
    from splitserve_workers.engine.tokenizer import Tokenizer

# Imported on first use (PEP 562): the router needs only the tokenizer and the model config,
# and importing the engine's modules eagerly loaded torch into it (about 500 MiB more RSS).
_EXPORTS = {
    "EngineConfig": "config",
    "IterationStats": "llm_engine",
    "LLMEngine": "llm_engine",
    "ModelConfig": "model_config",
    "Priority": "sequence",
    "SamplingParams": "sampling",
    "TokenOutput": "sequence",
    "Tokenizer": "tokenizer",
}

__all__ = [
    "EngineConfig",
    "IterationStats",
    "LLMEngine",
    "ModelConfig",
    "Priority",
    "SamplingParams",
    "TokenOutput",
    "Tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
