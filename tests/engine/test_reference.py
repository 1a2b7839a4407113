"""The engine against transformers on the same files: prefill and decode logits, greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, SamplingParams
from transformers import AutoModelForCausalLM

TINY_PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")

STEPS = 12


def engine_logits(
    engine: LLMEngine, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits that chose each of them (a spy on the model runner)."""
    runner = engine.model_runner
    seen: list[torch.Tensor] = []
    run_prefill, run_decode = runner.run_prefill, runner.run_decode

    def prefill(*args):  # type: ignore[no-untyped-def]
        logits, done, hidden = run_prefill(*args)
        seen.extend(logits.clone())
        return logits, done, hidden

    def decode(*args):  # type: ignore[no-untyped-def]
        logits = run_decode(*args)
        seen.extend(logits.clone())
        return logits

    runner.run_prefill, runner.run_decode = prefill, decode  # type: ignore[method-assign]
    tokens = engine.generate([prompt], SamplingParams(max_tokens=steps, ignore_eos=True))[0]
    return tokens, seen


def reference_logits(
    model_dir: Path, prompt: list[int], steps: int, dtype: torch.dtype
) -> tuple[list[int], list[torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # compare a fixed number of steps
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,  # raw logits of every step, before any processor
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].float() for step in out.logits]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_matches_transformers_float32(
    tiny_models: dict[str, Path], preset: str, prompt_ids: Callable[..., list[int]]
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_models[preset]), device="cpu", block_size=4))
    prompt = prompt_ids(engine, 37)
    ours, our_logits = engine_logits(engine, prompt, STEPS)
    ref, ref_logits = reference_logits(tiny_models[preset], prompt, STEPS, torch.float32)
    assert ours == ref
    assert len(our_logits) == STEPS
    for step, (a, b) in enumerate(zip(our_logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("tiny-llama", "bfloat16"), ("tiny-qwen3", "bfloat16"), ("tiny-qwen2", "float16")],
)
def test_matches_transformers_half_precision(
    tiny_models: dict[str, Path], preset: str, dtype: str, prompt_ids: Callable[..., list[int]]
) -> None:
    torch_dtype = getattr(torch, dtype)
    engine = LLMEngine(EngineConfig(model=str(tiny_models[preset]), device="cpu", dtype=dtype))
    assert engine.dtype == torch_dtype
    assert engine.model_runner.kv_cache.dtype == torch_dtype
    prompt = prompt_ids(engine, 21)
    ours, our_logits = engine_logits(engine, prompt, 4)
    ref, ref_logits = reference_logits(tiny_models[preset], prompt, 4, torch_dtype)
    # Half-precision rounding differs between kernels; compare the prefill step tightly enough
    # to catch a wrong formula (logits here spread over several units) and the first token.
    torch.testing.assert_close(our_logits[0], ref_logits[0], atol=0.1, rtol=0.05)
    assert ours[0] == ref[0]


@pytest.mark.parametrize(
    ("preset", "yarn"),
    [
        # Qwen2.5's documented long-context setting, on a small original context so that the
        # ramp between kept and slowed dimensions falls inside the tiny head.
        ("tiny-qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        # DeepSeek-style: the attention factor from mscale/mscale_all_dim, betas given.
        (
            "tiny-llama",
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
        ),
        # The attention factor given; no original context (the model's is taken).
        ("tiny-qwen3", {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}),
    ],
)
def test_yarn_rope_matches_transformers(
    tmp_path: Path,
    tiny_models: dict[str, Path],
    preset: str,
    yarn: dict[str, object],
    prompt_ids: Callable[..., list[int]],
) -> None:
    import json
    import shutil

    model_dir = tmp_path / preset
    shutil.copytree(tiny_models[preset], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = yarn
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", block_size=4))
    prompt = prompt_ids(engine, 150)  # past the original context
    ours, our_logits = engine_logits(engine, prompt, 4)
    ref, ref_logits = reference_logits(model_dir, prompt, 4, torch.float32)
    assert ours == ref
    for step, (a, b) in enumerate(zip(our_logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"step {step}")
    # The scaling is in effect: the same files without it give other logits.
    plain = LLMEngine(EngineConfig(model=str(tiny_models[preset]), device="cpu", block_size=4))
    assert not torch.allclose(engine_logits(plain, prompt, 1)[1][0], our_logits[0], atol=1e-3)


def test_yarn_serves_past_max_position_embeddings_as_transformers_computes(
    tmp_path: Path, tiny_models: dict[str, Path], prompt_ids: Callable[..., list[int]]
) -> None:
    # Qwen2.5's setting in small: max_position_embeddings is the original context, and YaRN
    # stretches it by its factor (128 x 4 = 512): a 300-token prompt is served, and matches.
    import json
    import shutil

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_models["tiny-qwen2"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 128
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config["rope_scaling"] = yarn
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", block_size=4))
    assert engine.model_config.max_model_len == 512
    prompt = prompt_ids(engine, 300)
    ours, our_logits = engine_logits(engine, prompt, 3)
    ref, ref_logits = reference_logits(model_dir, prompt, 3, torch.float32)
    assert ours == ref
    for step, (a, b) in enumerate(zip(our_logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"step {step}")
