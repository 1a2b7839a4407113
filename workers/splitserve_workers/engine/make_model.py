"""`splitserve make-model`: write a random-weight model in Hugging Face format.

Output: config.json, model.safetensors (or model-0000i-of-0000n.safetensors + index for large
models), tokenizer.json (a byte-level BPE trained here on a built-in corpus, so any text
round-trips), tokenizer_config.json (with a chat template) and generation_config.json.
Tests load these files with both this engine and transformers; GPU benchmarks use the
architecture-sized presets. Tensors are generated and written shard by shard to bound memory.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
}

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]

# ChatML, with tools the way Qwen's templates show them: a system turn listing each tool's JSON
# and an assistant's earlier calls as <tool_call> JSON (without tools, plain ChatML).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A few paragraphs for the BPE trainer. The byte-level alphabet makes every text encodable;
# the corpus only decides which merges exist.
CORPUS = """\
The harbour town woke slowly. Fishing boats came in at six, their decks stacked with crates of
mackerel and cod, and the gulls followed them like a noisy escort. By seven the bakery on Quay
Street had sold its first hundred loaves, and the smell of bread drifted over the water.

A language model reads a prompt once, all at once, and then writes its answer one token at a
time. The first part is called prefill; it is limited by arithmetic. The second part is called
decode; it is limited by how fast the weights and the cache can be read from memory. Serving
systems that split the two phases can size each pool for its own latency objective.

Kubernetes runs containers on a cluster of machines. An operator watches custom resources and
creates Deployments, Services and ConfigMaps so that the cluster matches what the user asked
for. When the load grows, an autoscaler adds replicas; when it falls, replicas drain and exit.

Recipe for a quick tomato soup: soften one chopped onion and two cloves of garlic in olive oil,
add 800 g of tinned tomatoes, 500 ml of stock, a pinch of sugar and salt. Simmer for 20 minutes,
blend until smooth, and finish with basil, black pepper and a spoonful of cream.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

