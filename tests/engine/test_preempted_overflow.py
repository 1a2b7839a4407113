"""A sequence preempted after its last token went past the whole cache's capacity can never be
re-admitted: it finishes with "length" (as it would have running) instead of stalling the queue."""

from __future__ import annotations

from collections.abc import Callable

from splitserve_workers.engine import LLMEngine, SamplingParams


def test_preempted_sequence_longer_than_the_cache_finishes(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=8)  # 32 tokens in all
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    engine.add_request("long", prompt_ids(engine, 23), params)
    engine.add_request("short", prompt_ids(engine, 5, salt=1), SamplingParams(max_tokens=2))
    outs = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        seq = engine._seqs.get("long")
        if seq is not None and seq.num_tokens == 33:  # 8 full blocks + the newest token
            engine.scheduler.preempt(seq)  # as a newer request's block need would
        outs += engine.step()
    assert not engine.has_unfinished(), "the engine stalled"
    done = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert done == {"long": "length", "short": "length"}
    assert sum(1 for o in outs if o.request_id == "long" and o.token_id is not None) == 10
    assert engine.stats().free_blocks == engine.num_kv_blocks
