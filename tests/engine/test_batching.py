"""Batched, paged, chunked, continuously batched and prefix-cached runs give the same greedy
tokens as one-request-at-a-time runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from splitserve_workers.engine import LLMEngine, SamplingParams

LENGTHS = (5, 16, 23, 40, 9)
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture
def prompts(make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]):  # type: ignore[no-untyped-def]
    engine = make_engine()
    return [prompt_ids(engine, n, salt=i) for i, n in enumerate(LENGTHS)]


@pytest.fixture
def one_at_a_time(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]]
) -> list[list[int]]:
    engine = make_engine(enable_prefix_caching=False, max_batch_size=1)
    return [engine.generate([p], PARAMS)[0] for p in prompts]


@pytest.mark.parametrize(
    "config",
    [
        {},  # one batched prefill, then all decode together
        {"block_size": 4},
        {"block_size": 1},
        {"max_batch_tokens": 7},  # every prompt but one is chunked, chunks share passes
        {"max_batch_size": 2},  # sequences join as others finish
        {"max_batch_tokens": 16, "max_batch_size": 3, "block_size": 8},
        {"max_batch_tokens": 12, "max_batch_size": 3, "enable_mixed_batches": True},
    ],
    ids=["batched", "block4", "block1", "chunked", "continuous", "limits", "mixed-passes"],
)
def test_same_tokens_as_one_at_a_time(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    one_at_a_time: list[list[int]],
    config: dict[str, int],
) -> None:
    engine = make_engine(**config)
    assert engine.generate(prompts, PARAMS) == one_at_a_time
    assert engine.stats().free_blocks == engine.num_kv_blocks


def test_batch_size_and_token_budget_are_respected(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]]
) -> None:
    engine = make_engine(max_batch_tokens=16, max_batch_size=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    seen_prefill = seen_decode = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        assert s.batch_size <= 3
        assert s.num_prefill_tokens <= 16
        assert s.num_running <= 3
        seen_prefill += s.num_prefill_tokens
        seen_decode += s.num_decode_tokens
    assert seen_prefill == sum(LENGTHS)
    assert seen_decode == len(LENGTHS) * (PARAMS.max_tokens - 1)


def test_prefix_cache_hits_give_same_tokens(
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
) -> None:
    engine = make_engine(block_size=4)
    shared = prompt_ids(engine, 20, salt=7)
    a = shared + prompt_ids(engine, 5, salt=8)
    b = shared + prompt_ids(engine, 6, salt=9)
    reference = make_engine(enable_prefix_caching=False).generate([a, b], PARAMS)

    first = engine.generate([a], PARAMS)[0]
    engine.add_request("b", b, PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [first, [o.token_id for o in outs]] == reference
    assert outs[0].num_cached_tokens == 20  # five full shared blocks reused
    s = engine.stats()
    assert s.prefix_cache_hits_total == 5
    assert s.prefix_cache_queries_total >= 5 + 6  # a's 6 full blocks were queried too
    # The identical prompt again: everything but the block holding the last token is reused.
    engine.add_request("a2", a, PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 24
    assert [o.token_id for o in outs] == reference[0]
    assert engine.stats().free_blocks == engine.num_kv_blocks


def test_prefix_cache_survives_in_free_blocks_until_evicted(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=12)
    a = prompt_ids(engine, 17, salt=1)
    engine.generate([a], SamplingParams(max_tokens=1))
    engine.add_request("again", a, SamplingParams(max_tokens=1))
    assert engine.step()[0].num_cached_tokens == 16
    # Fill the whole cache with other prompts: the old blocks are evicted and reused.
    for i in range(3):
        engine.generate([prompt_ids(engine, 40, salt=10 + i)], SamplingParams(max_tokens=1))
    engine.add_request("evicted", a, SamplingParams(max_tokens=1))
    assert engine.step()[0].num_cached_tokens == 0
    assert engine.stats().free_blocks == 12


def test_mixed_batches_keep_decoding_during_a_long_prefill(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(max_batch_tokens=8, enable_mixed_batches=True)
    short, long = prompt_ids(engine, 4), prompt_ids(engine, 40, salt=1)
    reference = make_engine().generate([short, long], PARAMS)
    engine.add_request("short", short, PARAMS)
    engine.step()  # short prefilled (its first token is not collected): it decodes from now on
    engine.add_request("long", long, PARAMS)
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    mixed_steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].append(o.token_id)  # type: ignore[arg-type]
        s = engine.stats()
        assert s.num_prefill_tokens + s.num_decode_tokens <= 8
        mixed_steps += s.num_prefill_tokens > 0 and s.num_decode_tokens > 0
    assert mixed_steps >= 5  # the 40-token prompt took 5+ passes, short decoded in each
    assert engine.stats().free_blocks == engine.num_kv_blocks
    assert tokens["short"] == reference[0][1:] and tokens["long"] == reference[1]
