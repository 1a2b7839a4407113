"""Linear layers with their weights prepacked for oneDNN (CPU, bfloat16).

torch's CPU matmul for bfloat16 calls oneDNN, which reorders the weight into its blocked
layout on every call. Reordering once at load time (`torch.ops.mkldnn._reorder_linear_weight`,
the layout torch.compile's CPU weight freezing produces) and calling the prepacked kernel
(`_linear_pointwise`) skips that: on an AVX-512 bf16 CPU a batch-32 decode step's projections
ran 1.1-1.5x faster and the 32000-row output projection 1.47x, with batch 1 no slower and
identical results (docs/engine.md, Benchmarks). In float32 the same prepacking made batch-1
decode 6-13% slower, so only bfloat16 is packed, and only where this torch build's oneDNN
supports it. The packed tensor is opaque (mkldnn layout): nothing may read it as a weight
matrix afterwards, so this runs last in load_model.
"""

from __future__ import annotations

import torch
from torch import nn


def cpu_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX) and torch's oneDNN can
    use it. Without it oneDNN emulates bfloat16 through float32 and nothing here was measured."""
    try:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return bool(
            native
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):  # private helpers a future or stripped build may lack
        return False


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on `device` are prepacked (CPU bfloat16 with native kernels)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_native_bf16()


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's blocked layout. x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # a no-op for the model's inputs
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def prepack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` with a PackedLinear."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear.from_linear(child))
        else:
            prepack_linears(child)
