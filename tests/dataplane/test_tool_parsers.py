"""tool_choice auto: the hermes parser (tool_parsers.py) finds `<tool_call>` JSON calls in a
model's free text, whole or streamed. A model with random weights never writes a call, so the
call path is tested here on the text itself, through the router's own delta assembly
(`_Answer._chunk`); tests/dataplane/test_structured_outputs.py sends auto requests to real
processes (accepted, tools in the template, answered as text)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from splitserve_workers.router import openai_api as api
from splitserve_workers.router import tool_parsers
from splitserve_workers.router.app import _Answer

NAMES = {"get_weather", "pick_color"}
CALL_1 = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
)
CALL_2 = (
    '<tool_call>\n{"name": "pick_color", "arguments": "{\\"color\\": \\"red\\"}"}\n</tool_call>'
)


def test_calls_after_content_are_parsed() -> None:
    found = tool_parsers.parse("Let me check.\n" + CALL_1 + "\n" + CALL_2, NAMES)
    assert found is not None
    content, calls = found
    assert content == "Let me check.\n"
    assert [c["name"] for c in calls] == ["get_weather", "pick_color"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {"color": "red"}  # a JSON string, unwrapped
    assert tool_parsers.parse(CALL_1, NAMES) == (None, calls[:1])  # no content at all


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a given tool
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
        CALL_1 + " and then some words",
        CALL_1 + " words " + CALL_2,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": ',  # cut inside the JSON
        "I would write <tool_call> here",
    ],
)
def test_anything_but_well_formed_calls_is_text(text: str) -> None:
    assert tool_parsers.parse(text, NAMES) is None


def test_a_last_call_without_its_closing_tag_counts() -> None:
    # stop=["</tool_call>"], or EOS right after the JSON, ends the text before the close.
    unclosed = CALL_2.removesuffix("\n</tool_call>")
    found = tool_parsers.parse("Hm.\n" + CALL_1 + "\n" + unclosed, NAMES)
    assert found is not None and [c["name"] for c in found[1]] == ["get_weather", "pick_color"]


def test_detect_follows_the_chat_template() -> None:
    assert tool_parsers.detect("{{ x }}<tool_call>\n{{ c }}\n</tool_call>") == "hermes"
    assert tool_parsers.detect("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    # Llama 3.2 1B/3B: no built-in tools, so no <|python_tag|>; calls render as Llama 3.1's.
    llama32 = (
        "{%- set tool_call = message.tool_calls[0].function %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
        "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
        '{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}'
    )
    assert tool_parsers.detect(llama32) == "llama3_json"
    assert tool_parsers.detect("{{ messages }}") is None
    assert tool_parsers.detect(None) is None


@pytest.mark.parametrize(
    "text",
    ["Sure.\n" + CALL_1, "a <toolbox> and <tool_ca", "<<tool_call>" + CALL_1[11:], "plain"],
)
def test_the_stream_splitter_releases_exactly_the_content(text: str) -> None:
    # Whatever the pieces (one character at a time here), content goes out as soon as it is
    # surely not a tag, and nothing is lost or repeated.
    for size in (1, 3, 7, len(text)):
        splitter = tool_parsers.StreamSplitter()
        released = "".join(splitter.feed(text[i : i + size]) for i in range(0, len(text), size))
        pending, held = splitter.finish()
        assert released + pending + held == text
        at = text.find("<tool_call>")
        assert held == (text[at:] if at >= 0 else "")
        if at < 0:
            assert released == text[: len(text) - len(pending)]
            assert len(pending) < len("<tool_call>")


LLAMA_1 = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA_2 = '{"name": "pick_color", "parameters": {"color": "red"}}'


def test_llama3_json_calls_are_the_whole_answer() -> None:
    one = tool_parsers.parse(" " + LLAMA_1 + "\n", NAMES, "llama3_json")
    assert one == (None, [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}])
    two = tool_parsers.parse(LLAMA_1 + "; " + LLAMA_2, NAMES, "llama3_json")
    assert two is not None and [c["name"] for c in two[1]] == ["get_weather", "pick_color"]
    for text in (
        "The weather is " + LLAMA_1,  # text first: content, as Llama writes calls alone
        LLAMA_1 + " done",
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": ',  # cut short
        '{"answer": 42}',
    ):
        assert tool_parsers.parse(text, NAMES, "llama3_json") is None, text


def auto_answer(tools: list[str], parser: str = "hermes") -> _Answer:
    """An answer to a tool_choice auto request (call from a running event loop)."""
    router = SimpleNamespace(options=SimpleNamespace(model_name="m"))
    req = api.GenerationRequest(kind="chat", model="m", tool_choice="auto", tool_parser=parser)
    req.tools = [{"type": "function", "function": {"name": n}} for n in tools]
    return _Answer(router, req, "chatcmpl-x", [])  # type: ignore[arg-type]


def stream(text: str, size: int, parser: str = "hermes") -> list[dict[str, Any]]:
    """The chunks a choice streaming `text` in pieces of `size` sends (its deltas' choices)."""
    answer = auto_answer(sorted(NAMES), parser)
    run: Any = SimpleNamespace(index=0, first=True)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = []
    for i, piece in enumerate(pieces):
        reason = "stop" if i == len(pieces) - 1 else None
        chunk = answer._chunk(run, piece, reason, None)
        if chunk is not None:
            out.append(chunk["choices"][0])
    return out


@pytest.mark.parametrize("size", [1, 4, 1000])
async def test_streamed_auto_calls_arrive_whole_in_the_last_chunk(size: int) -> None:
    text = "Checking.\n" + CALL_1 + "\n" + CALL_2
    chunks = stream(text, size)
    assert chunks[0]["delta"]["role"] == "assistant"
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == "Checking.\n"
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    calls = last["delta"]["tool_calls"]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"),
        (1, "function", "pick_color"),
    ]
    assert calls[0]["id"].startswith("call_") and calls[1]["id"] == calls[0]["id"] + "_1"
    # The whole answer says the same.
    req = auto_answer(sorted(NAMES)).req
    whole_content, whole_calls, reason = api.tool_answer(req, text, "stop", calls[0]["id"])
    assert (whole_content, reason) == ("Checking.\n", "tool_calls")
    assert whole_calls == [{k: v for k, v in c.items() if k != "index"} for c in calls]


