"""Prompt logprobs (SamplingParams.prompt_logprobs, the API's echo + logprobs) against
transformers on the same files, and the same values however the prompt is computed: chunked,
after a request that would have filled the prefix cache, after preemption, and on a prefill
worker (prefill_only) while the decode side never recomputes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import LLMEngine, SamplingParams, TokenOutput
from transformers import AutoModelForCausalLM

TOP = 3


def reference(model_dir: Path, prompt: list[int]) -> tuple[list[float], list[list[int]]]:
    """Per prompt token after the first: its logprob and the TOP most likely ids before it."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    values = lp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()
    return values, lp.topk(TOP, dim=-1).indices.tolist()


def first_output(engine: LLMEngine, rid: str, prompt: list[int], **kw: object) -> TokenOutput:
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    engine.add_request(rid, prompt, params, **kw)
    outs: list[TokenOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    firsts = [o for o in outs if o.token_id is not None][:1]
    assert [o for o in outs if o.prompt_logprobs is not None] == firsts  # once, with token 1
    return firsts[0]


def check(out: TokenOutput, want: tuple[list[float], list[list[int]]]) -> None:
    assert out.prompt_logprobs is not None
    values, tops = want
    assert len(out.prompt_logprobs) == len(values)
    got = [v for v, _ in out.prompt_logprobs]
    assert got == pytest.approx(values, abs=2e-4)
    for (value, top), want_ids in zip(out.prompt_logprobs, tops, strict=True):
        assert top is not None and [t for t, _ in top] == want_ids
        assert all(v >= value - 1e-5 for _, v in top[:1])  # the top one is the most likely


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_prompt_logprobs_match_transformers(
    tiny_models: dict[str, Path],
    preset: str,
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
) -> None:
    engine = make_engine(tiny_models[preset])
    prompt = prompt_ids(engine, 37)
    want = reference(tiny_models[preset], prompt)
    check(first_output(engine, "whole", prompt), want)
    # Chunked over several passes (7 tokens each), with other prompts in the same passes.
    chunked = make_engine(tiny_models[preset], max_batch_tokens=7, max_batch_size=3)
    chunked.add_request("other", prompt_ids(chunked, 20, salt=1), SamplingParams(max_tokens=3))
    check(first_output(chunked, "chunked", prompt), want)


def test_prefix_cache_never_skips_the_rows_they_need(
    tiny_llama: Path, make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4)
    prompt = prompt_ids(engine, 37)
    want = reference(tiny_llama, prompt)
    engine.generate([prompt], SamplingParams(max_tokens=2))  # fills the prefix cache
    again = first_output(engine, "again", prompt)
    check(again, want)
    assert again.num_cached_tokens == 0
    # A request that does not ask still hits the cache.
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1))
    plain = [o for o in engine.step() if o.request_id == "plain"]
    assert plain[0].num_cached_tokens > 0


def test_preempted_prompt_gives_the_same_logprobs(
    tiny_llama: Path, make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # A background prompt part way through its chunked prefill is preempted by an
    # interactive one and computed again from the start.
    from splitserve_workers.engine import Priority

    engine = make_engine(num_kv_blocks=12, block_size=4, max_batch_tokens=8)
    prompt = prompt_ids(engine, 37)
    want = reference(tiny_llama, prompt)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    engine.add_request("bg", prompt, params, priority=Priority.BACKGROUND)
    outs = engine.step()  # the first chunk
    engine.add_request("fg", prompt_ids(engine, 30, salt=2), SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.stats().preemptions_total > 0
    (first,) = [o for o in outs if o.request_id == "bg" and o.prompt_logprobs is not None]
    check(first, want)


def test_prefill_worker_sends_them_and_decode_never_recomputes(
    tiny_llama: Path, make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    prefill, decode = make_engine(), make_engine()
    prompt = prompt_ids(prefill, 29)
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    prefill.add_request(
        "r", prompt, params, prefill_only=True,
        on_kv=lambda _r, layer, start, k, v: chunks.append((layer, start, k.clone(), v.clone())),
    )  # fmt: skip
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (first,) = outs
    assert first.finish_reason == "prefill_done" and first.prompt_logprobs is not None
    assert [v for v, _ in first.prompt_logprobs] == pytest.approx(
        reference(tiny_llama, prompt)[0], abs=2e-4
    )
    assert all(top is None for _, top in first.prompt_logprobs)  # 0 alternatives asked
    assert decode.reserve("r", len(prompt))
    for layer, start, k, v in chunks:
        decode.import_kv("r", layer, start, k, v)
    decode.start_decode("r", prompt, first.token_id, params)
    rest = []
    while decode.has_unfinished():
        rest += decode.step()
    assert rest and all(o.prompt_logprobs is None for o in rest)


def test_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs: 6 must be between 0 and 5"):
        SamplingParams(prompt_logprobs=6).validate()
