"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral): just the math.

Differences between the families are ModelConfig flags (q/k/v bias, per-head q/k RMSNorm,
rope scaling, tied embeddings). Projections are fused at load time (q|k|v and gate|up) so each
layer runs four matmuls; activations are flat [tokens, hidden] across the batch. KV storage and
batching live in layers/attention.py and model_runner.py; weights come from loader.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from splitserve_workers.engine.layers.attention import AttentionMetadata, paged_attention
from splitserve_workers.engine.layers.linear import PackedLinear, prepack_linears
from splitserve_workers.engine.layers.rmsnorm import RMSNorm
from splitserve_workers.engine.layers.rope import RotaryEmbedding, apply_rotary
from splitserve_workers.engine.model_config import ModelConfig

# (layer, k, v) for the new tokens of a forward pass, RoPE applied, [T, kv_heads, head_dim].
KVHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.sliding = layer in cfg.sliding_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.sliding and meta.windowed is not None:
            meta = meta.windowed
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype
        )
        self.down_proj = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        )
        self.rotary: RotaryEmbedding | None = None
        # [hidden, vocab] copy of the output projection, used instead of it when set.
        self.logits_weight_t: torch.Tensor | None = None
        # The output projection prepacked for oneDNN (prepack_weights), used when set.
        self.logits_head: PackedLinear | None = None

    def init_rotary(self, device: torch.device) -> None:
        # Built after the weights are materialised (the module may start on the meta device).
        cfg = self.config
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_hook: KVHook | None = None,
    ) -> torch.Tensor:
        """input_ids/positions: [T]; kv_cache: [layers, 2, blocks, block_size, kv_heads,
        head_dim]. Returns the final hidden states [T, hidden] (normed)."""
        assert self.rotary is not None, "init_rotary() was not called"
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        for i, layer in enumerate(cast(list[DecoderLayer], self.layers)):
            h, k, v = layer.self_attn(
                layer.input_layernorm(x), cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta
            )
            if kv_hook is not None:
                kv_hook(i, k, v)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def transpose_logits_weight(self) -> None:
        """Keep the output projection as [hidden, vocab]. On CPU the skinny decode GEMM reads
        it about 2x faster at batch 1 (and ~15% at batch 32) than F.linear's [vocab, hidden];
        it is the largest matrix of a small model. An untied lm_head is replaced, a tied one
        copied."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.logits_weight_t = weight.detach().t().contiguous()
        self.lm_head = None  # compute_logits uses the transposed copy from now on

    def probe_weight(self) -> torch.Tensor:
        """The largest projection of a layer (gate|up), before prepacking: what
        float32_prepack_pays times."""
        return cast(DecoderLayer, self.layers[0]).mlp.gate_up_proj.weight

    def prepack_weights(self) -> None:
        """Prepack every projection and the output projection for oneDNN (layers/linear.py;
        CPU only). The embedding table stays as it is, also when tied."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.logits_head = PackedLinear(weight, None)
        self.lm_head = None
        prepack_linears(self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        if self.logits_weight_t is not None:
            return torch.matmul(hidden, self.logits_weight_t).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
