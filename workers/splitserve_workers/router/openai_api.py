"""The OpenAI wire format at the router's edge: request parsing and validation (every bad field
gets a 4xx naming it, never a 500), OpenAI-style error bodies, and the response / SSE chunk
shapes for /v1/completions and /v1/chat/completions. Pure data; app.py does the HTTP."""

from __future__ import annotations

import codecs
import functools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import llguidance

from splitserve_workers.engine import grammar
from splitserve_workers.router import tool_parsers

INT32_MAX = 2**31 - 1  # top_k and token ids travel to the workers as int32
PRIORITY_HEADER = "x-splitserve-priority"
PRIORITIES = ("interactive", "background")
# vLLM sets no bound and lm-eval-harness's local-completions sends a task's whole `until`
# list plus the EOS string (humaneval: 9); the workers accept up to 16 (worker_runtime.py).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000  # each is matched against the text's tail on every token
MAX_STOP_TOKEN_IDS = 64  # checked on every token (the workers refuse more)
# The engine's bounds (engine/sampling.py, which imports torch, so they are repeated here; a
# test checks they agree): OpenAI's penalty and logit-bias ranges, and our own caps.
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 0.01
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
MIN_TOP_P = 1e-30  # a float32 (normal) the workers receive as it is
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Choices in one request: `n` per prompt, times the prompts of a completions batch. Each is a
# generation of its own on the workers (prefix caching makes the copies' prefill cheap), so a
# bound keeps one request from filling a decode pool's batch.
MAX_CHOICES = 64


