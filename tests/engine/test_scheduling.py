"""Block accounting, preemption, priority, sampling seeds, stop conditions and input errors."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from splitserve_workers.engine import LLMEngine, Priority, SamplingParams, TokenOutput
from splitserve_workers.engine.sampling import GREEDY_BELOW, argmax_rows

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def drain(engine: LLMEngine) -> dict[str, list[TokenOutput]]:
    outs: dict[str, list[TokenOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def record_victims(engine: LLMEngine) -> list[str]:
    """The request ids the scheduler preempts from now on, in order."""
    victims: list[str] = []
    preempt = engine.scheduler.preempt

    def spy(seq):  # type: ignore[no-untyped-def]
        victims.append(seq.request_id)
        preempt(seq)

    engine.scheduler.preempt = spy  # type: ignore[method-assign]
    return victims


def test_free_blocks_return_after_requests_aborts_releases_and_errors(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=40, max_batch_tokens=24, max_batch_size=4)
    total = engine.stats().free_blocks
    assert total == 40
    rng = random.Random(3)
    mc = engine.model_config
    finished: dict[str, str] = {}
    live: set[str] = set()

    def failing_on_kv(rid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise RuntimeError("peer went away")

    for i in range(60):
        action = rng.random()
        rid = f"r{i}"
        if action < 0.45:
            params = SamplingParams(
                max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 1.0]), seed=i
            )
            prio = rng.choice(list(Priority))
            engine.add_request(rid, prompt_ids(engine, rng.randint(1, 30), salt=i), params, prio)
            live.add(rid)
        elif action < 0.55:
            engine.add_request(rid, prompt_ids(engine, 9, salt=i), GREEDY, on_kv=failing_on_kv)
            live.add(rid)
        elif action < 0.7 and live:
            engine.abort(rng.choice(sorted(live)))
        elif action < 0.8:
            if engine.reserve(rid, rng.randint(1, 12)):
                if rng.random() < 0.5:
                    engine.release(rid)
                else:
                    assert engine.abort(rid)
        elif action < 0.85:
            with pytest.raises(ValueError):
                engine.add_request(rid, [], GREEDY)
        for _ in range(rng.randint(0, 3)):
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = o.finish_reason or ""
                    live.discard(o.request_id)
    for rid, outs in drain(engine).items():
        assert outs[-1].finished
        finished[rid] = outs[-1].finish_reason or ""
    assert engine.stats().free_blocks == total
    reasons = set(finished.values())
    assert {"error", "abort"} <= reasons and reasons <= {"error", "abort", "stop", "length"}
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    assert engine.abort("r0") is False  # finished requests are forgotten
    assert mc.num_layers == 2


def test_preemption_recomputes_and_keeps_tokens(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=12)
    prompts = [prompt_ids(engine, 8, salt=i) for i in range(3)]
    reference = make_engine().generate(prompts, GREEDY)
    # Each needs ceil(20 / 4) = 5 blocks at the end: 15 > 12, so someone is preempted.
    assert engine.generate(prompts, GREEDY) == reference
    s = engine.stats()
    assert s.preemptions_total > 0
    assert s.free_blocks == 12


def test_preemption_victim_is_lowest_priority_then_newest(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=9)
    victims = record_victims(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("old-background", prompt_ids(engine, 8, salt=1), params, Priority.BACKGROUND)
    engine.add_request("interactive-1", prompt_ids(engine, 8, salt=2), params)
    engine.add_request("interactive-2", prompt_ids(engine, 8, salt=3), params)
    outs = drain(engine)
    assert victims and victims[0] == "old-background"
    assert all(len([o for o in outs[r] if o.token_id is not None]) == 12 for r in outs)
    assert engine.stats().free_blocks == 9


def test_interactive_is_scheduled_before_background(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(max_batch_size=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("bg", prompt_ids(engine, 6, salt=1), params, Priority.BACKGROUND)
    engine.add_request("fg", prompt_ids(engine, 6, salt=2), params, Priority.INTERACTIVE)
    order = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["fg", "bg"]


def test_seeded_sampling_is_reproducible(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    p = prompt_ids(engine, 10)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=16, ignore_eos=True)
    alone = engine.generate([p], seeded)[0]
    # Same seed, different batch company and order: same tokens.
    others = [prompt_ids(engine, 7, salt=i) for i in range(3)]
    batch = engine.generate([others[0], p, others[1]], [GREEDY, seeded, seeded])
    assert batch[1] == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=16, ignore_eos=True)
    assert engine.generate([p], other_seed)[0] != alone
    greedy = engine.generate([p], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert alone != greedy  # temperature 1 over ~500 tokens does not follow the argmax


def test_distinct_seeds_sample_differently(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Seeds the router accepts (any int64) that are different seeds: s and s - 2**63 were one
    # (the token seed was taken mod 2**63), and on a CPU generator, which keeps only the low 32
    # bits of its seed, so were s and s + 2**32.
    engine = make_engine()
    p = prompt_ids(engine, 10)

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return engine.generate([p], params)[0]

    for a, b in ((5, 5 + 2**32), (-1, 2**63 - 1), (0, -(2**63)), (7, 7 + 2**33)):
        assert run(a) != run(b), (a, b)
    assert run(2**63 - 1) == run(2**63 - 1)


def test_top_k_one_and_tiny_top_p_are_greedy(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    p = prompt_ids(engine, 10)
    greedy = engine.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    for params in (
        SamplingParams(temperature=2.0, top_k=1, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
    ):
        assert engine.generate([p], params)[0] == greedy


def test_vanishing_temperature_is_greedy_and_spares_the_batch(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # 1e-40 is an accepted temperature (it survives the proto's float32 as a subnormal);
    # dividing logits by it gave inf, NaN probabilities, and "error" for the whole batch.
    engine = make_engine()
    prompts = [prompt_ids(engine, 10, salt=i) for i in range(2)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = engine.generate(prompts, greedy)
    tiny = SamplingParams(temperature=1e-40, seed=7, max_tokens=6, ignore_eos=True)
    assert engine.generate(prompts, [greedy, tiny]) == expected
    assert SamplingParams(temperature=GREEDY_BELOW).greedy is False


def test_greedy_argmax_is_torchs_on_ties_nan_and_inf() -> None:
    # The CPU path goes through numpy; it must pick what torch.argmax picks in every case.
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(33, 32000, generator=g)
    rows[0, [5, 77, 31999]] = 50.0  # a three-way tie: the first wins
    rows[1, [9, 4000]] = float("nan")  # the first NaN wins, as in torch
    rows[2] = float("-inf")  # nothing allowed: index 0
    rows[3, :] = 0.0
    rows[3, 123] = float("inf")
    rows[4] = torch.arange(32000, dtype=torch.float32).flip(0)  # the maximum at index 0
    strided = rows.t().contiguous().t()  # the same values, column-major
    expected = torch.argmax(rows, dim=-1).tolist()
    assert expected[:5] == [5, 9, 0, 123, 0]
    assert argmax_rows(rows) == expected
    assert argmax_rows(strided) == expected
    assert argmax_rows(rows[:1]) == expected[:1]
    assert argmax_rows(rows.to(torch.float64)) == expected  # not float32: torch's own


def test_logprobs(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    engine.add_request("r", prompt_ids(engine, 6), SamplingParams(max_tokens=4, logprobs=True))
    outs = drain(engine)["r"]
    assert all(o.logprob is not None and o.logprob <= 0.0 for o in outs)
    engine.add_request("n", prompt_ids(engine, 6), SamplingParams(max_tokens=2))
    assert all(o.logprob is None and o.top_logprobs is None for o in drain(engine)["n"])
    # top_logprobs: the N most likely tokens, most likely first; greedy picks the first.
    top = SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True)
    engine.add_request("t", prompt_ids(engine, 6), top)
    sampled = SamplingParams(
        temperature=1.0, seed=3, max_tokens=4, logprobs=True, top_logprobs=1, ignore_eos=True
    )
    engine.add_request("s", prompt_ids(engine, 7), sampled)  # same batch, another N
    outs = drain(engine)
    for o in outs["t"]:
        assert o.top_logprobs is not None and len(o.top_logprobs) == 3
        values = [v for _, v in o.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert o.top_logprobs[0] == (o.token_id, pytest.approx(o.logprob))
    assert all(o.top_logprobs is not None and len(o.top_logprobs) == 1 for o in outs["s"])
    for bad in (SamplingParams(top_logprobs=2), SamplingParams(logprobs=True, top_logprobs=21)):
        with pytest.raises(ValueError, match="top_logprobs"):
            bad.validate()


def test_stop_token_ids_stop_strings_eos_and_length(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    p = prompt_ids(engine, 12, salt=4)
    full = engine.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_id = full[5]
    first_at = full.index(stop_id)

    engine.add_request("ids", p, SamplingParams(max_tokens=20, stop_token_ids=[stop_id]))
    outs = drain(engine)["ids"]
    assert [o.token_id for o in outs] == full[: first_at + 1]
    assert outs[-1].finish_reason == "stop"

    text = engine.tokenizer.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    engine.add_request("str", p, SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True))
    outs = drain(engine)["str"]
    got = [o.token_id for o in outs]
    assert outs[-1].finish_reason == "stop"
    assert stop in engine.tokenizer.decode(got) and stop not in engine.tokenizer.decode(got[:-1])
    assert got == full[: len(got)]

    engine.eos_token_ids = {full[2]}  # pretend the third token is EOS
    engine.add_request("eos", p, SamplingParams(max_tokens=20))
    outs = drain(engine)["eos"]
    assert [o.token_id for o in outs] == full[: full.index(full[2]) + 1]
    assert outs[-1].finish_reason == "stop"
    engine.add_request("ignore", p, SamplingParams(max_tokens=7, ignore_eos=True))
    outs = drain(engine)["ignore"]
    assert len(outs) == 7 and outs[-1].finish_reason == "length"


def test_max_model_len(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(max_model_len=32)
    assert engine.model_config.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len 32"):
        engine.add_request("long", prompt_ids(engine, 33), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [engine.model_config.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("bad", [5], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        engine.reserve("r", 33)
    engine.add_request(
        "fits", prompt_ids(engine, 28), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    outs = drain(engine)["fits"]
    assert len(outs) == 4 and outs[-1].finish_reason == "length"  # 28 + 4 = 32 tokens
    engine.add_request("full", prompt_ids(engine, 32), SamplingParams(max_tokens=100))
    outs = drain(engine)["full"]
    assert len(outs) == 1 and outs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(max_model_len=10**6)


def test_abort_waiting_and_running(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(max_batch_size=1)
    engine.add_request("a", prompt_ids(engine, 5), GREEDY)
    engine.add_request("b", prompt_ids(engine, 5, salt=1), GREEDY)
    engine.step()  # a prefilled, b waiting (batch size 1)
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("missing")
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "abort"), ("b", "abort")]
    assert not engine.has_unfinished()
    assert engine.stats().free_blocks == engine.num_kv_blocks
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("c", [5], GREEDY)
        engine.add_request("c", [5], GREEDY)


def test_kv_sizing_and_stats(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(kv_cache_memory_bytes=1 << 20, block_size=16)
    mc = engine.model_config
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    assert engine.kv_bytes_per_token() == per_token
    assert engine.num_kv_blocks == (1 << 20) // (16 * per_token)
    assert engine.model_runner.kv_cache.numel() * 4 == engine.num_kv_blocks * 16 * per_token
    engine.add_request("r", list(range(4, 40)), SamplingParams(max_tokens=2))
    assert engine.stats().queued_prefill_tokens == 36
    engine.step()
    s = engine.stats()
    assert (s.batch_size, s.num_prefill_tokens, s.num_decode_tokens) == (1, 36, 0)
    assert s.free_blocks == engine.num_kv_blocks - 3 and 0 < s.kv_usage < 1
    engine.step()
    s = engine.stats()
    assert (s.num_decode_tokens, s.num_running) == (1, 0)
    assert s.free_blocks == s.total_blocks == engine.num_kv_blocks


def test_failed_forward_pass_fails_its_batch_and_frees_blocks(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    runner = engine.model_runner
    real_decode = runner.run_decode
    calls = {"n": 0}

    def flaky_decode(seqs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_decode(seqs)

    runner.run_decode = flaky_decode  # type: ignore[method-assign]
    engine.add_request("a", prompt_ids(engine, 6), GREEDY)
    engine.add_request("b", prompt_ids(engine, 7, salt=1), GREEDY)
    outs = drain(engine)
    assert {r: o[-1].finish_reason for r, o in outs.items()} == {"a": "error", "b": "error"}
    assert [len(o) for o in outs.values()] == [3, 3]  # first token, one decode, the error
    assert engine.stats().free_blocks == engine.num_kv_blocks
    assert engine.generate([prompt_ids(engine, 6)], GREEDY)  # still serving


def test_interactive_prompt_preempts_background_work_holding_the_cache(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # A background request holds most of the cache; an interactive one arriving next used to
    # wait until the background one finished. Now the background one is preempted (and
    # recomputed later, with the same tokens).
    engine = make_engine(block_size=4, num_kv_blocks=10)
    bg_prompt, fg_prompt = prompt_ids(engine, 30, salt=2), prompt_ids(engine, 5, salt=1)
    bg_params = SamplingParams(max_tokens=6, ignore_eos=True)
    fg_params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = make_engine().generate([bg_prompt, fg_prompt], [bg_params, fg_params])
    engine.add_request("bg", bg_prompt, bg_params, Priority.BACKGROUND)
    first = engine.step()  # bg's prompt is in the cache (8 of 10 blocks)
    assert [o.request_id for o in first] == ["bg"]
    engine.add_request("fg", fg_prompt, fg_params, Priority.INTERACTIVE)
    finished: list[str] = []
    outs: dict[str, list[int]] = {"bg": [o.token_id for o in first if o.token_id is not None]}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                outs.setdefault(o.request_id, []).append(o.token_id)
            if o.finished:
                finished.append(o.request_id)
    assert finished == ["fg", "bg"]
    assert engine.stats().preemptions_total >= 1
    assert [outs["bg"], outs["fg"]] == expected
    assert engine.stats().free_blocks == 10


def test_running_interactive_sequence_preempts_a_background_chunked_prefill(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Mixed passes: a background prompt part-way through its chunked prefill holds blocks.
    # When the running interactive sequence needs a block, the background prompt gives them
    # up; the interactive one used to preempt itself and wait out the background request.
    engine = make_engine(
        block_size=4, num_kv_blocks=10, max_batch_tokens=4, enable_mixed_batches=True
    )
    fg_prompt, bg_prompt = prompt_ids(engine, 3, salt=1), prompt_ids(engine, 30, salt=2)
    fg_params = SamplingParams(max_tokens=20, ignore_eos=True)
    bg_params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = make_engine().generate([fg_prompt, bg_prompt], [fg_params, bg_params])
    engine.add_request("fg", fg_prompt, fg_params, Priority.INTERACTIVE)
    first = [o.token_id for o in engine.step()]  # fg's prompt and first token
    engine.add_request("bg", bg_prompt, bg_params, Priority.BACKGROUND)
    victims = record_victims(engine)
    outs = drain(engine)
    fg_tokens = first + [o.token_id for o in outs["fg"] if o.token_id is not None]
    bg_tokens = [o.token_id for o in outs["bg"] if o.token_id is not None]
    assert "bg" in victims and "fg" not in victims
    assert [fg_tokens, bg_tokens] == expected
    assert engine.stats().free_blocks == 10


@pytest.mark.parametrize("limit", ["blocks", "slots"])
def test_mixed_passes_let_an_interactive_prompt_preempt_a_background_decode(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]], limit: str
) -> None:
    # With mixed passes the running background sequence's decode is scheduled first in the
    # pass; the interactive prompt must still preempt it rather than wait for it to finish.
    kw = {"num_kv_blocks": 10} if limit == "blocks" else {"num_kv_blocks": 64, "max_batch_size": 1}
    engine = make_engine(block_size=4, max_batch_tokens=64, enable_mixed_batches=True, **kw)
    bg_prompt, fg_prompt = prompt_ids(engine, 20, salt=2), prompt_ids(engine, 14, salt=1)
    bg_params = SamplingParams(max_tokens=20, ignore_eos=True)
    fg_params = SamplingParams(max_tokens=2, ignore_eos=True)
    expected = make_engine().generate([bg_prompt, fg_prompt], [bg_params, fg_params])
    engine.add_request("bg", bg_prompt, bg_params, Priority.BACKGROUND)
    first = [o.token_id for o in engine.step() + engine.step()]  # bg's prompt, then a decode
    engine.add_request("fg", fg_prompt, fg_params, Priority.INTERACTIVE)
    victims = record_victims(engine)
    fg_tokens = [o.token_id for o in engine.step() if o.request_id == "fg"]
    assert len(fg_tokens) == 1  # admitted at once, not after bg's 18 remaining tokens
    assert victims == ["bg"]
    outs = drain(engine)
    bg_tokens = first + [o.token_id for o in outs["bg"] if o.token_id is not None]
    fg_tokens += [o.token_id for o in outs["fg"] if o.token_id is not None]
    assert [bg_tokens, fg_tokens] == expected
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_a_prefill_only_prompt_streaming_its_kv_is_never_preempted(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # On a prefill worker a background prompt's KV is already on its way to a decode worker;
    # recomputing it would send those chunks twice. An interactive prompt waits for it instead.
    engine = make_engine(block_size=4, num_kv_blocks=10, max_batch_tokens=8)
    sent: list[tuple[int, int]] = []

    def on_kv(_rid: str, layer: int, start: int, k: torch.Tensor, _v: torch.Tensor) -> None:
        sent.append((layer, start))

    params = SamplingParams(max_tokens=1)
    engine.add_request(
        "bg", prompt_ids(engine, 30, salt=2), params, Priority.BACKGROUND, True, on_kv
    )
    engine.step()  # the first chunk: 8 of 30 tokens, all 8 blocks allocated
    engine.add_request("fg", prompt_ids(engine, 9, salt=1), params, Priority.INTERACTIVE, True)
    outs = drain(engine)
    assert engine.stats().preemptions_total == 0
    assert len(sent) == len(set(sent))  # every (layer, token start) sent once
    assert [o.finish_reason for o in outs["bg"]][-1] and [o.finish_reason for o in outs["fg"]][-1]
    assert engine.stats().free_blocks == 10


def test_no_preemption_that_cannot_admit_the_interactive_prompt(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # An interactive prompt needs 6 blocks + the spare; the background request holds 2 and 3
    # are free: preempting it could not admit the prompt, so it keeps decoding meanwhile.
    engine = make_engine(block_size=4, num_kv_blocks=10)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("i1", prompt_ids(engine, 18, salt=1), params)  # 5 blocks
    engine.add_request("bg", prompt_ids(engine, 6, salt=2), params, Priority.BACKGROUND)
    engine.step()
    engine.add_request("i2", prompt_ids(engine, 22, salt=3), params)
    first = engine.step()
    assert engine.scheduler.preemptions_total == 0
    assert "bg" in {o.request_id for o in first}  # still decoding
    outs = drain(engine)
    assert all(len([o for o in outs[r] if o.token_id is not None]) > 0 for r in ("i2", "bg"))
    assert engine.stats().free_blocks == 10


def test_a_prompt_preempted_mid_prefill_reports_no_cached_tokens_of_its_own(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Re-admitted after a preemption, a prompt hits the blocks it computed itself; those are
    # not the client's cache hits (usage.prompt_tokens_details.cached_tokens).
    engine = make_engine(block_size=4, num_kv_blocks=10, max_batch_tokens=8)
    engine.add_request(
        "bg", prompt_ids(engine, 30, salt=2), SamplingParams(max_tokens=1), Priority.BACKGROUND
    )
    engine.step()  # 8 of its 30 tokens computed, blocks held
    engine.add_request("fg", prompt_ids(engine, 9, salt=1), SamplingParams(max_tokens=1))
    outs = drain(engine)
    assert engine.scheduler.preemptions_total >= 1
    assert outs["bg"][-1].num_cached_tokens == 0
    assert engine.stats().free_blocks == 10