async def test_a_streamed_answer_without_calls_is_all_content() -> None:
    text = "I would write <tool_call> but I will not."
    chunks = stream(text, 2)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["delta"] for c in chunks)


@pytest.mark.parametrize("size", [1, 5, 1000])
async def test_streamed_llama3_json_calls_and_content(size: int) -> None:
    calls_chunks = stream("\n" + LLAMA_1 + ";" + LLAMA_2, size, "llama3_json")
    assert not "".join(c["delta"].get("content") or "" for c in calls_chunks).strip()
    last = calls_chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == [
        "get_weather",
        "pick_color",
    ]
    text = "  It is sunny, no call needed."
    chunks = stream(text, size, "llama3_json")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["finish_reason"] == "stop"
    if size == 1:  # content streams once the first character shows it is not a call
        assert len(chunks) > len(text) // 2


@pytest.mark.parametrize(
    "text, parser",
    [
        ('<tool_call>{"name": ["get_weather"], "arguments": {}}</tool_call>', "hermes"),
        ('<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>', "hermes"),
        ('{"name": ["get_weather"], "parameters": {}}', "llama3_json"),
        ('{"name": "get_weather", "parameters": {}}; 5', "llama3_json"),
    ],
)
def test_a_call_of_the_wrong_shape_is_text_not_an_error(text: str, parser: str) -> None:
    # The model writes what it writes: a name that is not a string, or a non-object after
    # ';', is no call (these raised TypeError: a 500 after the whole generation).
    assert tool_parsers.parse(text, NAMES, parser) is None


def _required_grammar(*tools: dict[str, Any]) -> str:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": list(tools)}
    req = api.parse_chat(body | {"tool_choice": "required"}, None, "hermes")
    assert req.grammar is not None
    return req.grammar


def test_required_keeps_each_tools_local_refs() -> None:
    # A tool's "#/$defs/X" (pydantic's nested models) or "#" resolved against the array of
    # calls around it: a 400 "Pointer ... does not exist", or silently the wrong grammar.
    loc = {"type": "object", "properties": {"city": {"type": "string"}}}
    with_defs = {
        "type": "object",
        "$defs": {"Loc": loc},
        "properties": {"at": {"$ref": "#/$defs/Loc"}},
    }
    recursive = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
    }
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": with_defs}},
        {"type": "function", "function": {"name": "g", "parameters": recursive}},
    ]
    grammar = json.loads(_required_grammar(*tools))["grammars"][0]["json_schema"]
    assert grammar["$defs"]["tool0"]["properties"]["at"] == {"$ref": "#/$defs/tool0/$defs/Loc"}
    assert grammar["$defs"]["tool1"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool1"}


def test_a_tool_choice_name_of_the_wrong_type_is_a_400() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": ["f"]}},
    }
    with pytest.raises(api.APIError) as e:
        api.parse_chat(body, None, "hermes")
    assert e.value.status == 400 and e.value.param == "tool_choice"
