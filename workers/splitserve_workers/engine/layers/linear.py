"""Linear layers with their weights prepacked for oneDNN (CPU, bfloat16, and float32 where it
measures faster).

torch's CPU matmul for bfloat16 calls oneDNN, which reorders the weight into its blocked
layout on every call. Reordering once at load time (`torch.ops.mkldnn._reorder_linear_weight`,
the layout torch.compile's CPU weight freezing produces) and calling the prepacked kernel
(`_linear_pointwise`) skips that: on an AVX-512 bf16 CPU a batch-32 decode step's projections
ran 1.1-1.5x faster and the 32000-row output projection 1.47x, with batch 1 no slower and
identical results (docs/engine.md, Benchmarks).

float32 is different: torch's float32 matmul is MKL's sgemm, not oneDNN, and which of the two
is faster depends on the CPU. On an AMD EPYC with full-width AVX-512 (Zen 5) oneDNN's packed
kernels ran 2.2-3.4x MKL's at 8-128 rows (MKL took ~80-100 GFLOP/s of the core's ~355); on an
earlier machine prepacking made batch-8/32 decode 1.1-1.2x faster and batch 1 6-13% slower.
So float32 is packed only where `float32_prepack_pays` measures it faster on the model's own
largest projection at load time.

The packed tensor is opaque (mkldnn layout): nothing may read it as a weight matrix
afterwards, so this runs last in load_model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

# float32 is packed when oneDNN's packed kernel is at least this much faster than MKL's sgemm
# on the probe: a clear margin, so two processes on one machine decide alike.
FLOAT32_PREPACK_MIN_SPEEDUP = 1.25
FLOAT32_PREPACK_ENV = "SPLITSERVE_CPU_FP32_PREPACK"  # "1" always, "0" never, unset: measure
# Projections smaller than this (elements) are not probed, and stay plain: their GEMMs take
# microseconds, where a timing decides nothing reliably (and two engines of one test could
# decide differently). The probe times at most FLOAT32_PROBE_ROWS output rows of the weight.
FLOAT32_PREPACK_MIN_ELEMENTS = 1 << 20
FLOAT32_PROBE_ROWS = 4096


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


def prepack_pays(device: torch.device, dtype: torch.dtype, probe: torch.Tensor) -> bool:
    """Whether load_model prepacks: bfloat16 where supported (prepack_supported), float32 where
    `float32_prepack_pays` measures it faster on `probe` (the model's largest projection)."""
    if prepack_supported(device, dtype):
        return True
    return device.type == "cpu" and dtype == torch.float32 and float32_prepack_pays(probe)


def _seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def float32_prepack_pays(weight: torch.Tensor, rows: int = 16, rounds: int = 3) -> bool:
    """Whether oneDNN's prepacked kernel beats torch's float32 matmul (MKL) on this CPU, for
    `weight` ([out, in], float32, CPU) at `rows` input rows: the best of `rounds` timings of
    each, FLOAT32_PREPACK_MIN_SPEEDUP or more. A few ms at load time (at most 4096 rows of
    the weight are timed); False without timing for a projection under
    FLOAT32_PREPACK_MIN_ELEMENTS. SPLITSERVE_CPU_FP32_PREPACK=1 or 0 decides instead."""
    forced = os.environ.get(FLOAT32_PREPACK_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if weight.numel() < FLOAT32_PREPACK_MIN_ELEMENTS or not torch.backends.mkldnn.is_available():
        return False
    weight = weight[:FLOAT32_PROBE_ROWS]  # bounded cost for an 8B model's [28672, 4096]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, RuntimeError):  # a build without the private op
        return False
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    plain = onednn = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):  # alternating, so a load spike hits both
            plain = min(plain, _seconds_per_call(lambda: torch.nn.functional.linear(x, weight), 3))
            onednn = min(
                onednn,
                _seconds_per_call(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 3
                ),
            )
    pays = plain >= FLOAT32_PREPACK_MIN_SPEEDUP * onednn
    log.info(
        "float32 %s at %d rows: torch matmul %.3f ms, oneDNN packed %.3f ms: %s",
        tuple(weight.shape), rows, plain * 1e3, onednn * 1e3,
        "prepacking" if pays else "not prepacking",
    )  # fmt: skip
    return pays


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
