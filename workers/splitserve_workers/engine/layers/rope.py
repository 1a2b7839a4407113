"""Rotary position embedding (rotate-half convention, as in Hugging Face Llama), with the llama3
and linear frequency scalings. The cos/sin table is built once per model for max_model_len
positions in float32; each forward gathers the rows for its token positions once for all layers.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between is interpolated smoothly (same arithmetic as the reference implementation).
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq  # "default"


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the given positions as [T, 1, head_dim] in the activation dtype."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
            self.sin.index_select(0, positions).unsqueeze(1).to(dtype),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
