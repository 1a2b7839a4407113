"""Speculative decoding by n-gram lookup (engine/speculative.py): an engine that verifies drafts
emits exactly what plain decoding emits - the same tokens, finish reasons and logprobs, greedy
and seeded sampling, on every architecture and under every batching limit - while accepting
drafts (fewer passes), never preempting for a draft and returning every block."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from splitserve_workers.engine import LLMEngine, SamplingParams
from splitserve_workers.engine import grammar as G
from splitserve_workers.engine.speculative import MAX_PAUSE, Drafter, NgramIndex
from structured_schemas import PERSON, check_person

K = 4


def _repetitive(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """A prompt that repeats a short random phrase (what prompt lookup is for), with noise."""
    g = torch.Generator().manual_seed(77 + salt)
    phrase = torch.randint(4, engine.tokenizer.vocab_size, (5 + salt % 3,), generator=g).tolist()
    ids = (phrase * (n // len(phrase) + 1))[:n]
    ids[salt % n] = 4 + salt  # so the prompts differ beyond their phrase
    return ids


Outcome = tuple[list[int], str | None, list[float | None]]


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Outcome]:
    """Every request to completion: its tokens, finish reason and logprobs."""
    out: dict[str, Outcome] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = ([], None, [])
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _, logprobs = out[o.request_id]
            if o.token_id is not None:
                tokens.append(o.token_id)
                logprobs.append(o.logprob)
            if o.finished:
                out[o.request_id] = (tokens, o.finish_reason, logprobs)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _same(a: list[Outcome], b: list[Outcome]) -> None:
    for (ta, fa, la), (tb, fb, lb) in zip(a, b, strict=True):
        assert (ta, fa) == (tb, fb)
        for x, y in zip(la, lb, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert x == pytest.approx(y, abs=1e-4)


def _compare(
    make_engine: Callable[..., LLMEngine],
    model: Path | None,
    prompts: Callable[[LLMEngine], list[list[int]]],
    params: list[SamplingParams],
    **config: object,
) -> LLMEngine:
    """Runs the requests on a plain engine and a speculative one (same config otherwise);
    asserts the same outcomes and every block back; returns the speculative engine."""
    plain = make_engine(model, **config)
    spec = make_engine(model, speculative_tokens=K, **config)
    ps = prompts(plain)
    _same(_run(spec, ps, params), _run(plain, ps, params))
    for engine in (plain, spec):
        assert engine.stats().free_blocks == engine.num_kv_blocks
    return spec


def _prompts(engine: LLMEngine) -> list[list[int]]:
    return [_repetitive(engine, n, i) for i, n in enumerate((12, 30, 7, 45, 20))]


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    # The suffix [1, 2, 3] last occurred at 4..6 (not 9..11, the suffix itself): 7, 5 follow.
    assert index.propose(ids, 2) == [7, 5]
    ids += [7]
    # Longest first: [2, 3, 7] occurred at 5..7 -> 5, 1, 2; not the 1-gram [7] elsewhere.
    assert index.propose(ids, 3) == [5, 1, 2]
    ids += [42]
    assert index.propose(ids, 3) == []  # never seen
    # Grown one call at a time or built at once: the same answers.
    fresh = NgramIndex(1, 3)
    assert fresh.propose(ids[:-1], 3) == [5, 1, 2]
    assert NgramIndex(1, 3).propose([8], 3) == []
    # A match closer than k tokens to the end is a loop: the span since it repeats.
    assert NgramIndex(2, 2).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert NgramIndex(1, 3).propose([9, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]


def test_drafter_adapts_its_length_and_pauses_where_drafts_fail() -> None:
    d = Drafter(6, 1, 3)
    loop = [3, 4, 5] * 4
    assert len(d.propose(loop, 10)) == 6
    assert len(d.propose(loop, 2)) == 2  # never past what the request may still emit
    d.update(6, 2)  # some refused: one fewer
    assert len(d.propose(loop, 10)) == 5
    d.update(5, 5)  # all accepted: two more, up to k
    assert len(d.propose(loop, 10)) == 6
    d.update(6, 0)
    d.update(5, 0)  # two drafted passes in a row with nothing accepted: a pause
    paused = 0
    while not d.propose(loop, 10):
        paused += 1
    assert paused == 2
    assert len(d.propose(loop, 10)) == 1  # then a single token is tried
    for want in (4, 8):  # the pause doubles while it keeps failing, up to MAX_PAUSE
        d.update(1, 0)
        paused = 0
        while not d.propose(loop, 10):
            paused += 1
        assert paused == want
    for _ in range(20):
        d.update(1, 0)
    assert d.pause == MAX_PAUSE
    d.pause = 0
    d.update(1, 1)  # one accepted draft ends the streak
    assert (d.misses, len(d.propose(loop, 10))) == (0, 3)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_greedy_tokens_equal_plain_decoding_on_every_architecture(
    make_engine: Callable[..., LLMEngine], tiny_models: dict[str, Path], preset: str
) -> None:
    spec = _compare(make_engine, tiny_models[preset], _prompts, [GREEDY] * 5)
    st = spec.stats()
    # Both outcomes of a draft happened: accepted ones (fewer passes) and refused ones.
    assert 0 < st.accepted_tokens_total < st.draft_tokens_total


def test_seeded_sampling_and_logprobs_equal_plain_decoding(
    make_engine: Callable[..., LLMEngine],
) -> None:
    params = [
        SamplingParams(max_tokens=30, temperature=t, top_p=p, top_k=k, seed=s, logprobs=True)
        for s, (t, p, k) in enumerate([(0.7, 1.0, 0), (1.0, 0.9, 0), (0.5, 0.95, 20), (1.3, 1, 5)])
    ] + [SamplingParams(max_tokens=30, logprobs=True, top_logprobs=3)]
    spec = _compare(make_engine, None, _prompts, params)
    assert spec.stats().accepted_tokens_total > 0


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 1},
        {"block_size": 4},
        {"max_batch_size": 2},  # sequences join as others finish
        {"max_batch_tokens": 8},  # drafts share the token budget of a pass
        {"num_kv_blocks": 14, "block_size": 4},  # full cache: drafts shrink, preemption
        {"enable_mixed_batches": True, "max_batch_tokens": 16, "max_batch_size": 3},
    ],
    ids=["block1", "block4", "continuous", "budget", "full-cache", "mixed-passes"],
)
def test_same_outcomes_under_batching_limits(
    make_engine: Callable[..., LLMEngine], config: dict[str, int]
) -> None:
    spec = _compare(make_engine, None, _prompts, [GREEDY] * 5, **config)
    assert spec.stats().accepted_tokens_total > 0


def test_a_draft_never_causes_a_preemption(make_engine: Callable[..., LLMEngine]) -> None:
    """Drafts take only free blocks and give back the refused ones in the same step, so when
    a preemption happens no sequence holds a block for a draft. (The count of preemptions is
    not comparable with plain decoding's: sequences reach block boundaries at other steps.)"""
    engine = make_engine(speculative_tokens=K, num_kv_blocks=18, block_size=4)
    bm, scheduler = engine.block_manager, engine.scheduler
    preempt = scheduler.preempt
    held: list[int] = []

    def checked(seq):  # type: ignore[no-untyped-def]
        held.extend(
            len(s.block_table) - bm.blocks_for(s.num_tokens)
            for s in scheduler.running
            if len(s.block_table) > bm.blocks_for(s.num_tokens)
        )
        preempt(seq)

    scheduler.preempt = checked  # type: ignore[method-assign]
    _run(engine, _prompts(engine), [GREEDY] * 5)
    assert engine.stats().preemptions_total > 0 and held == []
    assert engine.stats().accepted_tokens_total > 0


def test_stops_and_max_tokens_cut_inside_accepted_drafts(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine()
    prompts = _prompts(engine)
    # What the plain run generates decides the stops: a token and a string from the middle of
    # each answer, so the cut falls inside a run of accepted drafts.
    free = _run(make_engine(), prompts, [GREEDY] * 5)
    params = []
    for i, (tokens, _, _) in enumerate(free):
        if i % 2:
            params.append(SamplingParams(max_tokens=40, stop_token_ids=[tokens[17]]))
        else:
            text = engine.tokenizer.decode(tokens[15:17])
            params.append(SamplingParams(max_tokens=40, stop=[text] if text.strip() else []))
    params[2] = SamplingParams(max_tokens=9, ignore_eos=True)
    spec = _compare(make_engine, None, lambda _: prompts, params)
    assert spec.stats().accepted_tokens_total > 0


def test_drafts_never_exceed_what_the_request_may_still_emit(
    make_engine: Callable[..., LLMEngine],
) -> None:
    limit = 25
    engine = make_engine(speculative_tokens=8, block_size=2)
    prompt = _repetitive(engine, 40, 0)
    engine.add_request("r", prompt, SamplingParams(max_tokens=limit, ignore_eos=True))
    emitted = 0
    while engine.has_unfinished():
        outs = engine.step()
        st = engine.stats()
        if st.num_decode_tokens:  # this pass verified 1 + drafts rows: never past max_tokens
            assert st.num_decode_tokens <= limit - emitted
        emitted += sum(o.token_id is not None for o in outs)
        # The blocks taken for drafts that were refused are given back at once.
        bm = engine.block_manager
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= bm.blocks_for(seq.num_tokens)
    assert emitted == limit
    assert 0 < engine.stats().accepted_tokens_total < engine.stats().draft_tokens_total
    assert engine.stats().free_blocks == engine.num_kv_blocks


def test_penalties_and_bias_are_drafted_for_and_equal_plain_decoding(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A draft row's penalties count the drafts before it (its history if they are accepted);
    a constrained row shares the pass undrafted."""
    params = [
        SamplingParams(max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(
            max_tokens=30,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            seed=1,
            temperature=0.8,
            ignore_eos=True,
        ),  # fmt: skip
        SamplingParams(max_tokens=30, grammar=G.regex(r"[a-z]{3,20}")),
        SamplingParams(max_tokens=30, logit_bias={5: 3.0, 9: -50.0}, ignore_eos=True),
        SamplingParams(max_tokens=30, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(
            max_tokens=30, repetition_penalty=0.8, frequency_penalty=-0.5, ignore_eos=True
        ),  # fmt: skip
    ]
    engine = make_engine(speculative_tokens=K)
    spec = _compare(make_engine, None, lambda e: [*_prompts(e), _prompts(e)[3]], params)
    assert spec.stats().accepted_tokens_total > 0
    # Penalised rows alone are drafted for (and some drafts accepted) too.
    only = [p for p in params if p.grammar is None]
    _run(engine, _prompts(engine), only)
    assert engine.stats().accepted_tokens_total > 0


def test_constrained_requests_draft_what_the_grammar_forces(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Under a grammar the drafts are its forced tokens (a JSON schema's keys), else the
    lookup's as far as the grammar allows; each draft row is masked by the grammar after the
    drafts before it. Answers equal plain decoding's, and stay valid."""
    schema = G.json_schema(PERSON)
    params = [
        SamplingParams(max_tokens=120, grammar=schema),
        SamplingParams(max_tokens=120, grammar=schema, temperature=0.9, seed=4),
        SamplingParams(max_tokens=40, grammar=G.regex(r"(ab|cd){2,12}x")),
        SamplingParams(max_tokens=20, grammar=G.choice(["alpha beta gamma", "delta"])),
        SamplingParams(max_tokens=40, ignore_eos=True),  # a free row in the same passes
    ]
    spec = _compare(make_engine, None, _prompts, params)
    st = spec.stats()
    assert 0 < st.accepted_tokens_total <= st.draft_tokens_total
    grammar_only = make_engine(speculative_tokens=K)
    answers = _run(grammar_only, _prompts(grammar_only)[:2], params[:2])
    for tokens, reason, _ in answers:
        assert reason == "stop"
        check_person(json.loads(grammar_only.tokenizer.decode(tokens)))
    # The schema's keys and punctuation are forced: most of them ride as accepted drafts.
    assert grammar_only.stats().accepted_tokens_total >= 10


def test_a_grammar_drafts_its_forced_text_and_only_what_it_allows(
    make_engine: Callable[..., LLMEngine],
) -> None:
    from splitserve_workers.engine.sequence import Sequence

    engine = make_engine(speculative_tokens=8)
    seq = Sequence("g", [9, 10, 11], SamplingParams(max_tokens=50))
    seq.matcher = engine.grammars.matcher(G.lark('start: "hello world, " /[a-z]+/'))
    seq.drafter = Drafter(8, 1, 3)
    forced = engine.scheduler._propose(seq, 8)
    assert forced and "hello world, ".startswith(engine.tokenizer.decode(forced))
    assert engine.scheduler._propose(seq, 2) == forced[:2]  # at most what may be emitted
    # Nothing forced: the lookup's draft, cut where the grammar would refuse it.
    free = Sequence("f", [40, 41, 42, 40, 41], SamplingParams(max_tokens=50))
    free.matcher = engine.grammars.matcher(G.regex("[0-9]+"))
    free.drafter = Drafter(4, 1, 3)
    digit = engine.tokenizer.encode("7", add_special_tokens=False)
    free.token_ids = digit + free.token_ids  # "7" then a draft the lookup finds: 42 40 41
    assert Drafter(4, 1, 3).propose(free.token_ids, 4)  # what the lookup alone would draft
    assert engine.scheduler._propose(free, 4) == []  # none of it is digits


def test_a_draft_rows_history_holds_the_drafts_before_it() -> None:
    from splitserve_workers.engine.llm_engine import _histories
    from splitserve_workers.engine.sequence import Sequence

    a = Sequence("a", [1, 2, 3], SamplingParams(frequency_penalty=1.0))
    b = Sequence("b", [7, 8], SamplingParams())
    a.token_ids.append(4)
    histories, states = _histories([a, b], [0, 1], [3, 1], [[5, 6], []], torch.zeros(4, 16))
    assert histories == [([1, 2, 3, 4], 3), ([1, 2, 3, 4, 5], 3), ([1, 2, 3, 4, 5, 6], 3),
                         ([7, 8], 2)]  # fmt: skip
    # A sequence's kept statistics serve its first row; each draft row gets its own copy with
    # the drafts before it counted, and the sequence's own statistics are left as they were.
    assert states[0] is a.penalty_state and states[3] is b.penalty_state
    first, second = states[1], states[2]
    assert first is not None and second is not None and first is not second
    assert (a.penalty_state.num_tokens, first.num_tokens, second.num_tokens) == (4, 5, 6)
    counts = dict(zip(second.out_ids.tolist(), second.out_counts.tolist(), strict=True))
    assert counts == {4: 1.0, 5: 1.0, 6: 1.0}
    assert a.penalty_state.out_ids.tolist() == [4] and first.out_ids.tolist() == [4, 5]


def test_kv_handoff_then_speculative_decode_equals_local(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Disaggregated: a plain prefill engine's KV imported into a speculative decode engine."""
    prefill = make_engine()
    decode = make_engine(speculative_tokens=K)
    local = make_engine()
    prompt = _repetitive(prefill, 33, 2)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _run(local, [prompt], [params])[0][0]

    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    prefill.add_request(
        "p",
        prompt,
        params,
        prefill_only=True,
        on_kv=lambda _r, layer, start, k, v: chunks.append((layer, start, k.clone(), v.clone())),
    )
    first = next(o.token_id for o in _drain(prefill) if o.token_id is not None)
    assert decode.reserve("d", len(prompt))
    for layer, start, k, v in chunks:
        decode.import_kv("d", layer, start, k, v)
    decode.start_decode("d", prompt, first, params)
    got = [first] + [o.token_id for o in _drain(decode) if o.token_id is not None]
    assert got == want
    assert decode.stats().accepted_tokens_total > 0
    assert decode.stats().free_blocks == decode.num_kv_blocks


def _drain(engine: LLMEngine) -> list:  # type: ignore[type-arg]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_forced_drafts_are_at_most_k_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    from splitserve_workers.engine.sequence import Sequence

    engine = make_engine(speculative_tokens=2)
    seq = Sequence("g", [9, 10, 11], SamplingParams(max_tokens=50))
    seq.matcher = engine.grammars.matcher(G.lark('start: "hello world, " /[a-z]+/'))
    seq.drafter = Drafter(2, 1, 3)
    assert len(engine.scheduler._propose(seq, 40)) == 2


def test_refused_drafts_do_not_evict_cached_prefixes(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    """A draft's block comes from the free list and goes back when refused: it must not take
    the place of a cached prefix that plain decoding would have kept."""

    def hits(speculative: int) -> int:
        engine = make_engine(num_kv_blocks=64, block_size=4, speculative_tokens=speculative)
        cached = prompt_ids(engine, 60)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        _run(engine, [cached], [one])
        # 47 of the 48 blocks never used: plain decoding leaves the cached prompt's 15 alone.
        _run(
            engine, [_repetitive(engine, 20, 2)], [SamplingParams(max_tokens=168, ignore_eos=True)]
        )
        engine.add_request("again", cached, one)
        return next(o.num_cached_tokens for o in _drain(engine) if o.finished)

    assert hits(K) == hits(0) == 56
