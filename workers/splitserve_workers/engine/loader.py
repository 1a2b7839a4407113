"""Load a Hugging Face-format directory (config.json + single or sharded *.safetensors) into
models/llama.py, fusing q|k|v and gate|up projections while copying.

The model is built on the meta device and materialised once on the target device, so large
checkpoints are never held twice; each tensor is read, cast and copied into place one by one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from splitserve_workers.engine.layers.linear import prepack_pays
from splitserve_workers.engine.model_config import ModelConfig
from splitserve_workers.engine.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter path, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors files")
    return files


def _shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    prepack: bool = True,
) -> LlamaForCausalLM:
    """The model in `model_dir` on `device`, ready to run. prepack: on CPU, hold the projections
    in oneDNN's layout in bfloat16 when this torch build supports it, and in float32 when it
    measures faster than torch's matmul on this CPU (layers/linear.py)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, dtype)
    model.to_empty(device=device)
    _copy_weights(model, Path(model_dir), cfg, device)
    model.init_rotary(device)
    # _copy_weights has returned, so nothing of the loading holds a weight: prepacking (and
    # transpose_logits_weight) frees each original as it makes the copy that replaces it.
    if prepack and prepack_pays(device, dtype, model.probe_weight()):
        model.prepack_weights()
    elif device.type == "cpu":
        model.transpose_logits_weight()
    model.eval()
    return model


def _copy_weights(
    model: LlamaForCausalLM, model_dir: Path, cfg: ModelConfig, device: torch.device
) -> None:
    """Every checkpoint tensor into the model's (materialised) parameters, fusing shards."""
    from safetensors import safe_open  # here: the model code itself needs only torch

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # Fused parameters are complete only when all their shards arrived.
    fused_seen: dict[str, set[int]] = {}

    load_device = "cpu" if device.type == "cpu" else str(device)
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=load_device) as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # some checkpoints store the tied copy as well
                target, shard = _map_name(name)
                if target not in params:
                    raise ValueError(
                        f"{path.name}: unexpected tensor {name!r} for {cfg.architecture}"
                    )
                tensor = f.get_tensor(name)
                param = params[target]
                with torch.no_grad():
                    if shard is None:
                        if tuple(tensor.shape) != tuple(param.shape):
                            raise ValueError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, "
                                f"config.json implies {tuple(param.shape)}"
                            )
                        param.copy_(tensor)
                        loaded.add(target)
                    else:
                        sizes = _shard_sizes(cfg, target.rsplit(".", 1)[0])
                        start = sum(sizes[:shard])
                        dst = param.narrow(0, start, sizes[shard])
                        if tuple(tensor.shape) != tuple(dst.shape):
                            raise ValueError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, "
                                f"config.json implies {tuple(dst.shape)}"
                            )
                        dst.copy_(tensor)
                        fused_seen.setdefault(target, set()).add(shard)
                        if len(fused_seen[target]) == len(sizes):
                            loaded.add(target)
                del tensor
    missing = [
        hf
        for target in sorted(set(params) - loaded)
        for hf in _checkpoint_names(target, fused_seen.get(target, set()))
    ]
    if missing:
        raise ValueError(
            f"model directory {str(model_dir)!r} is missing weights: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )


def _checkpoint_names(target: str, shards_seen: set[int]) -> list[str]:
    """The checkpoint's names for our parameter `target` (the inverse of _map_name), without
    the shards of a fused parameter that did arrive: what a missing-weights error names."""
    if not target.startswith("layers."):
        return ["lm_head.weight" if target == "lm_head.weight" else f"model.{target}"]
    _, _, rest = target.partition(".")
    layer, _, rest = rest.partition(".")
    module, _, leaf = rest.rpartition(".")
    names = [
        f"model.layers.{layer}.{hf}.{leaf}"
        for hf, (fused, shard) in _FUSED.items()
        if fused == module and shard not in shards_seen
    ]
    return names or [f"model.{target}"]


def _map_name(name: str) -> tuple[str, int | None]:
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.match(name)
    if m is None:
        return name, None
    layer, rest = m.group(1), m.group(2)
    module, _, leaf = rest.rpartition(".")
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{leaf}", shard
    return f"layers.{layer}.{rest}", None