class APIError(Exception):
    """A request the router answers with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # of the HTTP answer (e.g. a 415's Accept-Encoding)
        if type is None:
            type = "invalid_request_error" if status < 500 else "server_error"
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """One validated OpenAI request, in the router's own terms."""

    kind: str  # "completion" | "chat"
    model: str
    # Completions: the prompts, each a text or token ids (several: a batch); chat: empty.
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None  # chat messages (content flattened to text)
    max_tokens: int | None = None  # None: until the context limit (chat) / 16 (completion)
    max_tokens_param: str = "max_tokens"  # the field the client set it with, for errors
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    priority: str = "interactive"
    echo: bool = False
    logprobs: bool = False  # the sampled tokens' logprobs
    top_logprobs: int = 0  # and this many most likely tokens at each step
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's tokens get entries too
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (transformers' semantics); 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1  # choices per prompt
    # Structured output (response_format / structured_outputs): the grammar the output must
    # match, in llguidance's format (engine/grammar.py); None = free text.
    grammar: str | None = None
    constraint: str | None = None  # what the grammar came from (for the request log)
    # The field that holds the constraint, which a worker's refusal of the grammar names
    # (structured_outputs.regex, response_format.json_schema.schema, tools[2].function.parameters).
    grammar_param: str | None = None
    # Chat tool calling, forced (tool_choice "required" or a named function): the tools as the
    # chat template receives them, and the mode; the grammar then holds the call's JSON.
    tools: list[dict[str, Any]] | None = None
    # None (no tools) | "auto" (free text, parsed for calls) | "required" | a function's name
    tool_choice: str | None = None
    tool_parser: str | None = None  # with "auto": the format the model writes calls in
    # Chat template controls (vLLM's extensions): open the assistant's turn (the default), or
    # continue the last (assistant) message; extra variables for the template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def prompt_label(self, i: int) -> str:
        """The field that holds prompt i: `prompt[i]` in a batch, else the prompt's field."""
        return f"prompt[{i}]" if len(self.prompts) > 1 else self.prompt_param


# ---- field validators ----------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _wrong_type(param: str, expected: str, value: Any) -> APIError:
    return invalid(param, f"'{param}' must be {expected}, got {_type_name(value)}", "invalid_type")


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise _wrong_type(name, "an integer", value)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid(name, f"'{name}' must be {bound}, got {value}")
    return int(value)


def _float(
    body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise _wrong_type(name, "a number", value)
    value = float(value)
    if value != value or value > hi or value < lo or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise invalid(name, f"'{name}' must be in {left}{lo}, {hi}], got {value}")
    return value


def _bool(body: dict[str, Any], name: str, within: str = "") -> bool | None:
    """body[name], a boolean or absent; `within`: the field `body` is (errors name
    `within.name`)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _wrong_type(f"{within}.{name}" if within else name, "a boolean", value)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _wrong_type("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_STRINGS:
        raise invalid(
            "stop", f"'stop' accepts at most {MAX_STOP_STRINGS} strings, got {len(value)}"
        )
    if any(s == "" for s in value):
        raise invalid("stop", "'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in value):
        raise invalid("stop", f"'stop' strings must be at most {MAX_STOP_STRING_CHARS} characters")
    return list(value)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token ids (as strings, JSON's keys) to -100..100."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _wrong_type("logit_bias", "an object mapping token ids to numbers", value)
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid(
            "logit_bias",
            f"'logit_bias' accepts at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key.strip()
        # Length first, leading zeros included (INT32_MAX has 10 digits): int() of a string
        # over 4300 digits raises ValueError (a 500), "000...01" too.
        digits = token.isascii() and token.isdigit()
        if not digits or len(token) > 10 or int(token) > INT32_MAX:
            raise invalid(
                "logit_bias", f"'logit_bias' keys must be token ids, got {json.dumps(key)[:40]}"
            )
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid(
                "logit_bias",
                f"'logit_bias' values must be numbers between -{MAX_LOGIT_BIAS:g} and "
                f"{MAX_LOGIT_BIAS:g}, got {json.dumps(bias)[:40]} for token {token}",
            )
        out[int(token)] = float(bias)
    return out


# Parameters OpenAI defines that the router accepts only at their neutral value: a request that
# asks for the feature gets a 400 naming it instead of being silently served without it.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
# Accepted and ignored: they do not change what is generated. Still type-checked, as OpenAI
# does, so a client bug shows here and not on the day it talks to another server.
# safety_identifier and prompt_cache_key are OpenAI's successors of `user` (the openai client
# sends them when asked); prompt_cache_retention is a caching hint.
_IGNORED_STRINGS = (
    "user",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
)
_IGNORED = (*_IGNORED_STRINGS, "metadata", "store")


def _check_ignored(body: dict[str, Any]) -> None:
    for name in _IGNORED_STRINGS:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _wrong_type(name, "a string", value)
    _bool(body, "store")
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _wrong_type("metadata", "an object of string values", metadata)
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _wrong_type(f"metadata.{key}", "a string", value)


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stream",
    "stream_options",
    "priority",
    "ignore_eos",
    "stop_token_ids",
    "n",
    "response_format",
    "structured_outputs",
    *_NEUTRAL,
    *_IGNORED,
}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "logprobs"}
CHAT_PARAMS = (
    _COMMON
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
    | {"tools", "tool_choice", "parallel_tool_calls"}
    | {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
) - {
    "suffix",
    "best_of",
}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API
MAX_TOP_LOGPROBS = 20  # and for chat's top_logprobs


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # `in` alone would take true for 1 and false for 0 (Python's bool is an int): "n": true
    # must not pass as n=1.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def _check_neutral(body: dict[str, Any], allowed: set[str]) -> None:
    for name in sorted(body):
        if name not in allowed:
            raise APIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        if name in _NEUTRAL and not _is_neutral(body[name], _NEUTRAL[name]):
            raise APIError(
                400,
                f"'{name}' is not supported by this server (got {json.dumps(body[name])[:80]})",
                param=name,
                code="unsupported_parameter",
            )


# A \uD800-\uDFFF escape, or a UTF-8-encoded surrogate (json.loads decodes bytes with
# surrogatepass): the only ways a parsed string can hold a lone surrogate.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, which no
    tokenizer or protobuf accepts; None when every string is valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            found = _surrogate_path(key, sub) or _surrogate_path(item, sub)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
        # Valid surrogate pairs (escaped emoji) also match: then each string is checked.
        bad = _surrogate_path(body, "") if _MAYBE_SURROGATE.search(raw) else None
    # ValueError: malformed JSON, bad UTF-8, or an integer past Python's digit limit;
    # RecursionError: arrays/objects nested deeper than the parser's stack. All the client's.
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(
            400, f"request body must be a JSON object, got {_type_name(body)}", code="invalid_json"
        )
    if bad is not None:
        bad = bad.encode("utf-8", "backslashreplace").decode()  # a key may hold it too
        raise APIError(
            400,
            f"'{bad}' holds a lone UTF-16 surrogate, which is not valid Unicode text",
            param=bad,
            code="invalid_value",
        )
    return body


def _common(body: dict[str, Any], req: GenerationRequest, header_priority: str | None) -> None:
    temperature = _float(body, "temperature", 0.0, 2.0)
    req.temperature = 1.0 if temperature is None else temperature
    top_p = _float(body, "top_p", 0.0, 1.0, lo_open=True)
    # The workers get it as a float32, where 0 means unset (1.0): a positive top_p below
    # float32's range would turn into no nucleus cut at all instead of the strictest one. Any
    # top_p under the largest probability (>= 1 / vocabulary) keeps the top token alone.
    req.top_p = 1.0 if top_p is None else max(top_p, MIN_TOP_P)
    # 0 or -1: every token (vLLM takes both; -1 was its default, and clients written for it
    # still send it).
    req.top_k = max(_int(body, "top_k", -1, INT32_MAX) or 0, 0)
    req.seed = _int(body, "seed", -(2**63), 2**63 - 1)
    req.presence_penalty = _float(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0
    req.frequency_penalty = _float(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0
    repetition = _float(body, "repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    req.repetition_penalty = 1.0 if repetition is None else repetition
    req.logit_bias = _logit_bias(body)
    req.stop = _stop(body)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _wrong_type("stop_token_ids", "an array of non-negative integers", ids)
        if any(i > INT32_MAX for i in ids):
            raise invalid("stop_token_ids", f"'stop_token_ids' must be <= {INT32_MAX}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(
                "stop_token_ids",
                f"'stop_token_ids' accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
            )
        req.stop_token_ids = list(ids)
    req.ignore_eos = bool(_bool(body, "ignore_eos"))
    req.stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        if not req.stream:
            raise invalid(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        # include_obfuscation (OpenAI's random padding field on stream chunks) is type-checked
        # and ignored: chunks without the padding are what `false` asks for, and valid either way.
        unknown = set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
        if unknown:
            name = sorted(unknown)[0]
            raise APIError(
                400,
                f"Unrecognized request argument supplied: stream_options.{name}",
                param=f"stream_options.{name}",
                code="unknown_parameter",
            )
        _bool(options, "include_obfuscation", "stream_options")
        req.include_usage = bool(_bool(options, "include_usage", "stream_options"))
        # vLLM's extension: running totals on every chunk (only with include_usage, as there).
        continuous = bool(_bool(options, "continuous_usage_stats", "stream_options"))
        req.continuous_usage = req.include_usage and continuous
    _check_ignored(body)
    priority = body.get("priority")
    param = "priority"
    if _is_int(priority) and priority == 0:
        # vLLM's `priority` is an integer whose default, 0, is the only value its default
        # (first-come-first-served) scheduler takes: clients written for vLLM send it. No
        # preference, as if absent.
        priority = None
    if priority is None and header_priority is not None:
        priority, param = header_priority.strip().lower(), PRIORITY_HEADER
    if priority is not None:
        if priority not in PRIORITIES:
            raise invalid(
                param,
                f"'{param}' must be one of {', '.join(PRIORITIES)}, "
                f"got {json.dumps(priority)[:40]}",
            )
        req.priority = priority
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    req.model = model or ""
    req.grammar, req.constraint, req.grammar_param = _grammar(body)


# ---- structured output ---------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str) -> str:
    """The llguidance grammar for a schema (as JSON), regex, choice list (as JSON) or
    Lark/GBNF grammar; compiled once per distinct one (clients resend the same schema)."""
    if kind == "json":
        return grammar.json_schema(json.loads(text))
    if kind == "regex":
        return grammar.regex(text)
    if kind == "choice":
        return grammar.choice(json.loads(text))
    return grammar.lark(llguidance.grammar_from("grammar", text))


def _grammar_of(param: str, kind: str, value: Any) -> str:
    # Keys keep their order: a schema's property order is the order the JSON is written in.
    try:  # a schema nested near the body parser's limit overflows the stack here
        text = value if kind in ("regex", "grammar") else json.dumps(value)
    except RecursionError:
        raise invalid(param, f"'{param}' is nested too deeply") from None
    if len(text.encode("utf-8")) > grammar.MAX_GRAMMAR_BYTES:
        raise invalid(param, f"'{param}' is longer than {grammar.MAX_GRAMMAR_BYTES} bytes")
    try:
        return _compiled(kind, text)
    except (grammar.GrammarError, ValueError, RecursionError) as e:
        raise invalid(param, f"'{param}' cannot be used: {str(e)[:500]}") from None


def _response_format(value: Any) -> tuple[str, str] | None:
    """OpenAI's response_format: text (None), json_object (any JSON object) or json_schema; the
    grammar and the field it came from."""
    if not isinstance(value, dict):
        raise _wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar_of("response_format", "json", {"type": "object"}), "response_format"
    if kind != "json_schema":
        raise invalid(
            "response_format.type",
            "'response_format.type' must be one of text, json_object, json_schema, got "
            f"{json.dumps(kind)[:40]}",
        )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _wrong_type(param, "an object", spec)
    if not isinstance(spec.get("name"), str):
        raise APIError(
            400,
            f"'{param}.name' is required (a string)",
            param=f"{param}.name",
            code="missing_required_parameter",
        )
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _wrong_type(f"{param}.description", "a string", spec["description"])
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _wrong_type(f"{param}.strict", "a boolean", spec["strict"])  # always followed
    schema = spec.get("schema", {})  # OpenAI: optional (then any JSON)
    if not isinstance(schema, dict):
        raise _wrong_type(f"{param}.schema", "an object", schema)
    return _grammar_of(f"{param}.schema", "json", schema), f"{param}.schema"


# The fields whose parsing compiles a grammar (app.py parses such a request off the event loop).
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "tools", "tool_choice"})

# vLLM's structured_outputs: exactly one of these, each a different kind of constraint.
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: Any) -> tuple[str, str]:
    """vLLM's structured_outputs: the grammar and the field it came from."""
    if not isinstance(value, dict):
        raise _wrong_type("structured_outputs", "an object", value)
    for key in sorted(value):
        if key not in (*_STRUCTURED_KINDS, "disable_any_whitespace"):
            raise APIError(
                400,
                f"Unrecognized request argument supplied: structured_outputs.{key}",
                param=f"structured_outputs.{key}",
                code="unknown_parameter",
            )
    # Always so here (see engine/grammar.py).
    _bool(value, "disable_any_whitespace", "structured_outputs")
    given = [k for k in _STRUCTURED_KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise invalid(
            "structured_outputs",
            "'structured_outputs' takes exactly one of "
            + ", ".join(_STRUCTURED_KINDS)
            + (f", got {', '.join(given)}" if given else ""),
        )
    kind = given[0]
    param = f"structured_outputs.{kind}"
    item = value[kind]
    if kind == "json_object":
        if item is not True:
            raise _wrong_type(param, "true", item)
        return _grammar_of(param, "json", {"type": "object"}), param
    if kind == "json":
        if isinstance(item, str):  # vLLM also takes the schema as a JSON string
            try:
                item = json.loads(item)
            except (ValueError, RecursionError):
                raise invalid(param, f"'{param}' is not valid JSON") from None
        if not isinstance(item, dict):
            raise _wrong_type(param, "a JSON schema (an object)", item)
    elif kind == "choice":
        if not isinstance(item, list) or not all(isinstance(c, str) for c in item):
            raise _wrong_type(param, "an array of strings", item)
    elif not isinstance(item, str):
        raise _wrong_type(param, "a string", item)
    return _grammar_of(param, kind, item), param


def _grammar(body: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """The request's grammar, what it came from (response_format's type, or
    structured_outputs.<kind>) and the field that holds it."""
    response_format = body.get("response_format")
    structured = body.get("structured_outputs")
    found = None if response_format is None else _response_format(response_format)
    if structured is not None:
        if found is not None:
            raise invalid(
                "structured_outputs",
                "'structured_outputs' and a JSON 'response_format' cannot both be given",
            )
        grammar, param = _structured_outputs(structured)
        return grammar, param, param
    if found is None:
        return None, None, None
    assert isinstance(response_format, dict)  # (found: it is one)
    return found[0], str(response_format["type"]), found[1]


def _begin(
    body: dict[str, Any], kind: str, params: set[str], required: str, header_priority: str | None
) -> tuple[GenerationRequest, Any]:
    """What both endpoints check first: parameters, the common fields, the required input."""
    _check_neutral(body, params)
    req = GenerationRequest(kind=kind, model="")
    _common(body, req, header_priority)
    if required not in body:
        raise APIError(
            400, f"'{required}' is required", param=required, code="missing_required_parameter"
        )
    return req, body[required]


def _one_prompt(param: str, prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt  # "" is the tokenizer's BOS alone (or refused, where it adds none)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise invalid(param, f"'{param}' token ids must be non-negative")
        return list(prompt)
    raise _wrong_type(param, "a string or an array of token ids", prompt)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, token ids, or a batch of either (an array of strings or of
    token-id arrays)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise invalid(
                "prompt", f"'prompt' accepts at most {MAX_CHOICES} prompts, got {len(prompt)}"
            )
        param = "prompt" if len(prompt) == 1 else "prompt[{}]"
        return [_one_prompt(param.format(i), p) for i, p in enumerate(prompt)]
    return [_one_prompt("prompt", prompt)]


def _n(body: dict[str, Any], prompts: int) -> int:
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    if n * prompts > MAX_CHOICES:
        raise invalid(
            "n",
            f"'n' times the number of prompts must be at most {MAX_CHOICES}, "
            f"got {n} x {prompts} = {n * prompts}",
        )
    return n


def parse_completion(body: dict[str, Any], header_priority: str | None = None) -> GenerationRequest:
    req, prompt = _begin(body, "completion", COMPLETION_PARAMS, "prompt", header_priority)
    req.prompts = _prompts(prompt)
    req.n = _n(body, len(req.prompts))
    req.max_tokens = _int(body, "max_tokens", 1)
    if req.max_tokens is None:
        req.max_tokens = 16  # OpenAI's documented default for completions
    req.echo = bool(_bool(body, "echo"))
    # The legacy API: logprobs N returns the sampled token's logprob and the N most likely
    # (0 included: the sampled one only).
    # With echo, the prompt's tokens get entries too (the first one's logprob is null), as
    # evaluation harnesses read them for log-likelihoods.
    n = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if n is not None:
        req.logprobs, req.top_logprobs = True, n
        req.prompt_logprobs = req.echo
    return req


def _message_text(i: int, message: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _wrong_type(param, "an object", message)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(
            f"{param}.role",
            f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}",
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    400,
                    f"'{param}.content[{j}]' must be a text part "
                    '({"type": "text", "text": ...}); other content is not supported',
                    param=f"{param}.content[{j}]",
                    code="unsupported_parameter",
                )
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise _wrong_type(f"{param}.content", "a string or an array of text parts", content)
    out: dict[str, Any] = {"role": role, "content": content}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _wrong_type(f"{param}.name", "a string", name)
        out["name"] = name
    if role == "assistant":
        # Reasoning sent back (the field the answer gave it in): templates such as Qwen3's show
        # it for the turns after the last user message.
        thought = message.get("reasoning_content", message.get("reasoning"))
        if thought is not None:
            if not isinstance(thought, str):
                raise _wrong_type(f"{param}.reasoning_content", "a string", thought)
            out["reasoning_content"] = thought
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _message_tool_calls(f"{param}.tool_calls", message["tool_calls"])
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise _wrong_type(f"{param}.tool_call_id", "a string", message["tool_call_id"])
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _message_tool_calls(param: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as chat templates read them: the arguments
    (a JSON string on the wire) parsed into an object where they parse, as vLLM passes them."""
    if not isinstance(calls, list):
        raise _wrong_type(param, "an array", calls)
    out = []
    for j, call in enumerate(calls):
        at = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _wrong_type(
                at,
                'a tool call ({"id", "type": "function", "function": {"name", "arguments"}})',
                call,
            )
        # id and type may be left out (the call then gets an id of its own), but not be
        # something else: OpenAI refuses that too.
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _wrong_type(f"{at}.id", "a string", call_id)
        kind = call.get("type")
        if kind is not None and kind != "function":
            got = json.dumps(kind)[:40]
            raise invalid(f"{at}.type", f"'{at}.type' must be function, got {got}")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise _wrong_type(f"{at}.function.{key}", "a string", function.get(key))
        try:
            arguments: Any = json.loads(function["arguments"])
        # Arguments that do not parse (broken JSON, or JSON nested deeper than the parser's
        # stack) reach the template as the text they are: they are what the model wrote.
        except (ValueError, RecursionError):
            arguments = function["arguments"]
        out.append(
            {
                "id": f"call_{j}" if call_id is None else call_id,
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


# ---- tool calling (forced) -----------------------------------------------------------------

MAX_TOOLS = 128  # OpenAI's limit
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array", tools)
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"'tools' accepts at most {MAX_TOOLS} tools, got {len(tools)}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _wrong_type(param, 'a tool ({"type": "function", "function": {...}})', tool)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{param}.function", "an object", function)
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise invalid(
                f"{param}.function.name",
                f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-', got "
                f"{json.dumps(name)[:80]}",
            )
        if name in names:
            raise invalid(f"{param}.function.name", f"'{param}.function.name' {name} repeats")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _wrong_type(f"{param}.function.description", "a string", function["description"])
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise _wrong_type(f"{param}.function.strict", "a boolean", function["strict"])
        # No parameters: the call takes none (its arguments are {}), as OpenAI's.
        parameters = function.get(
            "parameters", {"type": "object", "properties": {}, "additionalProperties": False}
        )
        if not isinstance(parameters, dict):
            raise _wrong_type(
                f"{param}.function.parameters", "a JSON schema (an object)", parameters
            )
        # Each schema is checked on its own, so an error names its tool.
        _grammar_of(f"{param}.function.parameters", "json", parameters)
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


# Keywords whose values are data, not schemas: a "$ref" key in them is not a reference.
_SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return any(
            (k == "$ref" and isinstance(v, str) and v.startswith("#"))
            or (k not in _SCHEMA_DATA and _has_local_ref(v))
            for k, v in schema.items()
        )
    return isinstance(schema, list) and any(_has_local_ref(v) for v in schema)


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local $refs ("#" + pointer) re-pointed under `base`, where the schema
    is placed within a larger one."""
    if isinstance(schema, dict):
        return {
            k: (
                base + v[1:]
                if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else v
                if k in _SCHEMA_DATA
                else _rebased(v, base)
            )
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def _tool_choice(body: dict[str, Any], req: GenerationRequest, tool_parser: str | None) -> None:
    """Forced tool calls: tool_choice "required" (one call or more, of any tool: a JSON array of
    {"name", "parameters"}) or a named function (its arguments: JSON of its parameters' schema).
    The grammar makes the call well-formed whatever the model. "auto": free text, in which the
    model family's parser (tool_parsers.py) finds the calls; refused without one."""
    tools = _tools(body)
    choice = body.get("tool_choice")
    parallel = _bool(body, "parallel_tool_calls")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return  # the tools are not shown to the model
    if not tools:
        raise invalid("tool_choice", "'tool_choice' needs 'tools'")
    if choice == "auto" and tool_parser is None:
        raise APIError(
            400,
            "'tool_choice' auto needs a tool-call parser for this model, and its chat template "
            "shows no format the router knows (set the router's --tool-call-parser, e.g. "
            "hermes). 'required' or a named function "
            '({"type": "function", "function": {"name": ...}}) works with any model: the '
            "call is forced, and valid.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if req.grammar is not None:
        # The field the constraint came from: response_format or structured_outputs.
        field = (req.grammar_param or "response_format").split(".")[0]
        how = (
            "the model may answer with a tool call, which the format would not let it write"
            if choice == "auto"
            else "'tool_choice' makes the answer a tool call"
        )
        raise invalid(
            field,
            f"'{field}' cannot be combined with tools when {how}; send 'tool_choice': 'none' "
            "to hold the answer to the format without calls",
        )
    if choice == "auto":  # free text; tool_parsers finds the calls in it
        req.tools, req.tool_choice, req.tool_parser = tools, "auto", tool_parser
        return
    # A forced call ends where its grammar does: a stop string (agent frameworks send theirs
    # with the tools) or stop token would cut its JSON and still report "stop".
    req.stop, req.stop_token_ids = [], []
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice == "required":
        # A tool's schema sits inside the array's: its local $refs ("#/$defs/X", "#") would
        # resolve against the array, so each such schema goes under $defs and its refs with it.
        defs: dict[str, Any] = {}
        for i, (name, schema) in enumerate(by_name.items()):
            if _has_local_ref(schema):
                defs[f"tool{i}"] = _rebased(schema, f"#/$defs/tool{i}")
                by_name[name] = {"$ref": f"#/$defs/tool{i}"}
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": schema},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, schema in by_name.items()
                ]
            },
        }
        if defs:
            calls["$defs"] = defs
        if parallel is False:
            calls["maxItems"] = 1
        req.grammar = _grammar_of("tools", "json", calls)
        req.tool_choice = "required"
        req.constraint, req.grammar_param = "tool_choice.required", "tools"
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and name):
            raise invalid(
                "tool_choice",
                "'tool_choice' must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}, got '
                f"{json.dumps(choice)[:80]}",
            )
        if not isinstance(name, str) or name not in by_name:
            raise invalid(
                "tool_choice", f"'tool_choice' names {json.dumps(name)[:80]}, which no tool is"
            )
        req.grammar = _grammar_of("tools", "json", by_name[name])
        req.tool_choice = name
        req.constraint = "tool_choice.function"
        req.grammar_param = f"tools[{list(by_name).index(name)}].function.parameters"
    req.tools = tools


MAX_TEMPLATE_KWARGS_BYTES = 16 << 10
# Variables the router itself gives the template: chat_template_kwargs may not replace them.
_TEMPLATE_OWN = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token",
     "eos_token"}
)  # fmt: skip


def _template_controls(body: dict[str, Any], req: GenerationRequest) -> None:
    """add_generation_prompt, continue_final_message and chat_template_kwargs (vLLM's): a
    prefilled assistant answer to go on from (`continue_final_message`: the template's end of
    turn is cut off), and template variables such as Qwen3's `enable_thinking`."""
    add = _bool(body, "add_generation_prompt")
    cont = bool(_bool(body, "continue_final_message"))
    if cont and add:
        raise invalid(
            "continue_final_message",
            "'continue_final_message' continues the last message; it cannot be combined with "
            "'add_generation_prompt' true, which opens a new one",
        )
    if cont:
        last = (req.messages or [{}])[-1]
        if last.get("role") != "assistant" or not last.get("content"):
            raise invalid(
                "continue_final_message",
                "'continue_final_message' needs the last message to be the assistant's, with "
                "the text to continue",
            )
    req.continue_final_message = cont
    req.add_generation_prompt = not cont if add is None else add
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise _wrong_type("chat_template_kwargs", "an object", kwargs)
    for key in kwargs:
        if key in _TEMPLATE_OWN:
            raise invalid(
                f"chat_template_kwargs.{key}",
                f"'chat_template_kwargs.{key}' is set by the server (use the request's own "
                "field where there is one)",
            )
    if len(json.dumps(kwargs).encode("utf-8")) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(
            "chat_template_kwargs",
            f"'chat_template_kwargs' is longer than {MAX_TEMPLATE_KWARGS_BYTES} bytes",
        )
    req.template_kwargs = dict(kwargs)


def tool_answer(
    req: GenerationRequest, text: str, finish_reason: str | None, call_id: str
) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """A tool-choice answer as (content, tool calls, finish reason). A named function's call is
    the text (its arguments; "stop" as OpenAI reports a forced call). "required": the array of
    calls ("tool_calls"); cut short by max_tokens it does not parse: no calls, the text stays.
    "auto": the calls the parser finds ("tool_calls"), else the text alone."""
    if req.tool_choice == "auto":
        names = {t["function"]["name"] for t in req.tools or []}
        found = tool_parsers.parse(text, names, req.tool_parser or "hermes")
        if found is None:
            return text, None, finish_reason
        content, calls = found
        return content, tool_parsers.calls_with_ids(calls, call_id), "tool_calls"
    if req.tool_choice != "required":
        call = {"name": req.tool_choice, "arguments": text}
        return None, [{"id": call_id, "type": "function", "function": call}], finish_reason
    try:
        items = json.loads(text)
    except ValueError:
        return text, None, finish_reason
    calls = [
        {"name": item["name"], "arguments": json.dumps(item["parameters"], ensure_ascii=False)}
        for item in items
    ]
    return None, tool_parsers.calls_with_ids(calls, call_id), "tool_calls"


def parse_chat(
    body: dict[str, Any], header_priority: str | None = None, tool_parser: str | None = None
) -> GenerationRequest:
    """tool_parser: how this model writes tool calls (tool_parsers.py), for tool_choice auto."""
    req, messages = _begin(body, "chat", CHAT_PARAMS, "messages", header_priority)
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise invalid("messages", "'messages' must not be empty")
    req.messages = [_message_text(i, m) for i, m in enumerate(messages)]
    _tool_choice(body, req, tool_parser)
    _template_controls(body, req)
    req.n = _n(body, 1)
    # Both are validated; the newer max_completion_tokens wins when both are given.
    max_completion_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1)
    req.max_tokens = max_tokens if max_completion_tokens is None else max_completion_tokens
    if max_completion_tokens is not None:
        req.max_tokens_param = "max_completion_tokens"
    req.logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None:
        if top and not req.logprobs:
            raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        req.top_logprobs = top
    return req


# ---- responses -----------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        # A thinking model's part, in both fields clients read: `reasoning` (vLLM's now) and
        # `reasoning_content` (vLLM's before, still what LiteLLM and others read). Nothing
        # after the reasoning: no content (null, as vLLM answers).
        message["reasoning"] = message["reasoning_content"] = reasoning
        if not text:
            message["content"] = None
    if calls is not None:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta_choice(
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def response(
    kind: str,
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    use: dict[str, Any] | None,
    chunk: bool,
) -> dict[str, Any]:
    """A whole answer (chunk=False, with usage) or one SSE chunk of /v1/completions (`kind`
    "completion") or /v1/chat/completions ("chat")."""
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"  # the legacy API names its chunks the same
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if not chunk:
        out["usage"] = use
    return out


@dataclass
class TokenLogprob:
    """One token's logprob entry, already turned into text (TokenText). The prompt's first
    token has none (logprob None): nothing comes before it."""

    text: str
    raw: bytes
    logprob: float | None
    top: list[tuple[str, bytes, float]]  # most likely first
    # The bytes the token adds to the choice's text where that is not `raw`: none for a
    # special token, which the text leaves out (an echoed prompt's BOS).
    shown: bytes | None = None

    @property
    def text_bytes(self) -> bytes:
        return self.raw if self.shown is None else self.shown


def _entry(text: str, raw: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """choices[].logprobs of the chat API for these tokens."""
    content = [
        {**_entry(e.text, e.raw, e.logprob), "top_logprobs": [_entry(*t) for t in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


class TextCursor:
    """Where the next token starts in a choice's text, carried from chunk to chunk (so a
    streamed answer never decodes what it already sent again). Bytes no character can be made
    of count as the one U+FFFD the text shows for them; a character still incomplete before a
    token counts only if the token does not go on with it (a token holding part of a
    character, shown as `bytes:\\xNN`, starts where its character does)."""

    def __init__(self, before: bytes = b"") -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = len(self._decoder.decode(before))

    def offsets(self, entries: list[TokenLogprob]) -> list[int]:
        """Each entry's offset, advancing past them."""
        offsets: list[int] = []
        for e in entries:
            raw = e.text_bytes
            pending = self._decoder.getstate()[0]
            at = self._chars
            if pending and raw:
                try:
                    codecs.utf_8_decode(pending + raw[:1], "strict", False)
                except UnicodeDecodeError:
                    at += 1  # the character ends unfinished: the text shows one U+FFFD for it
            offsets.append(at)
            self._chars += len(self._decoder.decode(raw))
        return offsets


def completion_logprobs(
    entries: list[TokenLogprob], before: bytes | TextCursor = b""
) -> dict[str, Any]:
    """choices[].logprobs of the legacy completions API for these tokens; `before`: the
    choice's TextCursor, or the text bytes of its tokens before them (TokenLogprob.text_bytes),
    for text_offset."""
    cursor = before if isinstance(before, TextCursor) else TextCursor(before)
    offsets = cursor.offsets(entries)
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:  # the prompt's first token (echo): null, as OpenAI's
            tops.append(None)
            continue
        # The sampled token is always there (legacy API: up to logprobs + 1 entries).
        top = {text: logprob for text, _raw, logprob in e.top}
        top.setdefault(e.text, e.logprob)
        tops.append(top)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage_chunk(
    rid: str, model: str, created: int, kind: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {**response(kind, rid, model, created, [], None, chunk=True), "usage": use}


def model_object(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "splitserve",
        "max_model_len": max_model_len,
    }


def models_response(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(model, created, max_model_len)]}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