Numbers, dates and symbols appear everywhere: 3.14159, 2024-06-01, 42%, $19.99, user@example.org,
(x + y) * z = 7; {"key": [1, 2, 3]} <tag attr="v"/> #hash @mention ~tilde ^caret |pipe \\slash.
Questions? Answers! Lists: first, second, third. Quotes: 'single' and "double". The quick brown
fox jumps over the lazy dog while five boxing wizards jump quickly.
"""


@dataclass
class Preset:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None  # None: the trained tokenizer's size (rounded up to 64)
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str
    init_std: float
    head_dim: int | None = None
    bpe_vocab: int = 2048
    rope_scaling: dict[str, Any] | None = field(default=None)


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Tiny models use a small original context so that the llama3 scaling changes frequencies that
# matter inside test-sized sequences.
_TINY_LLAMA3_ROPE = dict(_LLAMA3_ROPE, original_max_position_embeddings=64)


def _tiny(arch: str, **kw: Any) -> Preset:
    """A few-MB model for tests: 2 layers, hidden 64, GQA, vocab = the trained tokenizer."""
    base: dict[str, Any] = dict(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=None, max_position_embeddings=1024,
        rope_theta=1000000.0, tie_word_embeddings=False, dtype="float32", init_std=0.1,
        bpe_vocab=512,
    )  # fmt: skip
    return Preset(**{**base, **kw})


PRESETS: dict[str, Preset] = {
    "tiny-llama": _tiny("llama", rope_theta=500000.0, rope_scaling=_TINY_LLAMA3_ROPE),
    "tiny-qwen2": _tiny("qwen2", intermediate_size=160, tie_word_embeddings=True),
    "tiny-qwen3": _tiny("qwen3", head_dim=32, tie_word_embeddings=True),
    "tiny-mistral": _tiny("mistral", num_kv_heads=1, rope_theta=10000.0),
    # ~58M parameters: CPU benchmarks.
    "small": Preset(
        arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        intermediate_size=1536, vocab_size=32000, max_position_embeddings=4096,
        rope_theta=500000.0, tie_word_embeddings=False, dtype="float32", init_std=0.02,
    ),
    # Shapes of public checkpoints (Qwen2.5-0.5B, Llama-3.1-8B), for GPU timing.
    "qwen-0.5b": Preset(
        arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=True, dtype="bfloat16", init_std=0.02,
    ),
    "llama-8b": Preset(
        arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16", init_std=0.02,
        rope_scaling=_LLAMA3_ROPE,
    ),
}  # fmt: skip


def build_tokenizer(bpe_vocab: int, add_bos: bool) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    bos_id = tok.token_to_id(BOS)
    if add_bos:  # Llama-style: BOS prepended by the post-processor
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def model_config_dict(
    p: Preset, vocab_size: int, bos_id: int, eos_ids: list[int]
) -> dict[str, Any]:
    arch_name, model_type = ARCHS[p.arch]
    head_dim = p.head_dim or p.hidden_size // p.num_heads
    cfg: dict[str, Any] = {
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-5 if p.arch in ("llama", "mistral") else 1e-6,
        "rope_theta": p.rope_theta,
        "rope_scaling": p.rope_scaling if p.arch == "llama" else None,
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": p.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "torch_dtype": p.dtype,
        "use_cache": True,
    }
    if p.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif p.arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
        if p.arch == "qwen3":
            cfg.update(attention_bias=False)
    elif p.arch == "mistral":
        cfg.update(sliding_window=None)
    return cfg


def tensor_plan(p: Preset, vocab_size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init kind) for every tensor, in checkpoint order."""
    h, i, L = p.hidden_size, p.intermediate_size, p.num_layers
    d = p.head_dim or h // p.num_heads
    q, kv = p.num_heads * d, p.num_kv_heads * d
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (vocab_size, h), "w")
    ]
    for n in range(L):
        pre = f"model.layers.{n}."
        plan += [
            (pre + "input_layernorm.weight", (h,), "norm"),
            (pre + "self_attn.q_proj.weight", (q, h), "w"),
            (pre + "self_attn.k_proj.weight", (kv, h), "w"),
            (pre + "self_attn.v_proj.weight", (kv, h), "w"),
        ]
        if p.arch == "qwen2":
            plan += [
                (pre + "self_attn.q_proj.bias", (q,), "w"),
                (pre + "self_attn.k_proj.bias", (kv,), "w"),
                (pre + "self_attn.v_proj.bias", (kv,), "w"),
            ]
        if p.arch == "qwen3":
            plan += [
                (pre + "self_attn.q_norm.weight", (d,), "norm"),
                (pre + "self_attn.k_norm.weight", (d,), "norm"),
            ]
        plan += [
            (pre + "self_attn.o_proj.weight", (h, q), "w"),
            (pre + "post_attention_layernorm.weight", (h,), "norm"),
            (pre + "mlp.gate_proj.weight", (i, h), "w"),
            (pre + "mlp.up_proj.weight", (i, h), "w"),
            (pre + "mlp.down_proj.weight", (h, i), "w"),
        ]
    plan.append(("model.norm.weight", (h,), "norm"))
    if not p.tie_word_embeddings:
        plan.append(("lm_head.weight", (vocab_size, h), "w"))
    return plan


