"""The inference engine: Llama/Qwen2/Qwen3/Mistral models from a local Hugging Face directory,
paged KV cache with prefix caching, batched/chunked prefill and continuous-batching decode.

One idea per file: config.py (EngineConfig), model_config.py, loader.py, tokenizer.py,
models/llama.py, layers/ (rmsnorm, rope, attention), sequence.py, block_manager.py,
scheduler.py, sampling.py, model_runner.py, llm_engine.py (LLMEngine), make_model.py.
"""

from splitserve_workers.engine.config import EngineConfig
from splitserve_workers.engine.llm_engine import IterationStats, LLMEngine
from splitserve_workers.engine.model_config import ModelConfig
from splitserve_workers.engine.sampling import SamplingParams
from splitserve_workers.engine.sequence import Priority, TokenOutput
from splitserve_workers.engine.tokenizer import Tokenizer

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
