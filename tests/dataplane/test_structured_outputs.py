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
from test_openai_client import _error, _post, assert_blocks_back, decode_load, wait_ready

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def stack(tiny_model: Path, launch_module_worker: Any, worker_flags: Any) -> dict[str, Any]:
    prefill = launch_module_worker("prefill", worker_flags(tiny_model))
    decode = launch_module_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "512"))
    colocated = launch_module_worker("colocated", worker_flags(tiny_model))
    routers = {}
    for name, pools in {
        "disaggregated": ["--prefill", prefill.endpoint, "--decode", decode.endpoint],
        "colocated": ["--colocated", colocated.endpoint],
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
        wait_ready(routers[name])
    return {"base": routers["disaggregated"], "colocated": routers["colocated"], "decode": decode}


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
