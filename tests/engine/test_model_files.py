"""Real-world model-directory variants, checked against transformers reading the same files:
chat templates rendered exactly as transformers renders them (its tojson, loop controls, the
{% generation %} tag, chat_template.jinja), the family defaults of config.json keys a checkpoint
leaves out (Mistral's sliding window), the router's context limit, and missing-weight errors
in the checkpoint's own names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from splitserve_workers.engine import EngineConfig, LLMEngine, ModelConfig, Tokenizer
from splitserve_workers.engine.tokenizer import NoChatTemplate
from splitserve_workers.router.app import model_max_len
from transformers import AutoTokenizer

# Shapes real templates use (Llama 3.x, Qwen 2.5, Mistral tool templates, training templates).
TOJSON = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{{ m.content | tojson }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}</tools>"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOOP_CONTROLS = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% if m.content == 'stop' %}{% break %}{% endif %}"
    "{% endfor %}"
)
GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "A: {{ m.content }}<|im_end|>{% endgeneration %}{% else %}U: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Answer in °C, <b>tags</b> & 'quotes'."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "weather", "arguments": {"z": "Zürich", "a": "<&>"}},
            }
        ],
    },
    {"role": "tool", "content": {"temp": "20°C", "sky": "<sunny> & dry"}},
    {"role": "user", "content": "stop"},
    {"role": "user", "content": "never rendered after a break"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter → °C"}}]


def _with_template(src: Path, dst: Path, template: str, as_file: bool) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if as_file:
        # transformers 5 saves it this way: a file, and no key in tokenizer_config.json.
        cfg.pop("chat_template", None)
        (dst / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("as_file", [False, True], ids=["tokenizer_config", "jinja_file"])
@pytest.mark.parametrize("name", ["tojson", "loop_controls", "generation"])
def test_chat_templates_render_as_transformers_renders_them(
    tmp_path: Path, tiny_llama: Path, name: str, as_file: bool
) -> None:
    template = {"tojson": TOJSON, "loop_controls": LOOP_CONTROLS, "generation": GENERATION}[name]
    d = _with_template(tiny_llama, tmp_path / name, template, as_file)
    ours = Tokenizer(d).apply_chat_template(MESSAGES, tools=TOOLS)
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    if name == "tojson":  # the case jinja's own filter gets wrong
        assert '"temp": "20°C", "sky": "<sunny> & dry"' in ours
        assert '{"z": "Zürich", "a": "<&>"}' in ours  # key order kept, nothing escaped
    if name == "loop_controls":
        assert "system:" not in ours and "never rendered" not in ours


# A prefill that also occurs in what the template closes the turn with ("<" in "<|im_end|>"):
# the cut is where the content ends, not at that later copy.
@pytest.mark.parametrize("prefill", ["The weather in Paris is", "<", "\n", "e", "Paris "])
@pytest.mark.parametrize("name", ["tojson", "generation"])
def test_continue_final_message_cuts_as_transformers_does(
    tmp_path: Path, tiny_llama: Path, name: str, prefill: str
) -> None:
    template = {"tojson": TOJSON, "generation": GENERATION}[name]
    d = _with_template(tiny_llama, tmp_path / name, template, as_file=False)
    messages = [*MESSAGES, {"role": "assistant", "content": prefill}]
    ours = Tokenizer(d).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.endswith(prefill)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        Tokenizer(d).apply_chat_template(messages, continue_final_message=True)


def test_chat_template_file_wins_over_tokenizer_config(tmp_path: Path, tiny_llama: Path) -> None:
    d = _with_template(tiny_llama, tmp_path / "both", "from the file", as_file=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "from tokenizer_config.json"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d).apply_chat_template(MESSAGES) == "from the file"
    assert AutoTokenizer.from_pretrained(str(d)).chat_template == "from the file"


def test_a_model_without_a_chat_template_says_so(tmp_path: Path, tiny_llama: Path) -> None:
    d = shutil.copytree(tiny_llama, tmp_path / "plain")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(NoChatTemplate, match="no chat template.*chat_template.jinja"):
        Tokenizer(d).apply_chat_template(MESSAGES[:2])


def _config_variant(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_absent_config_keys_take_the_family_defaults_transformers_uses(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    from transformers import AutoConfig

    for preset in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"):
        d = _config_variant(
            tiny_models[preset],
            tmp_path / preset,
            sliding_window=None,
            max_position_embeddings=None,
            head_dim=None,
        )
        ours = ModelConfig.from_dir(d)
        hf = AutoConfig.from_pretrained(str(d))
        assert ours.max_position_embeddings == hf.max_position_embeddings, preset
        # Qwen3's default is 128, not hidden_size / num_attention_heads.
        assert ours.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
        assert ours.max_model_len == hf.max_position_embeddings, preset
        # A Mistral config without the key has transformers' 4096 window, in every layer.
        assert ours.sliding_window == getattr(hf, "sliding_window", None), preset
    mistral = ModelConfig.from_dir(tmp_path / "tiny-mistral")
    assert mistral.sliding_window == 4096 and mistral.sliding_layers == (0, 1)


@pytest.mark.parametrize(
    ("rope_scaling", "key"),
    [
        ({"type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            "original_max_position_embeddings",
        ),
    ],
)
def test_rope_scaling_without_its_numbers_is_refused_by_name(
    tmp_path: Path, tiny_llama: Path, rope_scaling: dict[str, object], key: str
) -> None:
    # Not a KeyError from deep in the model load: the key, in config.json's terms.
    d = _config_variant(tiny_llama, tmp_path / "m", rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=rf"^config\.json rope_scaling\.{key}: None must be"):
        ModelConfig.from_dir(d)


def test_router_context_limit_is_the_engines(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    d = _config_variant(
        tiny_models["tiny-mistral"], tmp_path / "window", sliding_window=16,
        max_position_embeddings=96,
    )  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(d), device="cpu", max_model_len=80))
    assert model_max_len(str(d)) == ModelConfig.from_dir(d).max_model_len == 96
    assert engine.model_config.max_model_len == 80


def test_missing_weights_are_named_as_the_checkpoint_names_them(
    tmp_path: Path, tiny_llama: Path
) -> None:
    d = shutil.copytree(tiny_llama, tmp_path / "missing")
    tensors = load_file(str(d / "model.safetensors"))
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.norm.weight"):  # fmt: skip
        del tensors[name]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        LLMEngine(EngineConfig(model=str(d), device="cpu"))
    message = str(info.value)
    assert "is missing weights" in message
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.norm.weight"):  # fmt: skip
        assert name in message
    assert "qkv_proj" not in message and "gate_up_proj" not in message
    assert "q_proj" not in message and "gate_proj" not in message  # those shards arrived


def test_which_tokenizers_spell_every_byte(tmp_path: Path, tiny_llama: Path) -> None:
    # What lets the router refuse a prompt by its size alone: with byte-level BPE or byte
    # fallback no token stands for more text than its own bytes; without, a run of unknown
    # characters can fold into one <unk>.
    from sentencepiece_tokenizers import sp_tokenizer

    assert Tokenizer(tiny_llama).spells_every_byte
    for style, expected in (("llama", True), ("metaspace", False)):
        d = tmp_path / style
        d.mkdir()
        sp_tokenizer(style, [("▁hello", -1.0)]).save(str(d / "tokenizer.json"))
        tok = Tokenizer(d)
        assert tok.spells_every_byte is expected, style
        if not expected:
            ids = tok.encode("☃☃☃☃☃☃", add_special_tokens=False)
            assert ids.count(0) == 1 and len(ids) <= 2  # six characters, one <unk>


def test_rope_scalings_the_engine_cannot_serve_are_refused_by_name(
    tmp_path: Path, tiny_llama: Path
) -> None:
    for kind in ("dynamic", "longrope"):
        d = _config_variant(tiny_llama, tmp_path / kind, rope_scaling={"rope_type": kind})
        with pytest.raises(ValueError, match=rf"rope_type: '{kind}' is not supported \(llama3"):
            ModelConfig.from_dir(d)
    # An empty rope_scaling is the default rope, as transformers reads it.
    d = _config_variant(tiny_llama, tmp_path / "empty", rope_scaling={})
    assert ModelConfig.from_dir(d).rope_scaling is None


def test_yarn_serves_the_context_it_stretches_to(tmp_path: Path, tiny_llama: Path) -> None:
    # Qwen2.5's documented setting: max_position_embeddings stays the original context and
    # YaRN's factor stretches it (32768 x 4 = 131072 there; 1024 x 4 here), as vLLM serves it.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    d = _config_variant(tiny_llama, tmp_path / "qwen", rope_scaling=yarn,
                        max_position_embeddings=1024)  # fmt: skip
    assert ModelConfig.from_dir(d).max_model_len == 4096
    # DeepSeek-style: max_position_embeddings already is the stretched length.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    d = _config_variant(tiny_llama, tmp_path / "ds", rope_scaling=yarn,
                        max_position_embeddings=1024)  # fmt: skip
    assert ModelConfig.from_dir(d).max_model_len == 1024
