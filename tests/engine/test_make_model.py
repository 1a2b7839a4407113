"""make-model writes loadable Hugging Face directories; the tokenizer round-trips text and
renders its chat template; sharded checkpoints load like single files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from splitserve_workers.cli import main as cli_main
from splitserve_workers.engine import (
    EngineConfig,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    Tokenizer,
)
from splitserve_workers.engine.make_model import PRESETS, write_model

TEXTS = [
    "The harbour town woke slowly.",
    "Ünïcödé, emoji 🚀🌊, CJK 漢字かな, tabs\tand\nnewlines, zero-width\u200bspace.",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # unseen words: xylophone quixotic",
    "",
]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_tiny_presets_load_and_generate(tiny_models: dict[str, Path], preset: str) -> None:
    d = tiny_models[preset]
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files  # fmt: skip
    assert sum(p.stat().st_size for p in d.iterdir()) < 5 << 20
    cfg = ModelConfig.from_dir(d)
    family = preset.removeprefix("tiny-")
    assert cfg.architecture.lower() == f"{family}forcausallm"
    assert cfg.qkv_bias == (preset == "tiny-qwen2")
    assert cfg.qk_norm == (preset == "tiny-qwen3")
    engine = LLMEngine(EngineConfig(model=str(d), device="cpu"))
    ids = engine.tokenizer.encode("Hello there, harbour!")
    out = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out) == 8 and all(0 <= t < cfg.vocab_size for t in out)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_tokenizer_round_trips_and_chat_template(tiny_models: dict[str, Path], preset: str) -> None:
    tok = Tokenizer(tiny_models[preset])
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    with_bos = tok.encode("hi")
    llama_like = preset == "tiny-llama"
    assert (with_bos[0] == tok.token_to_id("<|begin_of_text|>")) == llama_like
    assert len(tok.eos_token_ids) == 2
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    )
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
    expected += "<|im_start|>assistant\n"
    assert chat == ("<|begin_of_text|>" if llama_like else "") + expected
    ids = tok.encode(chat, add_special_tokens=False)
    assert tok.token_to_id("<|im_start|>") in ids  # special tokens are single tokens
    assert tok.decode(ids, skip_special_tokens=False) == chat
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(["not a message"])  # type: ignore[list-item]


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, tiny_llama: Path) -> None:
    sharded = write_model("tiny-llama", tmp_path / "sharded", seed=1, shard_bytes=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    with safe_open(str(sharded / shards[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    single = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu"))
    split = LLMEngine(EngineConfig(model=str(sharded), device="cpu"))
    assert split.generate([prompt], params) == single.generate([prompt], params)


def test_cli_arch_and_dtype_override(tmp_path: Path) -> None:
    out = tmp_path / "m"
    rc = cli_main(["make-model", "--preset", "tiny-llama", "--arch", "qwen3", "--dtype",
                   "bfloat16", "--seed", "3", "--out", str(out)])  # fmt: skip
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
        assert "model.layers.0.self_attn.q_norm.weight" in set(f.keys())
    engine = LLMEngine(EngineConfig(model=str(out), device="cpu"))
    assert engine.dtype.is_floating_point  # float32 on CPU under "auto"
    with pytest.raises(ValueError, match="--preset"):
        write_model("huge", tmp_path / "x")


@pytest.mark.parametrize(
    ("flags", "field"),
    [(["--shard-size-mb", "0"], "--shard-size-mb"), (["--device", "tpu"], "--device")],
)
def test_cli_bad_flag_exits_2_naming_it(
    tmp_path: Path, flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    assert cli_main(["make-model", "--preset", "tiny-llama", "--out", str(out), *flags]) == 2
    assert capsys.readouterr().err.startswith(f"splitserve make-model: {field}: ")
    assert not out.exists()


def test_big_presets_have_the_advertised_shapes() -> None:
    def params(name: str) -> int:
        p = PRESETS[name]
        cfg = ModelConfig(
            architecture="LlamaForCausalLM", hidden_size=p.hidden_size, num_layers=p.num_layers,
            num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
            head_dim=p.head_dim or p.hidden_size // p.num_heads,
            intermediate_size=p.intermediate_size, vocab_size=p.vocab_size or 0,
            rms_norm_eps=1e-5, rope_theta=p.rope_theta, max_position_embeddings=1,
            max_model_len=1, tie_word_embeddings=p.tie_word_embeddings,
        )  # fmt: skip
        return cfg.num_params()

    assert 50e6 <= params("small") <= 100e6
    assert 0.45e9 <= params("qwen-0.5b") <= 0.55e9
    assert 7.9e9 <= params("llama-8b") <= 8.1e9


def test_rewriting_a_directory_leaves_no_stale_weights(tmp_path: Path) -> None:
    # The loader prefers model.safetensors.index.json: a sharded model rewritten as one file
    # (or with another seed) used to keep serving the old shards through the old index.
    out = tmp_path / "m"
    write_model("tiny-llama", out, seed=1, shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").exists()
    write_model("tiny-llama", out, seed=2)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    fresh = write_model("tiny-llama", tmp_path / "fresh", seed=2)
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rewritten = LLMEngine(EngineConfig(model=str(out), device="cpu"))
    clean = LLMEngine(EngineConfig(model=str(fresh), device="cpu"))
    assert rewritten.generate([prompt], params) == clean.generate([prompt], params)


def test_cli_unusable_device_or_seed_exits_2_writing_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    # A valid device name this machine lacks failed at the first weight, after config.json and
    # tokenizer.json were written: a directory the workers' start-up checks took for a model.
    # xpu: torch's CPU and CUDA wheels (what this project installs) never carry XPU support.
    assert (
        cli_main(["make-model", "--preset", "tiny-llama", "--out", str(out), "--device", "xpu"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("splitserve make-model: --device: xpu is not usable here: "), err
    assert "Traceback" not in err and not out.exists()
    assert (
        cli_main(["make-model", "--preset", "tiny-llama", "--out", str(out), "--seed", str(2**64)])
        == 2
    )
    assert capsys.readouterr().err.startswith("splitserve make-model: --seed: ")
    assert not out.exists()
