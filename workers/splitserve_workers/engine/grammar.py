"""Structured output: a grammar that every generated token must keep the output inside.

The router turns a request's `response_format` (a JSON schema, or any JSON object) or vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`) into one grammar string in
llguidance's format (its serialized grammar list); the string travels to the workers in
SamplingParams.grammar. Each worker compiles it once per engine into a matcher that tracks a
sequence's output and, before each sampling step, says which tokens may come next (a bitmask
over the vocabulary: sampling.py masks the rest). The grammar complete, the sequence stops
with "stop"; EOS is allowed only where the output is complete.

In the disaggregated flow the prefill worker samples the first token under the grammar and the
decode worker's matcher starts by consuming it (llm_engine.start_decode), so the two halves are
one constrained generation.

JSON is generated compactly but readably (`", "` and `": "` separators, no other whitespace):
with free whitespace a model can spend its whole budget on newlines and spaces, a known way for
constrained decoding to never finish. This module imports no torch (the router uses it).
"""

from __future__ import annotations

import collections
import json
import math
import threading
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The compiled grammar string travels in every request to the workers; schemas this size are
# already unusual (OpenAI caps a schema at 100 properties and 5 levels of nesting).
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_CHOICES = 256  # strings in a `choice` list
# Compiled grammars kept per engine (a matcher is copied from its grammar's compiled one).
GRAMMAR_CACHE_SIZE = 64
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # oneOf is taken as anyOf: exclusivity cannot be checked while generating, and pydantic's
    # discriminated unions (oneOf) would otherwise be refused.
    "coerce_one_of": True,
}


class GrammarError(ValueError):
    """A grammar (or the schema/regex/choices it came from) that cannot be compiled."""


def _checked(grammar: str) -> str:
    size = len(grammar.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the compiled grammar is {size} bytes, at most {MAX_GRAMMAR_BYTES}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())
    return grammar


