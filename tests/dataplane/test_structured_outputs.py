"""Structured output through the router, on real processes: the official `openai` client asks
for a JSON schema (`response_format`), vLLM-style clients for a regex or a choice
(`structured_outputs`); a prefill worker samples the first token under the grammar and a decode
worker the rest. The model has random weights, so only the grammar makes the output valid."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from structured_schemas import PERSON, check_person
from test_openai_client import (
    _error,
    _post,
    _request_log,
    assert_blocks_back,
    decode_load,
    wait_ready,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def stack(tiny_model: Path, launch_module_worker: Any, worker_flags: Any) -> dict[str, Any]:
    prefill = launch_module_worker("prefill", worker_flags(tiny_model))
    decode = launch_module_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "512"))
    colocated = launch_module_worker("colocated", worker_flags(tiny_model))
    routers, processes = {}, {}
    for name, pools in {
        "disaggregated": [
            "--prefill",
            prefill.endpoint,
            "--decode",
            decode.endpoint,
            "--log-requests",
        ],
        # This one refuses tool_choice auto (its model's template would make it hermes).
        "colocated": ["--colocated", colocated.endpoint, "--tool-call-parser", "none"],
    }.items():
        router = launch_module_worker(
            "router",
            [
                "--model",
                str(tiny_model),
                "--model-name",
                "tiny",
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                *pools,
            ],  # fmt: skip
            name=f"router-{name}",
        )
        routers[name] = f"http://127.0.0.1:{router.port}"
        processes[name] = router
        wait_ready(routers[name])
    return {
        "base": routers["disaggregated"],
        "colocated": routers["colocated"],
        "decode": decode,
        "router": processes["disaggregated"],
    }


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_answers_follow_the_schema(stack: dict[str, Any]) -> None:
    initial = decode_load(stack).free_blocks
    answer = client(stack["base"]).chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=PERSON_FORMAT,  # type: ignore[arg-type]
        temperature=1.0,
        seed=7,
        n=4,
        max_tokens=200,
    )
    values = []
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        value = json.loads(choice.message.content)
        check_person(value)
        assert list(value) == list(PERSON["properties"])  # written in the schema's order
        values.append(value)
    assert len({json.dumps(v) for v in values}) > 1  # four samples, not one answer four times
    assert_blocks_back(stack, initial)


def test_streamed_json_equals_the_non_streamed_answer(stack: dict[str, Any]) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        response_format=PERSON_FORMAT,
        temperature=0.9,
        seed=3,
        max_tokens=200,
    )
    whole = client(stack["base"]).chat.completions.create(**kw)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client(stack["base"]).chat.completions.create(stream=True, **kw)
        if chunk.choices
    )
    assert text == whole.choices[0].message.content
    check_person(json.loads(text))


def test_disaggregated_and_colocated_give_the_same_constrained_answer(
    stack: dict[str, Any],
) -> None:
    # The grammar's state crosses from the prefill worker to the decode worker with the first
    # token: split or not, a seeded constrained answer is the same.
    kw: dict[str, Any] = dict(
        model="tiny", messages=MESSAGES, response_format=PERSON_FORMAT, seed=21, max_tokens=200
    )
    split = client(stack["base"]).chat.completions.create(**kw)
    together = client(stack["colocated"]).chat.completions.create(**kw)
    assert split.choices[0].message.content == together.choices[0].message.content


def test_json_object_mode_and_completions(stack: dict[str, Any]) -> None:
    answer = client(stack["base"]).completions.create(
        model="tiny",
        prompt="A JSON object:",
        max_tokens=120,
        temperature=0.7,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = answer.choices[0].text
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (
            {"choice": ["positive", "negative", "neutral"]},
            lambda t: t in ("positive", "negative", "neutral"),
        ),  # noqa: E501
        (
            {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
            lambda t: isinstance(json.loads(t), list) and len(json.loads(t)) <= 3,
        ),  # fmt: skip
        ({"grammar": 'root ::= "a" [bc]+ "d"'}, lambda t: re.fullmatch("a[bc]+d", t)),
    ],
    ids=["regex", "choice", "json", "gbnf"],
)
def test_structured_outputs_extension(
    stack: dict[str, Any], structured: dict[str, Any], check: Any
) -> None:
    answer = client(stack["base"]).chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=1.0,
        seed=5,
        n=3,
        max_tokens=60,
        extra_body={"structured_outputs": structured},
    )
    for choice in answer.choices:
        if "grammar" in structured and choice.finish_reason == "length":
            continue  # [bc]+ may run on; what came is still checked by the others
        assert choice.finish_reason == "stop"
        assert check(choice.message.content), choice.message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },  # noqa: E501
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace": 1}}, "structured_outputs.whitespace"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        (
            {"structured_outputs": {"json": {"type": "string", "pattern": "a" * 70000}}},
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": "yes"},
                }
            },  # noqa: E501
            "response_format.json_schema.strict",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    stack: dict[str, Any], body: dict[str, Any], param: str
) -> None:
    r = _post(stack, "/v1/chat/completions", json.dumps({"messages": MESSAGES, **body}))
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param
    assert param in err["message"]


def test_text_format_is_free_text(stack: dict[str, Any]) -> None:
    # response_format {"type": "text"} is the default: the same answer as without it.
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain = httpx.post(stack["base"] + "/v1/chat/completions", json=body, timeout=60).json()
    text = httpx.post(
        stack["base"] + "/v1/chat/completions",
        json={**body, "response_format": {"type": "text"}},
        timeout=60,
    ).json()
    assert plain["choices"][0]["message"] == text["choices"][0]["message"]


# ---- forced tool calls ---------------------------------------------------------------------

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "make_person", "parameters": PERSON}},
    {
        "type": "function",
        "function": {"name": "pick_color", "description": "Pick one.", "parameters": COLOR},
    },
]
NAMED = {"type": "function", "function": {"name": "make_person"}}


def check_call(name: str, arguments: str) -> None:
    value = json.loads(arguments)
    if name == "make_person":
        check_person(value)
    else:
        assert name == "pick_color" and set(value) == {"color"}
        assert value["color"] in ("red", "green", "blue")


def sample_tools(stack: dict[str, Any], tool_choice: Any, **kw: Any) -> Any:
    """A sampled (temperature 1) chat answer with TOOLS and this tool_choice."""
    return client(stack["base"]).chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice,
        temperature=1.0,
        max_tokens=200,
        **kw,
    )


def test_a_named_tool_choice_forces_a_valid_call(stack: dict[str, Any]) -> None:
    answer = sample_tools(stack, NAMED, seed=4, n=3)
    ids = set()
    for choice in answer.choices:
        assert choice.finish_reason == "stop"  # as OpenAI reports a forced call
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "make_person"
        check_call(call.function.name, call.function.arguments)
        ids.add(call.id)
    assert len(ids) == 3


def test_stop_strings_do_not_cut_a_forced_call(stack: dict[str, Any]) -> None:
    answer = sample_tools(stack, NAMED, stop=[",", '"'], seed=4)  # in every answer of PERSON's
    (call,) = answer.choices[0].message.tool_calls or []
    check_call(call.function.name, call.function.arguments)


def test_required_tool_choice_gives_calls_of_the_given_tools(stack: dict[str, Any]) -> None:
    answer = sample_tools(stack, "required", parallel_tool_calls=False, seed=9, n=6)
    names = set()
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []  # parallel_tool_calls false: exactly one
        check_call(call.function.name, call.function.arguments)
        names.add(call.function.name)
    assert names <= {"make_person", "pick_color"}


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_tool_calls_equal_the_whole_answer(
    stack: dict[str, Any], tool_choice: Any
) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0.9,
        seed=2,
        max_tokens=200,
    )
    whole = client(stack["base"]).chat.completions.create(**kw).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    reasons = []
    for chunk in client(stack["base"]).chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            assert not choice.delta.content
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"arguments": ""})
                if delta.id:
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == whole.finish_reason and not any(reasons[:-1])
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or []
    ]
    assert all(call.pop("id").startswith("call_") for call in calls.values())
    assert [calls[i] for i in sorted(calls)] == expected
    for call in expected:
        check_call(call["name"], call["arguments"])


def _prompt_tokens(stack: dict[str, Any], **body: Any) -> int:
    r = httpx.post(
        stack["base"] + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_the_tools_reach_the_chat_template(stack: dict[str, Any]) -> None:
    # make-model's template lists the tools in a system turn (as Qwen's do): a forced call's
    # prompt is longer by them; with tool_choice none the model is not shown them.
    plain = _prompt_tokens(stack)
    assert _prompt_tokens(stack, tools=TOOLS, tool_choice="none") == plain
    assert _prompt_tokens(stack, tools=TOOLS, tool_choice="required") > plain + 20
    # An earlier call and its result are part of the conversation the template renders.
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "pick_color", "arguments": '{"color": "red"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    bare = [*MESSAGES, {"role": "assistant", "content": ""}, {"role": "tool", "content": "ok"}]
    assert _prompt_tokens(stack, messages=history) > _prompt_tokens(stack, messages=bare)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "a b"}}],
                "tool_choice": "required",
            },
            "tools[0].function.name",
            "invalid_value",
        ),
        (
            {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"},
            "tools[1].function.name",
            "invalid_value",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objekt"}},
                    }
                ],  # noqa: E501
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "invalid_value",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "invalid_type"),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
            "invalid_value",
        ),
        # auto (the default with tools) lets the model write a call the format would forbid;
        # the 400 names the field the format came in (it said response_format for both).
        (
            {"tools": TOOLS, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "invalid_value",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}},
            "structured_outputs",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
            "messages[0].tool_calls[0]",
            "invalid_type",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    stack: dict[str, Any], body: dict[str, Any], param: str, code: str
) -> None:
    r = _post(stack, "/v1/chat/completions", json.dumps({"messages": MESSAGES, **body}))
    assert r.status_code == 400, r.text
    err = _error(r)
    assert (err["param"], err["code"]) == (param, code)
    assert param.split("[")[0] in err["message"]


def test_completions_take_no_tools(stack: dict[str, Any]) -> None:
    r = _post(stack, "/v1/completions", json.dumps({"prompt": "x", "tools": TOOLS}))
    assert r.status_code == 400 and _error(r)["param"] == "tools"


@pytest.mark.parametrize("pool", ["base", "colocated"])
@pytest.mark.parametrize(
    ("regex", "why"),
    [
        # No token can begin it: refused when the worker compiles it (its first mask). It used
        # to be a 200 with "" and finish_reason "stop".
        ("[^\\s\\S]", ""),
        # A lexer limit met at the first token: the prefill worker's 400 had no param and
        # pointed the client at the worker's log, the colocated worker's was a 502.
        ("(a{1000}){1000}", "lexer error: too many expressions constructed (at the first token)"),
    ],
)
def test_a_grammar_the_workers_cannot_start_is_a_400(
    stack: dict[str, Any], pool: str, regex: str, why: str
) -> None:
    # The router's check compiles it, but the workers' grammar engine cannot start it: the
    # router answers 400 naming the field, without retrying elsewhere.
    body = {"messages": MESSAGES, "structured_outputs": {"regex": regex}, "max_tokens": 2}
    r = httpx.post(stack[pool] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == "structured_outputs.regex"
    assert err["message"].startswith("'structured_outputs.regex' cannot be used: ")
    assert err["message"].endswith(why) and "log" not in err["message"]


@pytest.mark.parametrize("pool", ["base", "colocated"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_parser_fails_on_after_its_first_token_is_a_400(
    stack: dict[str, Any], pool: str, stream: bool
) -> None:
    # 500 optional properties compile and allow "{", but consuming it takes llguidance's
    # Earley parser past its 2000 items per row. The prefill worker feeds its first token to
    # its own matcher, so the request is refused before that token goes out (it was a 502,
    # "first_token: ... is not allowed", from the decode worker after the 200 had started).
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    body = {
        "prompt": "x",
        "max_tokens": 5,
        "stream": stream,
        "structured_outputs": {"json": schema},
    }
    r = httpx.post(stack[pool] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == "structured_outputs.json", err
    assert "max is 2000" in err["message"] and err["message"].endswith("(at the first token)")


def test_a_grammar_complete_at_max_tokens_is_a_stop(stack: dict[str, Any]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "structured_outputs": {"choice": ["a"]}}
    r = httpx.post(stack["colocated"] + "/v1/chat/completions", json=body, timeout=60)
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a", "stop")


def test_one_of_is_served_as_any_of(stack: dict[str, Any]) -> None:
    # pydantic writes a discriminated union as oneOf.
    pets = [
        {
            "type": "object",
            "properties": {"kind": {"const": kind}},
            "required": ["kind"],
            "additionalProperties": False,
        }
        for kind in ("cat", "dog")
    ]
    schema = {"oneOf": pets}
    answer = client(stack["base"]).chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
    )
    assert json.loads(answer.choices[0].message.content or "")["kind"] in ("cat", "dog")


def test_auto_tool_choice_answers_in_free_text(stack: dict[str, Any]) -> None:
    # make-model's template renders calls as <tool_call> JSON, so the router parses hermes
    # calls; a random-weight model writes none (tests/dataplane/test_tool_parsers.py covers
    # answers that do), and its text comes back as the content.
    for tool_choice in (None, "auto"):  # auto is the default with tools
        extra = {} if tool_choice is None else {"tool_choice": tool_choice}
        answer = client(stack["base"]).chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=20,
            **extra,  # type: ignore[arg-type]
        )
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str) and not choice.message.tool_calls
        assert answer.usage is not None
        assert answer.usage.prompt_tokens > _prompt_tokens(stack) + 20  # the tools are shown


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_tool_choice_without_a_parser_is_refused(
    stack: dict[str, Any], tool_choice: str | None
) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    r = httpx.post(stack["colocated"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert (err["param"], err["code"]) == ("tool_choice", "unsupported_parameter")
    assert "--tool-call-parser" in err["message"]


def test_the_request_log_names_the_constraint(stack: dict[str, Any]) -> None:
    c = client(stack["base"])
    kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, max_tokens=60)
    schema = c.chat.completions.create(response_format=PERSON_FORMAT, **kw)
    assert _request_log(stack, schema.id)["constraint"] == "json_schema"
    regex = c.chat.completions.create(extra_body={"structured_outputs": {"regex": "[ab]+"}}, **kw)
    assert _request_log(stack, regex.id)["constraint"] == "structured_outputs.regex"
    named = c.chat.completions.create(tools=TOOLS, tool_choice=NAMED, **kw)
    record = _request_log(stack, named.id)
    assert (record["constraint"], record["tool_choice"]) == ("tool_choice.function", "function")
    plain = c.chat.completions.create(**kw)
    record = _request_log(stack, plain.id)
    assert (record["constraint"], record["tool_choice"]) == (None, None)
