"""ModelConfig: the architecture facts the engine needs, parsed from a Hugging Face config.json.

One dataclass covers Llama, Qwen2, Qwen3 and Mistral; the differences are flags (q/k/v bias,
per-head q/k RMSNorm, rope scaling) read by models/llama.py and layers/. loader.py builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)

# transformers' max_position_embeddings default per architecture, for configs without the key.
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "MistralForCausalLM": 4096 * 32,
}


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _sliding_window(
    cfg: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it), as transformers' config classes decide: Mistral slides
    in every layer when `sliding_window` is set (its default is 4096); Qwen2/Qwen3 only with
    `use_sliding_window`, in the layers `layer_types` marks "sliding_attention" or, without
    it, from `max_window_layers` on. Llama never."""
    layers: list[int] | range
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", 4096)
        layers = range(num_layers)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", 4096)
        types = cfg.get("layer_types")
        if isinstance(types, list) and len(types) == num_layers:
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            layers = range(int(cfg.get("max_window_layers", 28)), num_layers)
    else:
        return None, ()
    if window is None:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json sliding_window: {window!r} must be a positive integer")
    return window, tuple(layers)


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # the engine's limit: max_position_embeddings (with YaRN, the original context x factor if
    # longer) unless configured lower
    max_model_len: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 when attention_bias (Qwen2 never)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention: a token attends to the last `sliding_window` positions (itself
    # included) in the layers listed; None/() when no layer has a window.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"config.json architectures: {archs!r} has none of {SUPPORTED_ARCHITECTURES}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act: {act!r} is not supported (only 'silu')")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"config.json num_key_value_heads: {kv_heads} does not divide "
                f"num_attention_heads {heads}"
            )
        # Qwen3's config class defaults head_dim to 128, not hidden / heads (Llama, Mistral).
        default_head_dim = 128 if arch == "Qwen3ForCausalLM" else hidden // heads
        head_dim = int(cfg.get("head_dim") or default_head_dim)
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        # Absent keys take transformers' defaults for the family (its config classes').
        max_pos = int(cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch]))
        max_len = max_pos
        num_layers = int(cfg["num_hidden_layers"])
        window, sliding_layers = _sliding_window(cfg, arch, num_layers)
        rope_theta = float(cfg.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        # Configs saved by transformers >= 5 keep both in one `rope_parameters` dict.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict) and rope_params:
            rope_theta = float(rope_params.get("rope_theta", rope_theta))
            kind = rope_params.get("rope_type", rope_params.get("type", "default"))
            rope_scaling = None if kind == "default" else rope_params
        if rope_scaling == {}:
            rope_scaling = None  # transformers reads an empty dict as the default rope
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "yarn", "default"):
                raise ValueError(
                    f"config.json rope_scaling.rope_type: {kind!r} is not supported "
                    "(llama3, linear, yarn, default)"
                )
            if kind == "yarn":
                # As transformers fills them: the original context defaults to the model's,
                # and a missing factor is the ratio of the two (DeepSeek-V3's configs).
                rope_scaling = dict(rope_scaling)
                old_len = rope_scaling.setdefault("original_max_position_embeddings", max_pos)
                if rope_scaling.get("factor") is None and isinstance(old_len, int | float):
                    rope_scaling["factor"] = max_pos / old_len
            needs = {
                "linear": ("factor",),
                "llama3": _LLAMA3_KEYS,
                "yarn": ("factor", "original_max_position_embeddings"),
            }.get(kind, ())
            for key in needs:
                if not isinstance(rope_scaling.get(key), int | float):
                    raise ValueError(
                        f"config.json rope_scaling.{key}: {rope_scaling.get(key)!r} must be a "
                        f"number for rope_type {kind!r}"
                    )
            if kind == "yarn":
                # YaRN stretches the original context by `factor`: Qwen2.5's documented setting
                # keeps max_position_embeddings at 32768 and serves 131072 (vLLM derives the
                # same); DeepSeek-style configs already say the stretched length.
                old_len = rope_scaling["original_max_position_embeddings"]
                max_len = max(max_pos, int(old_len * rope_scaling["factor"]))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            max_model_len=max_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=rope_scaling,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window if sliding_layers else None,
            sliding_layers=sliding_layers,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json: not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
        try:
            return cls.from_dict(cfg)
        except KeyError as e:  # a key every supported architecture's config.json has
            raise ValueError(f"config.json: {e.args[0]!r} is missing") from e
        except (TypeError, AttributeError) as e:  # null or a list where a number or map belongs
            raise ValueError(f"config.json: {type(e).__name__}: {e}") from e

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h