def json_schema(schema: dict[str, Any] | bool) -> str:
    """A grammar for JSON that validates against `schema` (`{"type": "object"}`: any object)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    _refuse_misread_ranges(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:  # not a JSON object, or options it refuses
        raise GrammarError(str(e)) from e
    return _checked(grammar)


# A number's bounds, merged as llguidance merges them: (value, exclusive) or None.
_Bound = tuple[float, bool] | None
# Keywords whose values are data, not schemas.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")


def _tighter(a: _Bound, b: _Bound, lower: bool) -> _Bound:
    if a is None or b is None:
        return a or b
    if a[0] == b[0]:
        return (a[0], a[1] or b[1])
    return a if (a[0] > b[0]) == lower else b


def _own_bounds(schema: dict[str, Any]) -> tuple[_Bound, _Bound]:
    """A schema's numeric bounds (draft 4's boolean exclusiveMinimum/Maximum too)."""

    def number(key: str) -> float | None:
        value = schema.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return float(value) if math.isfinite(value) else None

    lo = hi = None
    if (m := number("minimum")) is not None:
        lo = (m, schema.get("exclusiveMinimum") is True)
    if (m := number("exclusiveMinimum")) is not None:
        lo = _tighter(lo, (m, True), lower=True)
    if (m := number("maximum")) is not None:
        hi = (m, schema.get("exclusiveMaximum") is True)
    if (m := number("exclusiveMaximum")) is not None:
        hi = _tighter(hi, (m, True), lower=False)
    return lo, hi


def _refuse_misread_ranges(schema: dict[str, Any]) -> None:
    """GrammarError for a number range llguidance turns into a regex that lets an excluded
    bound through. Its float ranges whose ends share an integer part make the fraction
    optional when the lower end's is zero, even with the end excluded (1.9: `exclusiveMinimum:
    0, maximum: 0.5` admits `0`; negated, `minimum: -0.5, exclusiveMaximum: 0` admits `-0`).
    Bounds merge as llguidance merges them: over allOf, into anyOf/oneOf branches and through
    local $refs. Refused (a 400 naming it) rather than generating outside the schema."""
    root = schema
    # (schema, bounds inherited from the schemas it is merged with)
    stack: list[tuple[Any, _Bound, _Bound]] = [(schema, None, None)]
    followed: set[tuple[str, _Bound, _Bound]] = set()  # each $ref once per inherited bounds
    while stack:
        node, lo, hi = stack.pop()
        if isinstance(node, list):
            stack.extend((item, None, None) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        merged = [node] + [m for m in node.get("allOf", []) if isinstance(m, dict)]
        for part in merged:
            own_lo, own_hi = _own_bounds(part)
            lo, hi = _tighter(lo, own_lo, lower=True), _tighter(hi, own_hi, lower=False)
        types = node.get("type", "number")
        numeric = "number" in (types if isinstance(types, list) else [types])
        if numeric and lo is not None and hi is not None and lo[0] < hi[0]:
            # Excluded integer lower end L >= 0 and an upper end below L + 1, or mirrored.
            if (lo[1] and lo[0].is_integer() and lo[0] >= 0 and hi[0] < lo[0] + 1) or (
                hi[1] and hi[0].is_integer() and hi[0] <= 0 and lo[0] > hi[0] - 1
            ):
                low = ("exclusiveMinimum " if lo[1] else "minimum ") + f"{lo[0]:g}"
                high = ("exclusiveMaximum " if hi[1] else "maximum ") + f"{hi[0]:g}"
                raise GrammarError(
                    f"unsupported number range: {low} with {high} (an excluded integer end "
                    "within one unit of the other end); widen it or make the end inclusive"
                )
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                continue
            if key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
                stack.extend((m, lo, hi) for m in value)  # the branches take its bounds
            elif key == "$ref" and isinstance(value, str):
                if (lo is None and hi is None) or (value, lo, hi) in followed:
                    continue  # its target is walked where it is defined
                followed.add((value, lo, hi))
                target = _local_ref(root, value)
                if target is not None:
                    stack.append((target, lo, hi))
            else:
                stack.append((value, None, None))


def _local_ref(root: dict[str, Any], ref: str) -> Any:
    """The subschema a local $ref (`#`, `#/$defs/x`, ...) points at, or None."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def regex(pattern: str) -> str:
    """A grammar for text that matches `pattern` entirely (Rust regex syntax)."""
    return _checked(llguidance.LLMatcher.grammar_from_regex(pattern))


def choice(options: list[str]) -> str:
    """A grammar for exactly one of `options`."""
    if not options:
        raise GrammarError("at least one choice is needed")
    if len(options) > MAX_CHOICES:
        raise GrammarError(f"{len(options)} choices, at most {MAX_CHOICES}")
    if any(not s for s in options):
        raise GrammarError("a choice must not be empty")
    return lark("start: " + " | ".join(json.dumps(s) for s in options))


def lark(text: str) -> str:
    """A grammar written in llguidance's Lark dialect (`start` is the top rule)."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(text))


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, shared by the process's engines: a batch's masks are computed
    in parallel (its default: 80% of the CPUs, at most 32)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class Grammars:
    """One engine's compiled grammars and the tokenizer view they are compiled against.
    Thread-safe: requests arrive on gRPC threads, while the engine's step thread uses the
    matchers (each sequence its own)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._source = (tokenizer_json, vocab_size, sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on the first grammar (about a second at a 150k vocabulary), not at start.
        if self._tokenizer is None:
            text, vocab_size, eos = self._source
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`. GrammarError if it does not compile."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None and not compiled.is_error():
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
            self._compiled.pop(grammar, None)
            tokenizer = self._llg_tokenizer()
        # (Its size is checked with the request's other parameters, SamplingParams.validate.)
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise GrammarError(compiled.get_error().strip())
        # Most of the work (the lexer) is lazy: do the first mask here, on the caller's thread
        # (llguidance releases the GIL), not in the step loop, and refuse a grammar that fails
        # at its start (no token can begin it, or a lexer limit) instead of answering "".
        probe = compiled.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(probe.get_error().strip().split("\n")[0])
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()