# The weight files write_model itself names (one file, or shards with an index).
_OWN_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def write_model(
    preset_name: str,
    out: str | Path,
    arch: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    device: str = "cpu",
) -> Path:
    if preset_name not in PRESETS:
        raise ValueError(f"--preset: {preset_name!r} is not one of {', '.join(PRESETS)}")
    p = PRESETS[preset_name]
    if arch is not None:
        if arch not in ARCHS:
            raise ValueError(f"--arch: {arch!r} is not one of {', '.join(ARCHS)}")
        p = Preset(**{**p.__dict__, "arch": arch})
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: {dtype!r} is not one of float32, bfloat16, float16")
        p = Preset(**{**p.__dict__, "dtype": dtype})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Weights an earlier run left here (another seed, preset or shard size) go first: the loader
    # prefers model.safetensors.index.json, so a stale index would serve the old shards.
    for old in out.iterdir():
        if _OWN_WEIGHTS.fullmatch(old.name):
            old.unlink()

    add_bos = p.arch in ("llama", "mistral")
    tok = build_tokenizer(p.bpe_vocab, add_bos)
    tok_size = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = p.vocab_size or 64 * math.ceil(tok_size / 64)
    if vocab_size < tok_size:
        raise ValueError(f"preset {preset_name}: vocab_size {vocab_size} < tokenizer {tok_size}")
    tok.save(str(out / "tokenizer.json"))
    special = {t: tok.token_to_id(t) for t in (BOS, EOS, IM_END)}
    assert all(i is not None for i in special.values()), "special tokens missing"
    bos_id, eos_id, im_end_id = (int(special[t] or 0) for t in (BOS, EOS, IM_END))
    eos_ids = [eos_id, im_end_id]

    cfg = model_config_dict(p, vocab_size, bos_id, eos_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_ids}, indent=2) + "\n"
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": IM_END,
                "pad_token": EOS,
                "add_bos_token": add_bos,
                "model_max_length": p.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE
                if add_bos
                else CHAT_TEMPLATE[len("{{ bos_token }}") :],
            },
            indent=2,
        )
        + "\n"
    )
    _write_weights(p, vocab_size, out, seed, shard_bytes, device)
    return out


def _write_weights(
    p: Preset, vocab_size: int, out: Path, seed: int, shard_bytes: int, device: str
) -> None:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        p.dtype
    ]
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    plan = tensor_plan(p, vocab_size)
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * elem
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    total = sum(math.prod(s) * elem for _, s, _ in plan)
    gen = torch.Generator(device=device).manual_seed(seed)

    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="weights", disable=total < (256 << 20))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for shard, fname in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for name, shape, kind in shard:
            x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            # Norm weights near 1 (not exactly 1) so a mis-mapped norm changes the logits.
            x = 1.0 + 0.05 * x if kind == "norm" else x * p.init_std
            tensors[name] = x.to(torch_dtype).cpu().contiguous()
            weight_map[name] = fname
            bar.update(math.prod(shape) * elem)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=sorted(ARCHS), help="override the preset's family")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size-mb", type=int, default=2048)
    parser.add_argument(
        "--device", default="cpu", help="where to draw random numbers (cuda is much faster)"
    )


def run(args: argparse.Namespace) -> int:
    error = None
    if args.shard_size_mb < 1:
        error = f"--shard-size-mb: {args.shard_size_mb} must be at least 1"
    if not -(1 << 63) <= args.seed < (1 << 64):
        error = f"--seed: {args.seed} does not fit in 64 bits"
    try:
        torch.device(args.device)
    except RuntimeError:
        error = f"--device: {args.device!r} is not a torch device (cpu, cuda, cuda:N)"
    else:
        try:  # a well-formed name on a machine without that device: before anything is written
            torch.Generator(device=args.device)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = f"--device: {args.device} is not usable here: {reason}"
    if Path(args.out).exists() and not Path(args.out).is_dir():
        error = f"--out: {args.out} exists and is not a directory"
    if error:
        print(f"splitserve make-model: {error}", file=sys.stderr)
        return 2
    try:
        out = write_model(
            args.preset,
            args.out,
            arch=args.arch,
            dtype=args.dtype,
            seed=args.seed,
            shard_bytes=args.shard_size_mb << 20,
            device=args.device,
        )
    except OSError as e:  # no permission, disk full: one line, not a traceback
        print(f"splitserve make-model: --out: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    cfg = json.loads((out / "config.json").read_text())
    print(f"wrote {cfg['architectures'][0]} ({args.preset}) to {out}")
    return 0
