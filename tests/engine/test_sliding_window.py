"""Sliding-window attention (Mistral; Qwen2/Qwen3 with use_sliding_window) against transformers
on the same files, past the window: every layer windowed, some layers windowed, and windowed
runs that batch, chunk, hit the prefix cache or move KV between engines giving the same tokens
as one at a time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from test_disaggregation import KVCollector, decode_on, run
from test_reference import STEPS, engine_logits, reference_logits

WINDOW = 16

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    # every layer slides
    "mistral": ("tiny-mistral", {"sliding_window": WINDOW}),
    # layers from max_window_layers on slide (here the second of two)
    "qwen2-upper-layers": (
        "tiny-qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # layer_types decides (here the first of two)
    "qwen3-layer-types": (
        "tiny-qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


@pytest.fixture(scope="module")
def windowed_models(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = {}
    for name, (preset, changes) in VARIANTS.items():
        d = Path(shutil.copytree(tiny_models[preset], tmp_path_factory.mktemp(name) / "model"))
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


def test_windowed_layers_follow_the_config(windowed_models: dict[str, Path]) -> None:
    layers = {n: ModelConfig.from_dir(d).sliding_layers for n, d in windowed_models.items()}
    assert layers == {"mistral": (0, 1), "qwen2-upper-layers": (1,), "qwen3-layer-types": (0,)}
    for d in windowed_models.values():
        cfg = ModelConfig.from_dir(d)
        # Served to max_position_embeddings, not cut to the window.
        assert cfg.sliding_window == WINDOW and cfg.max_model_len == 1024


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers_past_the_window(
    windowed_models: dict[str, Path], name: str, prompt_ids: Callable[..., list[int]]
) -> None:
    d = windowed_models[name]
    engine = LLMEngine(EngineConfig(model=str(d), device="cpu", block_size=4))
    prompt = prompt_ids(engine, 37)  # 37 + 12 tokens: every step is past the 16-token window
    ours, our_logits = engine_logits(engine, prompt, STEPS)
    ref, ref_logits = reference_logits(d, prompt, STEPS, torch.float32)
    assert ours == ref
    for step, (a, b) in enumerate(zip(our_logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"step {step}")
    # The window matters here: the same weights without it give other logits.
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(sliding_window=None, use_sliding_window=False)
    full = Path(shutil.copytree(d, d.parent / "full"))
    (full / "config.json").write_text(json.dumps(cfg))
    _, full_logits = engine_logits(
        LLMEngine(EngineConfig(model=str(full), device="cpu", block_size=4)), prompt, STEPS
    )
    assert (full_logits[0] - our_logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "options",
    [
        {"max_batch_tokens": 7},  # prompts chunked across passes, chunks sharing passes
        {"max_batch_tokens": 40, "max_batch_size": 3, "block_size": 8},
        {"max_batch_tokens": 12, "max_batch_size": 3, "enable_mixed_batches": True},
    ],
)
def test_batched_and_chunked_windowed_runs_equal_one_at_a_time(
    windowed_models: dict[str, Path], options: dict, prompt_ids: Callable[..., list[int]]
) -> None:
    d = str(windowed_models["qwen2-upper-layers"])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = LLMEngine(EngineConfig(model=d, device="cpu", max_batch_size=1))
    prompts = [prompt_ids(alone, n, salt=n) for n in (5, 15, 16, 17, 30, 45)]
    expected = [alone.generate([p], params)[0] for p in prompts]
    batched = LLMEngine(EngineConfig(model=d, device="cpu", **options))
    assert batched.generate(prompts, params) == expected


def test_prefix_cache_hits_and_kv_transfer_past_the_window(
    windowed_models: dict[str, Path], prompt_ids: Callable[..., list[int]]
) -> None:
    d = str(windowed_models["mistral"])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=d, device="cpu", enable_prefix_caching=False))
    shared = prompt_ids(plain, 40)
    a, b = shared + prompt_ids(plain, 5, salt=1), shared + prompt_ids(plain, 9, salt=2)
    expected = plain.generate([a, b], params)

    cached = LLMEngine(EngineConfig(model=d, device="cpu", block_size=8))
    assert cached.generate([a], params)[0] == expected[0]
    assert cached.generate([b], params)[0] == expected[1]
    assert cached.stats().prefix_cache_hits_total > 0

    # Prefill on one engine, KV streamed layer by layer, decode on another (other paging).
    prefill = LLMEngine(EngineConfig(model=d, device="cpu", max_batch_tokens=16))
    collector = KVCollector(prefill.model_config.num_layers, len(a))
    prefill.add_request("r1", a, params, prefill_only=True, on_kv=collector)
    (out,) = run(prefill)
    decode = LLMEngine(EngineConfig(model=d, device="cpu", block_size=4))
    assert decode_on(decode, "r1", a, out.token_id, collector.chunks, params) == expected[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculative_decoding_past_the_window_equals_plain(
    windowed_models: dict[str, Path], variant: str
) -> None:
    """A speculative pass (the last token and its drafts as one chunk) masks the window as a
    one-token step does."""
    from test_speculative import GREEDY, _prompts, _run

    d = str(windowed_models[variant])
    plain = LLMEngine(EngineConfig(model=d, device="cpu", block_size=4))
    spec = LLMEngine(EngineConfig(model=d, device="cpu", block_size=4, speculative_tokens=4))
    prompts = _prompts(plain)
    assert _run(spec, prompts, [GREEDY] * 5) == _run(plain, prompts, [GREEDY] * 5)
    assert spec.stats().accepted_tokens_total > 0
