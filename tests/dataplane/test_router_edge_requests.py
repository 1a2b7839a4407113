"""Router requests at the edge of the OpenAI API: `GET /v1/models/{id}` (the openai client's
`models.retrieve`), a body that does not match its Content-Encoding, booleans where a neutral
number is expected, `max_tokens` next to `max_completion_tokens`, and HTTP that aiohttp refuses
before any route runs (a header over its size limit, a garbled request line). Each is a 4xx
naming the field or the fault in the API's JSON shape (or a 200), never a 500. The HTTP cases
run the real aiohttp app in-process without workers: none of them reaches a worker."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI
from aiohttp.test_utils import TestClient, TestServer
from splitserve_workers.router import openai_api as api
from splitserve_workers.router.app import AppRunner, Router, RouterOptions, load_tokenizer
from splitserve_workers.router.discovery import StaticDiscovery


def router_on_nothing(tiny_model: Path, max_model_len: int = 1024) -> Router:
    options = RouterOptions(
        model_name="tiny",
        model_dir=str(tiny_model),
        max_model_len=max_model_len,
        # Nothing listens there; no request below gets as far as a worker.
        discovery=StaticDiscovery(["127.0.0.1:9"], ["127.0.0.1:9"], []),
        poll_interval=5.0,
    )
    return Router(options, load_tokenizer(str(tiny_model)))


@pytest.fixture
async def client(tiny_model: Path) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(router_on_nothing(tiny_model).app())) as c:
        yield c


@contextlib.asynccontextmanager
async def router_runner(tiny_model: Path) -> AsyncIterator[int]:
    """The router's own runner (what `splitserve router` serves with) on a real socket; its
    port."""
    runner = AppRunner(router_on_nothing(tiny_model).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def raw_exchange(
    port: int, request: bytes, timeout: float = 30
) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as-is on a fresh connection; (status, headers, body) of the answer, read
    until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout)  # the error answer closes the connection
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    ("case", "request_bytes", "words"),
    [
        (
            "header over the size limit",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
            "header",
        ),
        ("garbled request line", b"HELLO THERE\r\n\r\n", "method"),
    ],
)
async def test_http_refused_before_routing_gets_a_json_error(
    tiny_model: Path, case: str, request_bytes: bytes, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with router_runner(tiny_model) as port:
        status, headers, body = await raw_exchange(port, request_bytes)
        assert status == 400, (case, body)
        assert headers["content-type"].startswith("application/json"), headers
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_http_request"
        assert words in error["message"].lower(), error
        # A client's fault: no ERROR (aiohttp's default logs a traceback for each).
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        # The server is fine afterwards: a well-formed request on a new connection is answered.
        status, _, body = await raw_exchange(
            port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"


async def test_models_retrieve_by_id(client: TestClient) -> None:
    r = await client.get("/v1/models/tiny")
    assert r.status == 200
    body = await r.json()
    assert body["id"] == "tiny" and body["object"] == "model"
    assert body == (await (await client.get("/v1/models")).json())["data"][0]
    r = await client.get("/v1/models/org/other")
    assert r.status == 404
    error = (await r.json())["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'org/other' does not exist" in error["message"]
    # A long name is echoed cut short (it was echoed whole, and logged whole).
    r = await client.post("/v1/completions", json={"model": "x" * 300000, "prompt": "hi"})
    assert r.status == 404
    message = (await r.json())["error"]["message"]
    assert f"'{'x' * 80}... (300000 characters)'" in message and len(message) < 200


async def test_body_not_matching_its_content_encoding_is_a_400(client: TestClient) -> None:
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    # aiohttp closes a connection whose payload failed to decode: do not reuse it below.
    bad = {**headers, "connection": "close"}
    r = await client.post("/v1/completions", data=b"not gzip at all", headers=bad)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["code"] == "invalid_body" and error["type"] == "invalid_request_error"
    # A body that is gzip is still read (and here refused for its content, not its encoding).
    body = gzip.compress(json.dumps({"prompt": "hi", "n": 0}).encode())
    r = await client.post("/v1/completions", data=body, headers=headers)
    assert r.status == 400 and (await r.json())["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n", True),
        ("best_of", True),
        ("presence_penalty", False),
        ("logprobs", False),
        ("logit_bias", {"1": True}),
    ],
)
def test_boolean_is_not_a_neutral_number(name: str, value: bool) -> None:
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", name: value})
    assert err.value.status == 400 and err.value.param == name


def test_neutral_values_still_pass() -> None:
    body = {"prompt": "x", "n": 1, "best_of": 1.0, "presence_penalty": 0, "logprobs": None}
    assert api.parse_completion(body).prompts == ["x"]
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "n": 1}
    assert api.parse_chat(chat).messages


def test_max_tokens_is_validated_next_to_max_completion_tokens() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(api.APIError) as err:
        api.parse_chat({"messages": messages, "max_completion_tokens": 3, "max_tokens": "abc"})
    assert err.value.param == "max_tokens" and err.value.code == "invalid_type"
    req = api.parse_chat({"messages": messages, "max_completion_tokens": 3, "max_tokens": 7})
    assert req.max_tokens == 3
    assert api.parse_chat({"messages": messages, "max_tokens": 7}).max_tokens == 7


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (rb'{"prompt": "hi \ud800 there"}', "prompt"),
        (rb'{"prompt": "hi", "stop": ["a", "\udfff"]}', "stop[1]"),
        (rb'{"messages": [{"role": "user", "content": "\uDC00"}]}', "messages[0].content"),
        (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # the surrogate UTF-8-encoded, not escaped
        (rb'{"\ud800": 1}', "\\ud800"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(raw: bytes, param: str) -> None:
    with pytest.raises(api.APIError) as err:
        api.parse_json_body(raw)
    assert err.value.status == 400 and err.value.param == param
    json.dumps(err.value.body(), ensure_ascii=False).encode()  # the answer itself is valid UTF-8


def test_surrogate_pairs_are_ordinary_text() -> None:
    assert api.parse_json_body(rb'{"prompt": "\ud83d\ude00"}')["prompt"] == "\U0001f600"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"top_k": 2**31}, "top_k"), ({"stop_token_ids": [1, 2**31]}, "stop_token_ids")],
)
def test_integers_past_int32_are_a_400(extra: dict, param: str) -> None:
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", **extra})
    assert err.value.status == 400 and err.value.param == param
    assert api.parse_completion({"prompt": "x", "top_k": 2**31 - 1}).top_k == 2**31 - 1


def test_vllms_top_k_minus_one_is_every_token() -> None:
    # vLLM's "consider all tokens" value (its old default, still sent by clients written for
    # it) is no cut, as 0 is; below it is a 400 naming the field.
    for value in (-1, 0, -1.0):
        assert api.parse_completion({"prompt": "x", "top_k": value}).top_k == 0
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", "top_k": -2})
    assert err.value.status == 400 and err.value.param == "top_k"


async def test_lone_surrogate_over_http_is_a_400(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    for raw in (rb'{"prompt": "a \ud800"}', rb'{"prompt": "a", "top_k": 99999999999999999999}'):
        r = await client.post("/v1/completions", data=raw, headers=headers)
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_405_names_the_allowed_methods(client: TestClient) -> None:
    r = await client.get("/v1/completions")
    assert r.status == 405
    assert r.headers["Allow"] == "POST"  # RFC 9110: a 405 lists what the resource accepts
    assert r.headers["Content-Type"].startswith("application/json")
    assert (await r.json())["error"]["code"] == "method_not_allowed"


async def test_undecodable_body_is_answered_without_an_error_log(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp meets the payload error a second time when it drains the body after the handler;
    # through the router's own runner that is an INFO line, not "Unhandled exception".
    async with router_runner(tiny_model) as port:
        body = b"not gzip at all" * 100
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body)
        ) + body
        with caplog.at_level(logging.INFO):
            status, _, answer = await raw_exchange(port, request)
        assert status == 400, answer
        assert json.loads(answer)["error"]["code"] == "invalid_body"
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert any("could not be read" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": 1},
            },
            "stream_options.continuous_usage_stats",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": "no"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"metadata": {"team": "a", "cost": 1}}, "metadata.cost"),
    ],
)
def test_an_error_in_a_nested_field_names_its_whole_path(extra: dict, param: str) -> None:
    # The field's own name alone ("include_usage") does not say where in the body it is.
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", **extra})
    assert (err.value.status, err.value.param, err.value.code) == (400, param, "invalid_type")
    assert f"'{param}'" in err.value.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("value", ["x", 5, True, [{"regex": "a"}]])
async def test_structured_outputs_that_is_no_object_is_a_400(
    client: TestClient, path: str, value: object
) -> None:
    # It was read with .get() before its type was checked: a 500 AttributeError.
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    r = await client.post(path, json={**prompt, "structured_outputs": value})
    assert r.status == 400, await r.text()
    error = (await r.json())["error"]
    assert (error["param"], error["code"]) == ("structured_outputs", "invalid_type")
    assert "'structured_outputs' must be an object" in error["message"]


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice"),
        ({"tools": [_tool("f"), _tool("g")], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [_tool("f"), _tool("g")],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tools[1].function.parameters",
        ),
    ],
)
def test_a_constraint_knows_the_field_it_came_from(extra: dict, param: str) -> None:
    # What a worker's refusal of the grammar names (flow.py): the field to change.
    req = api.parse_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert req.grammar is not None and req.grammar_param == param


@pytest.mark.parametrize(
    "key", ["0" * 4300 + "1", "0" * 5000, "00000000001", "4294967296", "1e3", "-1", ""]
)
async def test_a_logit_bias_key_that_is_no_token_id_is_a_400(client: TestClient, key: str) -> None:
    # int() of more than 4300 digits raises ValueError, leading zeros included (a 500, when
    # the length was measured without them).
    r = await client.post("/v1/completions", json={"prompt": "a", "logit_bias": {key: 1}})
    assert r.status == 400, await r.text()
    error = (await r.json())["error"]
    assert error["param"] == "logit_bias" and "keys must be token ids" in error["message"]


def test_logit_bias_keys_may_have_leading_zeros_and_spaces() -> None:
    req = api.parse_completion({"prompt": "a", "logit_bias": {"0007": 5, " 12 ": -1}})
    assert req.logit_bias == {7: 5.0, 12: -1.0}


def _chat(*messages: dict) -> dict:
    return {"messages": [{"role": "user", "content": "x"}, *messages]}


def _call(**fields: object) -> dict:
    """An assistant message with one earlier tool call, `fields` replacing its own."""
    call: dict = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return {"role": "assistant", "content": None, "tool_calls": [{**call, **fields}]}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "y", "name": 5}, "messages[1].name"),
        (_call(id=5), "messages[1].tool_calls[0].id"),
        (_call(type="bogus"), "messages[1].tool_calls[0].type"),
        (_call(function={"name": 5, "arguments": "{}"}), "messages[1].tool_calls[0].function.name"),
        (
            _call(function={"name": "f", "arguments": {"a": 1}}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (_call(function="f"), "messages[1].tool_calls[0]"),
    ],
)
def test_wrong_types_in_messages_are_400s_naming_the_field(message: dict, param: str) -> None:
    # They were dropped (a name), replaced (an id) or taken as they came (a type).
    with pytest.raises(api.APIError) as err:
        api.parse_chat(_chat(message))
    assert err.value.status == 400 and err.value.param == param
    assert f"'{param}'" in err.value.message


def test_messages_names_and_earlier_calls_of_the_right_types_are_kept() -> None:
    req = api.parse_chat(_chat({"role": "user", "content": "y", "name": "bob"}, _call()))
    assert req.messages is not None
    assert req.messages[1]["name"] == "bob"
    assert req.messages[2]["tool_calls"][0]["id"] == "call_1"
    # id and type may be left out, as before: the call gets an id of its own.
    bare = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    req = api.parse_chat(_chat(bare))
    assert req.messages is not None
    assert req.messages[1]["tool_calls"][0] == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "f", "arguments": {}},
    }


async def test_arguments_too_deep_to_parse_reach_the_template_as_text(client: TestClient) -> None:
    # Valid JSON nested deeper than the parser's stack (a RecursionError, answered as a 500)
    # is kept as the text it is, as arguments that are not JSON are: what the model wrote.
    depth = sys.getrecursionlimit() + 10
    deep = "[" * depth + "]" * depth
    body = _chat(_call(function={"name": "f", "arguments": deep}))
    req = api.parse_chat(body)
    assert req.messages is not None
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == deep
    r = await client.post("/v1/chat/completions", json=body)
    # Parsed, rendered and tokenized: refused only for its length (this router's context is
    # 1024 tokens).
    error = (await r.json())["error"]
    assert r.status == 400 and error["code"] == "context_length_exceeded", error
    assert "tokens, leaving no room" in error["message"]


@pytest.mark.parametrize(
    ("name", "value"),
    [("user", 12), ("service_tier", ["auto"]), ("store", "yes"), ("metadata", ["k"])],
)
def test_ignored_fields_are_still_type_checked(name: str, value: object) -> None:
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", name: value})
    assert err.value.status == 400 and err.value.param == name
    assert err.value.code == "invalid_type"


def test_ignored_fields_of_the_right_type_are_accepted() -> None:
    body = {"user": "u-1", "service_tier": "auto", "store": False, "metadata": {"team": "a"}}
    req = api.parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, None)
    assert req.kind == "chat"


async def test_long_prompt_is_tokenized_off_the_event_loop(tiny_model: Path) -> None:
    # Megabytes of prompt take seconds to tokenize. Done on the event loop, nothing else would
    # be answered meanwhile; on the tokenizer threads, /health keeps answering while the long
    # prompt is tokenized (and then refused for the context limit). The context here is long
    # enough that the text's size alone does not rule the prompt out.
    words = " ".join(f"w{i % 997}x{i % 13}" for i in range(350_000))  # ~3 MB
    router = router_on_nothing(tiny_model, max_model_len=500_000)
    async with TestClient(TestServer(router.app())) as client:
        big = asyncio.create_task(client.post("/v1/completions", json={"prompt": words}))
        answered_meanwhile = 0
        while not big.done():
            r = await client.get("/health")
            assert r.status == 200
            answered_meanwhile += 1
        r = await big
        assert r.status == 400
        error = (await r.json())["error"]
        assert error["code"] == "context_length_exceeded" and "tokens" in error["message"]
        assert answered_meanwhile >= 5, answered_meanwhile


def counting_router(tiny_model: Path) -> tuple[Router, list[int]]:
    """A router on no workers whose tokenizer records the length of every text it encodes."""
    router = router_on_nothing(tiny_model)
    calls: list[int] = []
    encode = router.tokenizer.encode

    def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(len(text))
        return encode(text, add_special_tokens)  # type: ignore[no-any-return]

    router.tokenizer.encode = counting_encode
    return router, calls


async def test_a_prompt_too_long_by_its_size_alone_is_never_tokenized(tiny_model: Path) -> None:
    # No token of this vocabulary covers more than max_token_bytes of text, so a prompt of
    # more bytes than 4 x that x the limit cannot fit: refused at once, before the tokenizer
    # threads (where it would hold up the requests behind it).
    router, calls = counting_router(tiny_model)
    bound = 4 * 1024 * router.tokenizer.max_token_bytes
    async with TestClient(TestServer(router.app())) as client:
        r = await client.post("/v1/completions", json={"prompt": "a" * (bound + 1)})
        error = (await r.json())["error"]
        assert r.status == 400 and error["code"] == "context_length_exceeded"
        assert f"your prompt is {bound + 1} bytes" in error["message"]
        assert calls == []
        # Just under the bound it is tokenized (and refused by its token count).
        r = await client.post("/v1/completions", json={"prompt": "a " * (bound // 2)})
        assert r.status == 400 and calls == [bound]


async def test_a_chat_too_long_by_its_rendered_size_is_never_tokenized(tiny_model: Path) -> None:
    # A chat's bound is on its prompt as the template renders it: every message's content, the
    # tools and the arguments of earlier calls (all shown by this model's template) and the
    # template's own text. Counting only the contents, megabytes of tool descriptions held the
    # tokenizer threads for seconds each before the same 400.
    router, calls = counting_router(tiny_model)
    bound = 4 * 1024 * router.tokenizer.max_token_bytes
    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "description": "d" * bound}}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": json.dumps({"text": "t" * bound})},
    }
    earlier = {"role": "assistant", "content": None, "tool_calls": [call]}
    async with TestClient(TestServer(router.app())) as client:
        for body, shown in [
            ({"messages": [{"role": "user", "content": "é" * (bound // 2 + 1)}]}, "messages"),
            ({"messages": [user], "tools": [tool]}, "messages and tools"),
            ({"messages": [user, earlier, {"role": "user", "content": "go on"}]}, "messages"),
        ]:
            r = await client.post("/v1/chat/completions", json=body)
            error = (await r.json())["error"]
            assert r.status == 400 and error["code"] == "context_length_exceeded", error
            assert error["param"] == "messages"
            rendered = router._chat_text(api.parse_chat(body, tool_parser="hermes"))
            size = len(rendered.encode())
            assert size > bound
            assert (
                f"your {shown}, rendered with the chat template, are {size} bytes"
                in (error["message"])
            )
        assert calls == []
        # Tools the template is not given (tool_choice none) do not count: this prompt is
        # tokenized, and refused by its token count.
        content = "a " * (bound // 4)
        body = {
            "messages": [{"role": "user", "content": content}],
            "tools": [tool],
            "tool_choice": "none",
        }
        r = await client.post("/v1/chat/completions", json=body)
        error = (await r.json())["error"]
        assert r.status == 400 and error["code"] == "context_length_exceeded"
        assert "tokens, leaving no room" in error["message"]
        assert len(calls) == 1 and len(content) < calls[0] < bound


async def test_drain_deadline_cuts_a_request_still_being_tokenized(tiny_model: Path) -> None:
    # Tokenizing runs on a thread, before the request is generating; the drain deadline must
    # answer it too (503 draining), not leave it to be dropped when the server closes. The
    # tokenizer here waits for the test to let it finish, so the deadline surely lands while
    # it is busy.
    router = router_on_nothing(tiny_model)
    release = threading.Event()
    encode = router.tokenizer.encode

    def held_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        release.wait(30)
        return encode(text, add_special_tokens)  # type: ignore[no-any-return]

    router.tokenizer.encode = held_encode
    async with TestClient(TestServer(router.app())) as c:
        answer = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi"}))
        while not router.tokenizing:
            await asyncio.sleep(0.01)
        router.cut_in_flight()
        r = await answer
        release.set()
        assert r.status == 503
        error = (await r.json())["error"]
        assert error["code"] == "draining" and "before generation started" in error["message"]
        assert not router.tokenizing and router.in_flight == 0


async def test_a_content_coding_the_router_cannot_decode_is_a_415(client: TestClient) -> None:
    # aiohttp passes a coding it does not know through as-is: without this check the
    # compressed bytes were parsed as JSON (or, worse, happened to parse).
    headers = {"content-type": "application/json", "content-encoding": "foo"}
    r = await client.post("/v1/completions", data=b'{"prompt": "hi"}', headers=headers)
    assert r.status == 415, await r.text()
    error = (await r.json())["error"]
    assert error["code"] == "unsupported_content_encoding" and "'foo'" in error["message"]
    assert "gzip" in r.headers["Accept-Encoding"]
    headers["content-encoding"] = "identity"
    r = await client.post("/v1/completions", data=b'{"prompt": "hi", "n": 0}', headers=headers)
    assert r.status == 400 and (await r.json())["error"]["param"] == "n"  # read, then judged


@pytest.mark.skipif(HAS_BROTLI, reason="the Brotli module is installed: br is decoded")
async def test_br_without_its_module_is_a_415_not_advice_to_install_it(tiny_model: Path) -> None:
    # aiohttp refuses it while parsing the headers, before any route runs, with "Please install
    # `Brotli`": advice for the server's operator, not for the client.
    async with router_runner(tiny_model) as port:
        body = b'{"prompt": "hi"}'
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: br\r\nContent-Length: %d\r\n\r\n" % len(body)
        ) + body
        status, headers, answer = await raw_exchange(port, request)
        assert status == 415, answer
        error = json.loads(answer)["error"]
        assert error["code"] == "unsupported_content_encoding", error
        assert "install" not in error["message"].lower() and "gzip" in headers["accept-encoding"]


def test_stop_takes_a_harness_worth_of_strings() -> None:
    # lm-eval-harness's local-completions sends a task's whole `until` list plus the EOS string
    # (humaneval: 8 + 1); vLLM takes any number. The workers' bound is 16.
    until = ["\nclass", "\n#", "\nif", "\nprint", "\n```", "\n```\n\n", "<|eot_id|>", "</s>"]
    req = api.parse_completion({"prompt": "x", "stop": [*until, "<|end_of_text|>"]})
    assert len(req.stop) == 9
    assert len(api.parse_completion({"prompt": "x", "stop": [str(i) for i in range(16)]}).stop)
    with pytest.raises(api.APIError) as err:
        api.parse_completion({"prompt": "x", "stop": [str(i) for i in range(17)]})
    assert err.value.param == "stop" and "at most 16" in err.value.message


def test_newer_openai_fields_are_accepted_and_type_checked() -> None:
    # What the openai client sends when asked (safety_identifier and prompt_cache_key replace
    # `user`; include_obfuscation pads stream chunks): none changes what is generated.
    messages = [{"role": "user", "content": "x"}]
    body = {"safety_identifier": "u-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h"}
    assert api.parse_chat({"messages": messages, **body}).kind == "chat"
    options = {"include_usage": True, "include_obfuscation": False}
    req = api.parse_chat({"messages": messages, "stream": True, "stream_options": options})
    assert req.include_usage
    for bad, param in [
        ({"safety_identifier": 7}, "safety_identifier"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": "no"}},
            "stream_options.include_obfuscation",
        ),
    ]:
        with pytest.raises(api.APIError) as err:
            api.parse_chat({"messages": messages, **bad})
        assert err.value.status == 400 and err.value.param == param


class _ScriptedFlow:
    """A flow that yields the given chunks (what the workers would have sent), then raises
    `error` if one is given (a worker failing mid-stream)."""

    def __init__(self, chunks: list, error: Exception | None = None) -> None:
        from splitserve_workers.router.flow import FlowStats

        self.chunks = chunks
        self.error = error
        self.stats = FlowStats()

    def tokens(self) -> AsyncIterator:
        async def gen() -> AsyncIterator:
            for chunk in self.chunks:
                yield chunk
            if self.error is not None:
                raise self.error

        return gen()


def _streaming(version: bytes, body: dict) -> bytes:
    data = json.dumps({**body, "stream": True}).encode()
    return (
        b"POST /v1/completions HTTP/%s\r\nHost: x\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (version, len(data))
    ) + data


@pytest.mark.parametrize("fails", [False, True], ids=["whole", "worker fails mid-stream"])
async def test_a_stream_to_an_http10_client_ends_with_its_connection(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    # HTTP/1.0 has no chunked framing: a stream's end is its connection's. With `Connection:
    # keep-alive` aiohttp kept the connection open after [DONE], and the client waited for
    # more (an answer to its next request would have been read as more of this one's body).
    from splitserve_workers.router import app
    from splitserve_workers.router.flow import FlowError, TokenChunk

    chunks = [TokenChunk([300]), TokenChunk([301], finished=not fails, finish_reason="length")]
    error = FlowError(502, "decode worker failed mid-stream") if fails else None
    monkeypatch.setattr(app, "Flow", lambda *_a, **_k: _ScriptedFlow(chunks, error))
    async with router_runner(tiny_model) as port:
        request = _streaming(b"1.0", {"prompt": "hi", "max_tokens": 2})
        status, headers, body = await raw_exchange(port, request, timeout=10)
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert "content-length" not in headers and "transfer-encoding" not in headers
        assert body.endswith(b"data: [DONE]\n\n"), body
        events = [json.loads(e[6:]) for e in body.split(b"\n\n")[:-2]]
        if fails:
            assert events[-1]["error"]["message"] == "decode worker failed mid-stream"
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        # HTTP/1.1 keeps its connection: the stream is chunked, and the next request on the
        # same connection is answered.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_streaming(b"1.1", {"prompt": "hi", "max_tokens": 2}))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"Transfer-Encoding: chunked" in head
        stream = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)
        assert b"data: [DONE]" in stream
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"tiny"' in answer


async def test_a_stop_string_the_final_flush_completes_finishes_with_stop(
    tiny_model: Path,
) -> None:
    # A continuation byte never completes a character: its text (U+FFFD) appears only when the
    # generation ends. A stop string matched there cuts the text, and the reason is "stop", not
    # the "length" the worker ended with (its own stop check renders such bytes differently).
    from splitserve_workers.router.app import _Run
    from splitserve_workers.router.flow import TokenChunk

    router = router_on_nothing(tiny_model)
    tok = router.tokenizer
    byte = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\xbf")
    prompt = tok.encode("hi", add_special_tokens=True)
    req = api.parse_completion({"prompt": "hi", "max_tokens": 2, "stop": "\ufffd"})
    flow = _ScriptedFlow(
        [TokenChunk([byte]), TokenChunk([byte], finished=True, finish_reason="length")]
    )
    run = _Run(router, req, flow, 0, prompt, "hi", 0.0)  # type: ignore[arg-type]
    out = [(text, reason) async for text, reason, _ in run.chunks()]
    assert "".join(t for t, _ in out) == "" and out[-1][1] == "stop", out
    # Without the stop string the same tokens end with the worker's reason.
    req = api.parse_completion({"prompt": "hi", "max_tokens": 2})
    flow = _ScriptedFlow(
        [TokenChunk([byte]), TokenChunk([byte], finished=True, finish_reason="length")]
    )
    run = _Run(router, req, flow, 0, prompt, "hi", 0.0)  # type: ignore[arg-type]
    out = [(text, reason) async for text, reason, _ in run.chunks()]
    assert "\ufffd" in "".join(t for t, _ in out) and out[-1][1] == "length", out


def test_vllms_default_integer_priority_is_no_preference() -> None:
    assert api.parse_completion({"prompt": "x", "priority": 0}).priority == "interactive"
    assert api.parse_completion({"prompt": "x", "priority": 0}, "background").priority == (
        "background"
    )
    for value in (1, -1, False, "urgent"):
        with pytest.raises(api.APIError) as err:
            api.parse_completion({"prompt": "x", "priority": value})
        assert err.value.status == 400 and err.value.param == "priority"


def test_a_top_p_below_float32s_range_stays_the_strictest_cut() -> None:
    # The proto's float32 turned top_p 1e-50 into 0, which the workers read as unset (1.0).
    from splitserve_workers.proto import serving_pb2 as pb

    req = api.parse_completion({"prompt": "x", "top_p": 1e-50})
    assert 0 < pb.SamplingParams(top_p=req.top_p).top_p <= 1e-29
    assert api.parse_completion({"prompt": "x", "top_p": 0.3}).top_p == 0.3


async def test_an_empty_prompt_needs_a_bos_token(tmp_path: Path) -> None:
    # OpenAI and vLLM take "" as the BOS token alone (tested on a real stack in
    # test_openai_client.py); Qwen's tokenizer adds none, which leaves nothing to start from.
    from splitserve_workers.engine.make_model import write_model

    model = write_model("tiny-qwen2", tmp_path / "tiny-qwen2")
    async with TestClient(TestServer(router_on_nothing(model).app())) as c:
        r = await c.post("/v1/completions", json={"prompt": ["hi", ""]})
        assert r.status == 400
        error = (await r.json())["error"]
        assert error["param"] == "prompt[1]" and "BOS" in error["message"]
