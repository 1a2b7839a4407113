"""Logit bias and repetition/frequency/presence penalties (SamplingParams), against transformers
on the same files: its own `generate(repetition_penalty=...)`, and for OpenAI's penalties and
bias (which transformers lacks) a step-by-step reference over its logits with OpenAI's formula.
Also: the same tokens in a mixed batch and across a prefill -> decode KV handoff (the first
token is sampled on one engine, the rest on another), and clear errors for bad values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import LLMEngine, SamplingParams
from transformers import AutoModelForCausalLM, GenerationConfig

STEPS = 12


def model_of(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens with `params`' bias and penalties applied to transformers' logits:
    bias added, repetition penalty over prompt + output, then OpenAI's
    `logit -= count * frequency_penalty + (count > 0) * presence_penalty` over the output."""
    model = model_of(model_dir)
    ids = list(prompt)
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        rep = params.repetition_penalty
        for token in set(ids):
            x = logits[token]
            logits[token] = x * rep if x < 0 else x / rep
        out = ids[len(prompt) :]
        for token in set(out):
            logits[token] -= out.count(token) * params.frequency_penalty + params.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
    return out


def greedy(**kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", STEPS)
    return SamplingParams(ignore_eos=True, **kw)  # type: ignore[arg-type]


def favoured_prompt(engine: LLMEngine, base: list[int]) -> list[int]:
    """`base` and then its own greedy continuation: a prompt that already holds the tokens
    the model favours next, so whether a penalty counts prompt tokens changes the output."""
    return base + run(engine, {"c": (base, greedy(max_tokens=6))})["c"]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_repetition_penalty_matches_transformers_generate(
    tiny_models: dict[str, Path],
    preset: str,
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
) -> None:
    engine = make_engine(tiny_models[preset])
    prompt = favoured_prompt(engine, prompt_ids(engine, 9))
    want = (
        model_of(tiny_models[preset])
        .generate(
            torch.tensor([prompt]),
            generation_config=GenerationConfig(
                max_new_tokens=STEPS,
                min_new_tokens=STEPS,
                do_sample=False,
                repetition_penalty=1.8,
                eos_token_id=None,
                pad_token_id=0,
            ),
        )[0, len(prompt) :]
        .tolist()
    )
    got = run(engine, {"r": (prompt, greedy(repetition_penalty=1.8))})["r"]
    assert got == want
    assert got == reference(tiny_models[preset], prompt, greedy(repetition_penalty=1.8))
    plain = run(engine, {"p": (prompt, greedy())})["p"]
    assert got != plain  # the penalty changed what greedy picks: the check above can fail


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_openai_penalties_and_bias_match_the_reference(
    tiny_models: dict[str, Path],
    preset: str,
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
) -> None:
    engine = make_engine(tiny_models[preset])
    prompt = favoured_prompt(engine, prompt_ids(engine, 11, salt=1))
    plain = run(engine, {"p": (prompt, greedy())})["p"]
    cases = {
        "frequency": greedy(frequency_penalty=1.5),
        "presence": greedy(presence_penalty=2.0),
        "negative": greedy(frequency_penalty=-0.7, presence_penalty=-0.3),
        "bias": greedy(logit_bias={plain[0]: -3.0, plain[1]: 2.5, prompt[0]: 1.0}),
        "all": greedy(
            frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.3,
            logit_bias={plain[2]: -2.0},
        ),
    }  # fmt: skip
    got = run(engine, {name: (prompt, params) for name, params in cases.items()})
    for name, params in cases.items():
        assert got[name] == reference(tiny_models[preset], prompt, params), name
    assert sum(got[name] != plain for name in cases) >= 3  # most of them changed the text


def test_logit_bias_forces_and_bans(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    prompt = prompt_ids(engine, 8, salt=2)
    plain = run(engine, {"p": (prompt, greedy())})["p"]
    forced = 77 if 77 not in plain else 78
    banned = set(plain)
    out = run(
        engine,
        {
            "force": (prompt, greedy(logit_bias={forced: 100.0})),
            # Sampled at temperature 1 too: -100 leaves a banned token e^-100 of a chance.
            "ban": (prompt, greedy(logit_bias=dict.fromkeys(banned, -100.0))),
            "ban-sampled": (
                prompt,
                greedy(logit_bias=dict.fromkeys(banned, -100.0), temperature=1.0, seed=3),
            ),
        },
    )
    assert out["force"] == [forced] * STEPS
    assert out["ban"] and not banned & set(out["ban"])
    assert out["ban-sampled"] and not banned & set(out["ban-sampled"])


def test_seeded_sampling_with_penalties_is_reproducible_in_any_batch(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    prompt = prompt_ids(engine, 10, salt=3)
    params = greedy(temperature=0.8, seed=11, frequency_penalty=1.0, repetition_penalty=1.2)
    alone = run(engine, {"a": (prompt, params)})["a"]
    crowd = run(
        engine,
        {
            "x": (prompt_ids(engine, 7, salt=4), greedy()),
            "a": (prompt, params),
            "y": (prompt_ids(engine, 13, salt=5), greedy(presence_penalty=1.0)),
        },
    )
    assert crowd["a"] == alone


def test_penalties_continue_across_the_kv_handoff(
    tiny_llama: Path, make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Disaggregated: the prefill engine samples the first token (bias and repetition penalty
    # over the prompt apply), the decode engine the rest, counting that first token as output.
    prefill, decode = make_engine(), make_engine()
    prompt = favoured_prompt(prefill, prompt_ids(prefill, 9, salt=6))
    params = greedy(frequency_penalty=1.2, presence_penalty=0.5, repetition_penalty=1.4)
    params.logit_bias = {run(prefill, {"p": (prompt, greedy())})["p"][0]: -4.0}
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    prefill.add_request(
        "r", prompt, params, prefill_only=True,
        on_kv=lambda _r, layer, start, k, v: chunks.append((layer, start, k.clone(), v.clone())),
    )  # fmt: skip
    firsts = []
    while prefill.has_unfinished():
        firsts += [o.token_id for o in prefill.step() if o.request_id == "r"]
    assert decode.reserve("r", len(prompt))
    for layer, start, k, v in chunks:
        decode.import_kv("r", layer, start, k, v)
    decode.start_decode("r", prompt, firsts[0], params)
    rest: list[int] = []
    while decode.has_unfinished():
        rest += [o.token_id for o in decode.step() if o.token_id is not None]
    assert firsts[:1] + rest == reference(tiny_llama, prompt, params)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty: 2.5 must be between -2.0 and 2.0"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty: nan must be between"),
        ({"repetition_penalty": 0.0}, "repetition_penalty: 0.0 must be between 0.01 and 10.0"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty: 1e-40 must be between 0.01"),
        ({"repetition_penalty": 11.0}, "repetition_penalty: 11.0 must be between 0.01 and 10.0"),
        ({"logit_bias": {5: 101.0}}, "logit_bias: 101.0 for token 5 must be between"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias: token id -1 is outside the vocabulary"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias: 301 tokens, at most 300"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SamplingParams(**kw).validate()


def test_a_bias_outside_the_models_vocabulary_is_refused(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {vocab} is outside"):
        engine.add_request("r", prompt_ids(engine, 4), greedy(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished()


def test_the_workers_and_the_router_take_the_same_values() -> None:
    from splitserve_workers.engine import sampling
    from splitserve_workers.proto import serving_pb2 as pb
    from splitserve_workers.router import openai_api as api
    from splitserve_workers.worker_runtime import sampling_from_proto

    # The router repeats the engine's bounds (it must not import torch to know them).
    assert (
        api.MAX_PENALTY, api.MIN_REPETITION_PENALTY, api.MAX_REPETITION_PENALTY,
        api.MAX_LOGIT_BIAS, api.MAX_LOGIT_BIAS_TOKENS,
    ) == (
        sampling.MAX_PENALTY, sampling.MIN_REPETITION_PENALTY, sampling.MAX_REPETITION_PENALTY,
        sampling.MAX_LOGIT_BIAS, sampling.MAX_LOGIT_BIAS_TOKENS,
    )  # fmt: skip
    params = sampling_from_proto(
        pb.SamplingParams(max_tokens=3, frequency_penalty=0.5, logit_bias={7: -2.0})
    )
    assert params.repetition_penalty == 1.0  # the proto's unset 0 is "off"
    assert (params.frequency_penalty, params.logit_bias) == (0.5, {7: -2.0})
    with pytest.raises(ValueError, match=r"sampling\.presence_penalty: 3\.0 must be between"):
        sampling_from_proto(pb.SamplingParams(max_tokens=3, presence_penalty=3.0))
    with pytest.raises(ValueError, match=r"sampling\.logit_bias: 301 tokens, at most 300"):
        sampling_from_proto(
            pb.SamplingParams(max_tokens=3, logit_bias=dict.fromkeys(range(301), 1))
        )


def test_the_bounds_survive_the_protos_float32() -> None:
    """The router accepts repetition_penalty 0.01 (the bound); the proto carries float32, where
    0.01 is 0.0099999998: every such request was refused by the prefill worker (INVALID_ARGUMENT,
    retried 3 times, then a 502 upstream_error)."""
    from splitserve_workers.proto import serving_pb2 as pb
    from splitserve_workers.worker_runtime import sampling_from_proto

    params = sampling_from_proto(pb.SamplingParams(max_tokens=1, repetition_penalty=0.01))
    assert params.repetition_penalty == 0.01
    with pytest.raises(ValueError, match=r"sampling\.repetition_penalty: 0\.0098"):
        sampling_from_proto(pb.SamplingParams(max_tokens=1, repetition_penalty=0.0099))


def test_the_smallest_repetition_penalty_keeps_the_batch_sampling(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    """A logit divided by a tiny penalty overflows to inf and softmax gives NaN, which failed
    every request of the batch; the bound keeps it finite, and the neighbour finishes."""
    engine = make_engine()
    prompt = prompt_ids(engine, 8)
    out = {}
    engine.add_request("other", prompt, greedy(temperature=0.8, seed=1, max_tokens=4))
    engine.add_request("tiny", prompt, greedy(temperature=1.0, repetition_penalty=0.01))
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.finish_reason
    assert out == {"other": "length", "tiny": "length"}


def test_the_kept_penalty_state_equals_the_whole_history() -> None:
    """PenaltyState adds only new tokens each step; the result equals a fresh one's."""
    from splitserve_workers.engine.sampling import PenaltyState, adjust_logits

    gen = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(logit_bias={3: 5.0}),
        SamplingParams(),
    ]
    histories = [([1, 2, 2, 3], 2), ([4, 5], 2), ([6], 1)]
    states: list[PenaltyState | None] = [PenaltyState(), PenaltyState(), None]
    for step in range(6):
        logits = torch.randn(3, vocab, generator=gen) * 4
        kept = adjust_logits(logits, params, histories, states)
        fresh = adjust_logits(logits, params, histories)
        assert torch.equal(kept, fresh)
        for ids, _ in histories:
            ids.append(int(torch.randint(vocab, (1,), generator=gen)) if step % 2 else ids[-1])
