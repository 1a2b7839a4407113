"""Prefill on engine A (prefill_only + on_kv streaming, or export_kv), KV imported into reserved
blocks on engine B, decode on B: the same tokens as one engine doing both (in-process)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from splitserve_workers.engine import LLMEngine, Priority, SamplingParams, TokenOutput


class KVCollector:
    """on_kv target: keeps copies and checks every prompt token arrives once per layer."""

    def __init__(self, num_layers: int, num_tokens: int) -> None:
        self.chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.covered = torch.zeros(num_layers, num_tokens, dtype=torch.int32)

    def __call__(self, rid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert k.shape == v.shape and k.dim() == 3
        self.covered[layer, start : start + k.shape[0]] += 1
        self.chunks.append((layer, start, k.clone(), v.clone()))


def run(engine: LLMEngine) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def prefill_elsewhere(
    engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[TokenOutput, KVCollector]:
    """Prefill only on `engine`, collecting the streamed KV: (its one output, the collector)."""
    collector = KVCollector(engine.model_config.num_layers, len(prompt))
    engine.add_request(rid, prompt, params, prefill_only=True, on_kv=collector)
    (first,) = run(engine)
    return first, collector


def decode_on(engine: LLMEngine, rid: str, prompt: list[int], first: int,
              chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]],
              params: SamplingParams) -> list[int]:  # fmt: skip
    free = engine.stats().free_blocks
    assert engine.reserve(rid, len(prompt))
    assert engine.stats().free_blocks < free
    for layer, start, k, v in chunks:
        engine.import_kv(rid, layer, start, k, v)
    engine.start_decode(rid, prompt, first, params)
    outs = run(engine)
    assert all(o.request_id == rid for o in outs)
    assert outs[-1].finished
    assert engine.stats().free_blocks == engine.num_kv_blocks
    return [first] + [o.token_id for o in outs if o.token_id is not None]


@pytest.mark.parametrize(
    ("prefill_config", "params"),
    [
        ({}, SamplingParams(max_tokens=12, ignore_eos=True)),
        ({"max_batch_tokens": 10}, SamplingParams(max_tokens=12, ignore_eos=True)),  # chunked
        (
            {"block_size": 4},
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5),
        ),  # fmt: skip
    ],
    ids=["greedy", "chunked", "seeded-sampling"],
)
def test_streamed_kv_decodes_like_local(
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
    prefill_config: dict[str, int],
    params: SamplingParams,
) -> None:
    local = make_engine()
    prompt = prompt_ids(local, 29)
    expected = local.generate([prompt], params)[0]

    a = make_engine(**prefill_config)
    collector = KVCollector(a.model_config.num_layers, len(prompt))
    a.add_request("r1", prompt, params, prefill_only=True, on_kv=collector)
    outs = run(a)
    assert len(outs) == 1 and outs[0].finish_reason == "prefill_done" and outs[0].finished
    assert bool((collector.covered == 1).all())  # every prompt token, every layer, once
    assert a.stats().free_blocks == a.num_kv_blocks  # freed after the last on_kv

    b = make_engine(block_size=8)  # the decode side may page differently
    assert decode_on(b, "r1", prompt, outs[0].token_id, collector.chunks, params) == expected


def test_prefix_cache_hit_is_exported_from_the_cache(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = make_engine(block_size=4, max_batch_tokens=6)
    prompt = prompt_ids(a, 26)
    expected = make_engine().generate([prompt], params)[0]
    a.generate([prompt[:20] + prompt_ids(a, 3, salt=3)], params)  # warms 5 blocks

    collector = KVCollector(a.model_config.num_layers, len(prompt))
    a.add_request("r", prompt, params, prefill_only=True, on_kv=collector)
    outs = run(a)
    assert outs[0].num_cached_tokens == 20
    assert bool((collector.covered == 1).all())
    assert collector.chunks[0][1] == 0 and collector.chunks[0][2].shape[0] == 20
    b = make_engine()
    assert decode_on(b, "r", prompt, outs[0].token_id, collector.chunks, params) == expected


def test_export_kv_then_import(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = make_engine()
    prompt = prompt_ids(a, 18)
    expected = make_engine().generate([prompt], params)[0]
    a.add_request("r", prompt, params)
    first = a.step()[0].token_id
    assert first is not None
    chunks = []
    for layer in range(a.model_config.num_layers):
        k, v = a.export_kv("r", layer)
        assert k.shape == (18, a.model_config.num_kv_heads, a.model_config.head_dim)
        assert k.is_contiguous() and v.is_contiguous()
        chunks += [(layer, 0, k[:7], v[:7]), (layer, 7, k[7:], v[7:])]
    assert a.abort("r")
    assert [o.finish_reason for o in run(a)] == ["abort"]
    assert a.stats().free_blocks == a.num_kv_blocks
    b = make_engine()
    assert decode_on(b, "r", prompt, first, chunks, params) == expected


def test_multi_layer_import_equals_per_layer(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    """One import_kv call per token range carrying every layer ([layers, n, heads, dim]), as a
    decode worker does with a chunk that batches several layers, decodes like local prefill."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = make_engine(block_size=4)
    prompt = prompt_ids(a, 13)
    expected = make_engine().generate([prompt], params)[0]
    a.add_request("r", prompt, params)
    first = a.step()[0].token_id
    assert first is not None
    layers = [a.export_kv("r", layer) for layer in range(a.model_config.num_layers)]
    k = torch.stack([k for k, _ in layers])
    v = torch.stack([v for _, v in layers])
    assert a.abort("r")
    run(a)
    b = make_engine(block_size=4)
    free = b.stats().free_blocks
    assert b.reserve("r", len(prompt))
    # Two token ranges that cross block boundaries, each for all layers at once.
    b.import_kv("r", 0, 0, k[:, :6], v[:, :6])
    b.import_kv("r", 0, 6, k[:, 6:], v[:, 6:])
    b.start_decode("r", prompt, first, params)
    assert [first] + [o.token_id for o in run(b) if o.token_id is not None] == expected
    assert b.stats().free_blocks == free
    # A layer range that runs past the model is refused, naming the range.
    assert b.reserve("s", 4)
    with pytest.raises(ValueError, match=r"layer: \[1, "):
        b.import_kv("s", 1, 0, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="must match"):
        b.import_kv("s", 0, 0, k[:, :4], v[:1, :4])
    b.release("s")
    assert b.stats().free_blocks == free


