"""Engine settings (EngineConfig): which model, where, and how big the KV cache and batches are.

Read by LLMEngine (llm_engine.py), which resolves "auto" dtype/device and sizes the block pool
(block_manager.py) from these numbers. Pure data plus validation; no torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 16


@dataclass
class EngineConfig:
    model: str  # HF-format directory
    # auto|float32|bfloat16|float16. auto: the config's torch_dtype on CUDA; on CPU bfloat16 for
    # a bfloat16 checkpoint when the CPU has bfloat16 instructions, else float32.
    dtype: str = "auto"
    device: str = "auto"  # auto|cpu|cuda|cuda:N
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 << 20  # sizes num_kv_blocks
    # Instead of kv_cache_memory_bytes: this share, in (0, 1], of the memory still free on the
    # device once the weights are loaded (engine/memory.py: a GPU's free memory; on CPU
    # MemAvailable capped by the cgroup limit). The rest stays for activations and others.
    kv_cache_memory_fraction: float | None = None
    num_kv_blocks: int | None = None  # overrides the memory budget when set
    max_batch_size: int = 32  # max sequences in one decode iteration
    max_batch_tokens: int = 2048  # prefill token budget per forward pass (longer prompts chunk)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Addition: decode steps and prompt chunks share forward passes (colocated serving: a long
    # prompt no longer pauses running sequences). Off: an iteration is all prefill or all decode.
    enable_mixed_batches: bool = False
    # Addition: speculative decoding by n-gram lookup in the sequence's own prompt and output
    # (speculative.py): up to this many draft tokens verified per sequence in a decode pass;
    # 0 = off. The drafts come from the longest suffix of speculative_ngram_max down to
    # speculative_ngram_min tokens seen earlier.
    speculative_tokens: int = 0
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 3
    # Addition: on CPU, hold the weights in oneDNN's prepacked layout (layers/linear.py): in
    # bfloat16 when this torch build supports it, in float32 where a load-time probe measures
    # it faster than torch's matmul. Off: plain torch matmuls.
    cpu_weight_prepack: bool = True
    # Addition: on CPU, decode attention reads the KV block pool in place with a small C kernel
    # built on first use (layers/cpu_decode_attention.c; needs a C compiler, else the torch
    # path runs). Off: gather + SDPA.
    cpu_decode_kernel: bool = True

    def validate(self) -> None:
        if not self.model:
            raise ValueError(
                "EngineConfig.model: a Hugging Face-format model directory is required"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype: {self.dtype!r} is not one of {DTYPES}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(
                f"EngineConfig.device: {self.device!r} is not one of auto, cpu, cuda, cuda:N"
            )
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"EngineConfig.block_size: {self.block_size} not in [1, 1024]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks: {self.num_kv_blocks} must be >= 1")
        if self.num_kv_blocks is None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_bytes: {self.kv_cache_memory_bytes} must be >= 1"
            )
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:  # nan too
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction: {fraction} must be in (0, 1]")
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size: {self.max_batch_size} must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError(f"EngineConfig.max_batch_tokens: {self.max_batch_tokens} must be >= 1")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"EngineConfig.speculative_tokens: {self.speculative_tokens} not in "
                f"[0, {MAX_SPECULATIVE_TOKENS}]"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= MAX_NGRAM:
            raise ValueError(
                f"EngineConfig.speculative_ngram_min/max: {self.speculative_ngram_min}, "
                f"{self.speculative_ngram_max}: need 1 <= min <= max <= {MAX_NGRAM}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len: {self.max_model_len} must be >= 1")
