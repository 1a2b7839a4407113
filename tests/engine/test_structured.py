"""Structured output in the engine: a grammar (engine/grammar.py) keeps every generated token
inside a JSON schema, a regex, a choice list or a Lark grammar. Random-weight models make this
a strong test: left alone they produce byte soup, so valid output comes from the mask alone."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from splitserve_workers.engine import LLMEngine, SamplingParams
from splitserve_workers.engine import grammar as G
from structured_schemas import PERSON, check_person
from test_disaggregation import KVCollector, decode_on, prefill_elsewhere, run


def finished(engine: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
    """Runs the engine dry: request id -> (generated ids, finish reason)."""
    out: dict[str, tuple[list[int], str | None]] = {}
    for o in run(engine):
        ids, _ = out.get(o.request_id, ([], None))
        if o.token_id is not None:
            ids.append(o.token_id)
        out[o.request_id] = (ids, o.finish_reason if o.finished else None)
    return out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_sampled_output_follows_the_json_schema(
    tiny_models: dict[str, Path],
    make_engine: Callable[..., LLMEngine],
    prompt_ids: Callable[..., list[int]],
    preset: str,
) -> None:
    engine = make_engine(tiny_models[preset])
    grammar = G.json_schema(PERSON)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, grammar=grammar)
        engine.add_request(f"r{seed}", prompt_ids(engine, 9, salt=seed), params)
    results = finished(engine)
    texts = []
    for rid, (ids, reason) in results.items():
        # The grammar completes, so generation stops there - no EOS needed, no budget spent.
        assert reason == "stop", (rid, engine.tokenizer.decode(ids))
        text = engine.tokenizer.decode(ids)
        check_person(json.loads(text))
        assert "\n" not in text  # separators are ", " and ": ", nothing freer
        texts.append(text)
    assert len(set(texts)) > 1  # sampling still samples, inside the schema
    assert engine.stats().free_blocks == engine.num_kv_blocks


def test_unconstrained_output_is_not_json(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # The control for the test above: the same model and seeds without the grammar.
    engine = make_engine()
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        engine.add_request(f"r{seed}", prompt_ids(engine, 9, salt=seed), params)
    for ids, _ in finished(engine).values():
        with pytest.raises((ValueError, AssertionError)):
            check_person(json.loads(engine.tokenizer.decode(ids)))


def test_regex_choice_and_lark(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    grammars = {
        "regex": G.regex(r"[0-9]{3}-[a-z]{2,5}"),
        "choice": G.choice(["yes", "no", "maybe so", "naïve"]),
        "lark": G.lark('start: "(" item ("," item)* ")"\nitem: /[ab]{1,3}/'),
    }
    for name, grammar in grammars.items():
        for seed in range(6):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, grammar=grammar)
            engine.add_request(f"{name}-{seed}", prompt_ids(engine, 7, salt=seed), params)
    results = finished(engine)
    seen_choices = set()
    for rid, (ids, reason) in results.items():
        text = engine.tokenizer.decode(ids)
        name = rid.split("-")[0]
        if name == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
            assert reason == "stop"
        elif name == "choice":
            assert text in ("yes", "no", "maybe so", "naïve") and reason == "stop", text
            seen_choices.add(text)
        else:
            assert re.fullmatch(r"\((?:[ab]{1,3})(?:,[ab]{1,3})*\)", text) or reason == "length"
    assert len(seen_choices) > 1


def test_constrained_rows_do_not_change_their_neighbours(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # One batch mixing grammar and free rows: each gives what it gives alone.
    grammar = G.json_schema(PERSON)
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    greedy_json = SamplingParams(max_tokens=200, grammar=grammar)
    seeded_json = SamplingParams(temperature=0.8, seed=3, max_tokens=200, grammar=grammar)
    params = [free, greedy_json, seeded_json, free]
    engine = make_engine()
    prompts = [prompt_ids(engine, 5 + i, salt=i) for i in range(4)]
    together = engine.generate(prompts, params)
    alone = [make_engine().generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    assert together == alone
    check_person(json.loads(engine.tokenizer.decode(together[1])))


def test_max_tokens_cuts_a_constrained_answer(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine()
    grammar = G.json_schema(PERSON)
    engine.add_request("r", prompt_ids(engine, 6), SamplingParams(max_tokens=5, grammar=grammar))
    ((ids, reason),) = finished(engine).values()
    assert reason == "length" and len(ids) == 5
    assert engine.tokenizer.decode(ids).startswith('{"')  # a prefix of the answer
    assert engine.stats().free_blocks == engine.num_kv_blocks


def test_disaggregated_constrained_decode_equals_local(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Prefill samples the first token under the grammar; the decode engine's matcher starts by
    # consuming it, so the two halves are one constrained generation.
    grammar = G.json_schema(PERSON)
    for params in (
        SamplingParams(max_tokens=200, grammar=grammar),
        SamplingParams(temperature=1.0, seed=11, max_tokens=200, grammar=grammar),
    ):
        local = make_engine()
        prompt = prompt_ids(local, 21)
        expected = local.generate([prompt], params)[0]
        first, collector = prefill_elsewhere(make_engine(), "r1", prompt, params)
        assert first.finish_reason == "prefill_done"
        b = make_engine(block_size=8)
        got = decode_on(b, "r1", prompt, first.token_id, collector.chunks, params)
        assert got == expected
        check_person(json.loads(b.tokenizer.decode(got)))


def test_a_first_token_outside_the_grammar_is_refused(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # A decode worker handed a first token its grammar refuses (a prefill worker that did not
    # constrain it) refuses the call naming first_token, as for any other bad argument; the
    # reservation and its imported KV stay, so a corrected call starts it, and release frees it.
    a = make_engine()
    prompt = prompt_ids(a, 10)
    free = SamplingParams(max_tokens=1)
    collector = KVCollector(a.model_config.num_layers, len(prompt))
    a.add_request("r1", prompt, free, prefill_only=True, on_kv=collector)
    run(a)
    b = make_engine()
    assert b.reserve("r1", len(prompt))
    for layer, start, k, v in collector.chunks:
        b.import_kv("r1", layer, start, k, v)
    not_a_digit = b.tokenizer.encode("x", add_special_tokens=False)[0]
    digits = SamplingParams(max_tokens=2, grammar=G.regex("[0-9]+"))
    with pytest.raises(ValueError, match=rf"^first_token: {not_a_digit} is not allowed by"):
        b.start_decode("r1", prompt, not_a_digit, digits)
    assert not b.has_unfinished()
    seven = b.tokenizer.encode("7", add_special_tokens=False)[0]
    b.start_decode("r1", prompt, seven, digits)
    ((ids, reason),) = finished(b).values()
    assert reason == "length" and b.tokenizer.decode([seven, *ids]).isdigit()
    assert b.stats().free_blocks == b.num_kv_blocks


def test_a_grammar_that_fails_on_its_first_token_is_refused_on_both_sides(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # 500 optional properties allow "{", but consuming it takes llguidance's parser past 2000
    # items per row: the request's fault (its grammar), told apart from a token the grammar
    # refuses. A prefill-only request reports it on its first token; start_decode refuses it.
    props = {f"p{i}": {"type": "integer"} for i in range(500)}
    params = SamplingParams(
        max_tokens=4, grammar=G.json_schema({"type": "object", "properties": props})
    )
    a = make_engine()
    prompt = prompt_ids(a, 10)
    collector = KVCollector(a.model_config.num_layers, len(prompt))
    a.add_request("r1", prompt, params, prefill_only=True, on_kv=collector)
    (out,) = run(a)
    assert out.finish_reason == "error" and "max is 2000" in (out.grammar_error or "")
    b = make_engine()
    assert b.reserve("r1", len(prompt))
    for layer, start, k, v in collector.chunks:
        b.import_kv("r1", layer, start, k, v)
    brace = b.tokenizer.encode("{", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match=r"^grammar: .*max is 2000.*\(at the first token\)$"):
        b.start_decode("r1", prompt, brace, params)
    b.release("r1")
    assert b.stats().free_blocks == b.num_kv_blocks


def test_bad_grammars_are_refused_naming_the_field(make_engine: Callable[..., LLMEngine]) -> None:
    with pytest.raises(G.GrammarError, match="objekt"):
        G.json_schema({"type": "objekt"})
    with pytest.raises(G.GrammarError, match="unclosed group"):
        G.regex("(")
    with pytest.raises(G.GrammarError, match="foo"):
        G.lark("start: foo")
    with pytest.raises(G.GrammarError, match="at least one"):
        G.choice([])
    engine = make_engine()
    # Compiles, but no token can begin it: refused when the request arrives, not answered "".
    with pytest.raises(ValueError, match="^grammar: "):
        engine.add_request("r", [5, 6, 7], SamplingParams(grammar=G.regex("[^\\s\\S]")))
    garbage = '{"grammars": [{"lark_grammar": "start: nope"}]}'
    with pytest.raises(ValueError, match="^grammar: .*nope"):
        engine.add_request("r", [5, 6, 7], SamplingParams(grammar=garbage))
    assert not engine.has_unfinished()


def test_compiled_grammars_are_shared_not_their_state(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # The engine compiles a grammar once and copies it per request: two requests with one
    # grammar advance independently (greedy, different prompts, different answers).
    engine = make_engine()
    grammar = G.regex("[a-z]{4,8}")
    one = engine.grammars.matcher(grammar)
    two = engine.grammars.matcher(grammar)
    assert one is not two
    token = engine.tokenizer.encode("ab", add_special_tokens=False)[0]
    assert one.consume_token(token)
    assert two.validate_tokens([token]) == 1 and not two.is_error()
    outs = engine.generate(
        [prompt_ids(engine, 6, salt=1), prompt_ids(engine, 6, salt=2)],
        SamplingParams(max_tokens=20, grammar=grammar),
    )
    for ids in outs:
        assert re.fullmatch("[a-z]{4,8}", engine.tokenizer.decode(ids))


def test_a_preempted_constrained_sequence_resumes_its_grammar(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # Preemption drops a sequence's KV and recomputes it from prompt + output; its matcher
    # keeps its place, so the answer is the one an unpressed engine gives, and valid.
    grammar = G.json_schema(PERSON)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, grammar=grammar) for s in range(3)
    ]
    engine = make_engine(block_size=4, num_kv_blocks=40)
    prompts = [prompt_ids(engine, 8, salt=i) for i in range(3)]
    reference = make_engine().generate(prompts, params)
    assert engine.generate(prompts, params) == reference
    assert engine.stats().preemptions_total > 0
    assert engine.stats().free_blocks == 40
    for ids in reference:
        check_person(json.loads(engine.tokenizer.decode(ids)))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},  # llguidance admits "0"
        {"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2.001},  # ... "2"
        {"type": "number", "minimum": -0.5, "exclusiveMaximum": 0},  # ... "-0"
        {"type": "number", "minimum": -1.5, "exclusiveMaximum": -1},  # ... "-1"
        {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 0.5},  # draft 4
        {"type": "number", "exclusiveMinimum": 0, "minimum": -5, "maximum": 0.5},
        {"allOf": [{"type": "number", "exclusiveMinimum": 0}, {"maximum": 0.5}]},
        {"anyOf": [{"type": "number", "exclusiveMinimum": 0}], "maximum": 0.5},
        {"$defs": {"p": {"exclusiveMinimum": 0}}, "$ref": "#/$defs/p", "maximum": 0.5},
        {"type": "object", "properties": {"p": {"exclusiveMinimum": 1, "maximum": 1.5}}},
    ],
)
def test_number_ranges_llguidance_would_leak_are_refused(schema: dict[str, object]) -> None:
    # llguidance (1.9) writes a range whose ends share an integer part with the fraction
    # optional when the lower end's is zero, excluded or not: sampled, such a schema gave "0"
    # for (0, 0.5], a "stop" outside it. Refused (a 400) instead.
    with pytest.raises(G.GrammarError, match="unsupported number range"):
        G.json_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        {"type": "number", "exclusiveMinimum": 0.5, "maximum": 0.75},
        {"type": "number", "minimum": 0, "maximum": 0.5},
        {"type": "number", "minimum": -0.5, "exclusiveMaximum": 0.5},
        {"type": "number", "exclusiveMinimum": -1, "maximum": -0.5},
        {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
        {"type": "object", "properties": {"a": {"exclusiveMinimum": 0}, "b": {"maximum": 0.5}}},
        {"enum": [{"exclusiveMinimum": 0, "maximum": 0.5}]},  # data, not a schema
        {"$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
    ],
)
def test_number_ranges_llguidance_reads_right_are_served(schema: dict[str, object]) -> None:
    G.json_schema(schema)