def test_reserve_import_validation_and_release(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    b = make_engine(num_kv_blocks=6, block_size=4)
    mc = b.model_config
    kv = torch.zeros(4, mc.num_kv_heads, mc.head_dim)
    assert b.reserve("r", 10)  # 3 blocks (10 prompt tokens + the first generated token)
    assert b.stats().free_blocks == 3
    assert not b.reserve("too-big", 12)  # needs 4 blocks, 3 free
    with pytest.raises(ValueError, match="already in use"):
        b.reserve("r", 1)
    with pytest.raises(ValueError, match="layer"):
        b.import_kv("r", mc.num_layers, 0, kv, kv)
    with pytest.raises(ValueError, match="token_start"):
        b.import_kv("r", 0, 8, kv, kv)
    with pytest.raises(ValueError, match="shape"):
        b.import_kv("r", 0, 0, kv[:, :, :1], kv[:, :, :1])
    with pytest.raises(ValueError, match="dtype"):
        b.import_kv("r", 0, 0, kv.double(), kv.double())
    with pytest.raises(ValueError, match="no reservation"):
        b.import_kv("nope", 0, 0, kv, kv)
    b.import_kv("r", 0, 0, kv, kv)
    prompt = prompt_ids(b, 10)
    with pytest.raises(ValueError, match="missing KV"):
        b.start_decode("r", prompt, 5, SamplingParams())
    with pytest.raises(ValueError, match="reservation is for"):
        b.start_decode("r", prompt[:9], 5, SamplingParams())
    b.release("r")
    b.release("r")  # idempotent (a lease timer may race the error path)
    assert b.stats().free_blocks == 6
    assert b.reserve("r2", 3)
    assert b.abort("r2")  # a reservation can be aborted too; nothing is emitted
    assert b.step() == []
    assert b.stats().free_blocks == 6


def test_first_token_that_ends_the_request(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    b = make_engine()
    mc = b.model_config
    prompt = prompt_ids(b, 5)
    kv = torch.zeros(5, mc.num_kv_heads, mc.head_dim)
    for rid, params, first, reason in [
        ("eos", SamplingParams(), b.tokenizer.eos_token_ids[0], "stop"),
        ("one", SamplingParams(max_tokens=1), 42, "length"),
    ]:
        assert b.reserve(rid, 5)
        for layer in range(mc.num_layers):
            b.import_kv(rid, layer, 0, kv, kv)
        b.start_decode(rid, prompt, first, params)
        outs = run(b)
        assert [(o.token_id, o.finished, o.finish_reason) for o in outs] == [(None, True, reason)]
    assert b.stats().free_blocks == b.num_kv_blocks


def test_a_later_turn_imports_only_what_the_decode_cache_lacks(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    """Turn 2's prompt is turn 1's prompt and answer plus a new message. The decode engine
    generated that answer, so its prefix cache holds those blocks: the reservation shares them
    and only the rest is imported, and decode still equals one engine doing everything."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    local = make_engine()
    a = make_engine()
    b = make_engine(block_size=8)  # the decode side pages on its own
    layers = a.model_config.num_layers

    def prefill(rid: str, prompt: list[int]) -> tuple[int, KVCollector]:
        collector = KVCollector(layers, len(prompt))
        a.add_request(rid, prompt, params, prefill_only=True, on_kv=collector)
        (out,) = run(a)
        assert out.token_id is not None
        return out.token_id, collector

    first_turn = prompt_ids(a, 29)
    first, kv = prefill("t1", first_turn)
    answer = decode_on(b, "t1", first_turn, first, kv.chunks, params)
    second_turn = first_turn + answer + prompt_ids(a, 11, salt=1)
    first, kv = prefill("t2", second_turn)
    assert b.reserve("t2", len(second_turn), second_turn)
    cached = b.reserved_cached_tokens("t2")
    # Every whole block of turn 1's prompt and answer but the last generated token (its KV was
    # never computed): (29 + 12 - 1) // 8 blocks of 8.
    assert cached == (29 + 12 - 1) // 8 * 8 == 40
    for layer, start, k, v in kv.chunks:
        if start + k.shape[0] > cached:
            skip = max(0, cached - start)
            b.import_kv("t2", layer, start + skip, k[skip:], v[skip:])
    b.start_decode("t2", second_turn, first, params)
    got = [first] + [o.token_id for o in run(b) if o.token_id is not None]
    assert got == local.generate([second_turn], params)[0]
    assert b.stats().free_blocks == b.num_kv_blocks


def test_a_reservation_that_found_a_prefix_is_for_that_prompt_only(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    b = make_engine(block_size=4)
    prompt = prompt_ids(b, 10)
    b.add_request("warm", prompt, SamplingParams(max_tokens=1))
    run(b)  # its prompt's 2 whole blocks are in the prefix cache now
    assert b.reserve("r", 10, prompt)
    assert b.reserved_cached_tokens("r") == 8
    mc = b.model_config
    tail = torch.zeros(2, mc.num_kv_heads, mc.head_dim)
    for layer in range(mc.num_layers):
        b.import_kv("r", layer, 8, tail, tail)
    other = [t + 1 for t in prompt[:8]] + prompt[8:]
    with pytest.raises(ValueError, match="differ from the prompt the reservation found cached"):
        b.start_decode("r", other, 5, SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids: 9 tokens"):
        b.reserve("r2", 10, prompt[:9])
    b.release("r")
    assert b.stats().free_blocks == b.num_kv_blocks
    assert b.reserve("plain", 10) and b.reserved_cached_tokens("plain") == 0  # no ids, no lookup


def _reserve_whenever_free(
    engine: LLMEngine,
    prompt_ids: Callable[..., list[int]],
    long_priority: Priority,
    before_step: Callable[[], None] = lambda: None,
    must_finish: bool = True,
) -> int:
    """A decode worker under steady load: a 150-token sequence ("long", which does not fit
    beside the rest and gets preempted) and a 20-token interactive reservation started
    whenever blocks are free, until "long" finishes (400 steps at most; `must_finish`: fail
    then). Returns how many reservations started."""
    mc = engine.model_config
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("long", prompt_ids(engine, 150), params, priority=long_priority)
    started = 0
    for _ in range(400):
        before_step()
        rid, prompt = f"short-{started}", prompt_ids(engine, 20, salt=started + 1)
        if engine.reserve(rid, len(prompt)):
            kv = torch.zeros(mc.num_layers, len(prompt), mc.num_kv_heads, mc.head_dim)
            engine.import_kv(rid, 0, 0, kv, kv)
            engine.start_decode(rid, prompt, 5, SamplingParams(max_tokens=25, ignore_eos=True))
            started += 1
        if any(o.request_id == "long" and o.finished for o in engine.step()):
            break
    else:
        if must_finish:
            pytest.fail(f"the preempted sequence never finished ({started} reservations started)")
        engine.abort("long")
    run(engine)
    assert engine.stats().free_blocks == engine.num_kv_blocks
    return started


def test_a_preempted_sequence_is_not_starved_by_new_reservations(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # A sequence preempted on a decode worker (its KV dropped, to be recomputed) must still
    # come back: the reservations used to take every block it waited for, and it never
    # finished.
    engine = make_engine(num_kv_blocks=12, max_batch_tokens=64)
    _reserve_whenever_free(engine, prompt_ids, Priority.INTERACTIVE)
    assert engine.scheduler.preemptions_total > 0


def test_a_preempted_background_sequence_holds_back_only_background_reservations(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # The scheduler would preempt a background sequence for an interactive one anyway, so an
    # interactive reservation does not wait for it; a background one does (no starvation).
    engine = make_engine(num_kv_blocks=12, max_batch_tokens=64)
    checked = 0

    def check() -> None:
        nonlocal checked
        preempted = {s.priority for s in engine.scheduler.waiting if not s.block_table}
        if preempted == {Priority.BACKGROUND} and engine.stats().free_blocks >= 1:
            assert not engine.reserve(f"bg-{checked}", 1, priority=Priority.BACKGROUND)
            assert engine.reserve(f"int-{checked}", 1, priority=Priority.INTERACTIVE)
            engine.release(f"int-{checked}")
            checked += 1

    # Interactive reservations keep coming, so "long" may never finish: background work has
    # no aging (docs/engine.md).
    _reserve_whenever_free(engine, prompt_ids, Priority.BACKGROUND, check, must_finish=False)
    assert checked > 0, "the background sequence was never preempted with blocks free"
