"""A thinking model's reasoning split from its answer (reasoning.py): `reasoning_content`,
whole and streamed, alone and before tool calls. A random-weight model writes no `</think>`:
the format's cases are tested on text through the router's own assembly (`_Answer`), and on
real processes a router told the answer starts inside the reasoning (`deepseek_r1`, whose
template opens `<think>` in the prompt) returns the model's whole text as reasoning."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from splitserve_workers.router import openai_api as api
from splitserve_workers.router import reasoning
from splitserve_workers.router.app import _Answer
from test_openai_client import wait_ready
from test_tool_parsers import CALL_1

pytestmark = pytest.mark.slow

TEXTS = [
    "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.",
    "It is 4.",  # qwen3 with enable_thinking false: no reasoning
    "Hmm, 2+2.</think>\n\nFour.",  # deepseek_r1: the prompt opened the block
    "<think>\nstill thinking when max_tokens hit",
    "<thi",
    "",
]


@pytest.mark.parametrize("begin", [None, "reasoning", "content"])
@pytest.mark.parametrize("parser", reasoning.PARSERS)
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_and_whole_answers_split_alike(parser: str, text: str, begin: str | None) -> None:
    whole = reasoning.split(text, parser, begin)
    for size in (1, 2, 5, 1000):
        splitter = reasoning.Splitter(parser, begin)
        thought = content = ""
        for i in range(0, len(text), size):
            t, c = splitter.feed(text[i : i + size])
            thought, content = thought + t, content + c
        t, c = splitter.finish()
        assert (thought + t or None, content + c) == whole


def test_what_each_format_makes_of_an_answer() -> None:
    assert reasoning.split(TEXTS[0], "qwen3") == ("\nThe user wants 2+2.\n", "It is 4.")
    assert reasoning.split(TEXTS[1], "qwen3") == (None, "It is 4.")
    assert reasoning.split(TEXTS[2], "qwen3") == (None, TEXTS[2])  # no <think>: all content
    assert reasoning.split(TEXTS[2], "deepseek_r1") == ("Hmm, 2+2.", "Four.")
    assert reasoning.split(TEXTS[3], "deepseek_r1") == ("\nstill thinking when max_tokens hit", "")
    assert reasoning.split("Four.", "deepseek_r1") == ("Four.", "")


def test_the_prompt_says_where_the_answer_starts() -> None:
    # QwQ's and Qwen3-Thinking's templates open <think> themselves: only </think> comes.
    qwq = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert reasoning.start(qwq) == "reasoning"
    assert reasoning.split(TEXTS[2], "qwen3", reasoning.start(qwq)) == ("Hmm, 2+2.", "Four.")
    # Qwen3 with enable_thinking false: the block is closed in the prompt, all is content.
    closed = qwq + "\n</think>\n\n"
    assert reasoning.start(closed) == "content"
    assert reasoning.split("Four.", "deepseek_r1", "content") == (None, "Four.")
    assert reasoning.start(qwq[: -len("<think>\n")]) is None  # the answer tells
    # continue_final_message: the prefilled text tells where the model goes on.
    assert reasoning.start("...<think>\nLet me", "<think>\nLet me") == "reasoning"
    assert reasoning.start("...</think>\n\nIt is", "<think>x</think>\n\nIt is") == "content"
    assert reasoning.start("<｜Assistant｜>It is", "It is") == "content"  # noqa: RUF001


def test_detect_follows_the_chat_template() -> None:
    qwen3 = "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
    assert reasoning.detect(qwen3) == "qwen3"
    r1 = qwen3 + "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"  # noqa: RUF001
    assert reasoning.detect(r1) == "deepseek_r1"
    assert reasoning.detect("{{ messages }}") is None


def answer(parser: str, tool_choice: str | None = None) -> _Answer:
    router = SimpleNamespace(options=SimpleNamespace(model_name="m"), reasoning_parser=parser)
    req = api.GenerationRequest(kind="chat", model="m", tool_choice=tool_choice)
    if tool_choice == "auto":
        req.tool_parser = "hermes"
        req.tools = [{"type": "function", "function": {"name": "get_weather"}}]
    return _Answer(router, req, "chatcmpl-x", [])  # type: ignore[arg-type]


def deltas(a: _Answer, text: str, size: int) -> list[dict[str, Any]]:
    run: Any = SimpleNamespace(index=0, first=True)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = []
    for i, piece in enumerate(pieces):
        chunk = a._chunk(run, piece, "stop" if i == len(pieces) - 1 else None, None)
        if chunk is not None:
            out.append(chunk["choices"][0])
    return out


@pytest.mark.parametrize("size", [1, 3, 1000])
async def test_streamed_reasoning_comes_before_the_content(size: int) -> None:
    chunks = deltas(answer("qwen3"), TEXTS[0], size)
    assert chunks[0]["delta"]["role"] == "assistant"
    thought = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert (thought, content) == ("\nThe user wants 2+2.\n", "It is 4.")
    # Reasoning goes first. (Text held back, a tag being decided, goes out as empty deltas:
    # one chunk per token, as always.)
    kinds = [
        "r" if "reasoning_content" in c["delta"] else "c"
        for c in chunks
        if c["delta"].get("reasoning_content") or c["delta"].get("content")
    ]
    assert "".join(kinds) == "".join(sorted(kinds, key="rc".index))
    assert chunks[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("size", [1, 1000])
async def test_tool_calls_after_the_reasoning(size: int) -> None:
    text = "<think>\nI should look it up.\n</think>\n\n" + CALL_1
    chunks = deltas(answer("qwen3", "auto"), text, size)
    thought = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    assert thought == "\nI should look it up.\n"
    assert not "".join(c["delta"].get("content") or "" for c in chunks).strip()
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert chunks[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.fixture(scope="module")
def routers(tiny_model: Path, launch_module_worker: Any, worker_flags: Any) -> dict[str, str]:
    colocated = launch_module_worker("colocated", worker_flags(tiny_model))
    out = {}
    for parser in ("deepseek_r1", "auto"):  # make-model's template shows no reasoning format
        router = launch_module_worker(
            "router",
            ["--model", str(tiny_model), "--model-name", "tiny", "--port", "0",
             "--colocated", colocated.endpoint, "--reasoning-parser", parser],
            name=f"router-{parser}",
        )  # fmt: skip
        out[parser] = f"http://127.0.0.1:{router.port}"
        wait_ready(out[parser])
    return out


def test_reasoning_content_through_real_processes(routers: dict[str, str]) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=[{"role": "user", "content": "2+2?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    body = {**kw.pop("extra_body"), **kw}
    plain = httpx.post(routers["auto"] + "/v1/chat/completions", json=body, timeout=60).json()
    kw["extra_body"] = {"ignore_eos": True}
    text = plain["choices"][0]["message"]["content"]
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert text and "</think>" not in text
    # deepseek_r1: no </think> came, so the whole answer is (unfinished) reasoning.
    r1 = openai.OpenAI(base_url=routers["deepseek_r1"] + "/v1", api_key="x", max_retries=0)
    whole = r1.chat.completions.create(**kw).choices[0].message
    extra = whole.model_extra or {}
    # Nothing after the reasoning: content is null; the reasoning in both fields clients read.
    assert (whole.content, extra["reasoning_content"], extra["reasoning"]) == (None, text, text)
    deltas = [
        chunk.choices[0].delta.model_extra or {}
        for chunk in r1.chat.completions.create(stream=True, **kw)
        if chunk.choices
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_reasoning_sent_back_reaches_the_template() -> None:
    # An assistant turn's reasoning, in either field the answer gave it in, goes to the
    # template as reasoning_content (Qwen3's shows it for the turns after the last user one).
    for field in ("reasoning_content", "reasoning"):
        body = {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y", field: "because"},
            ]
        }
        req = api.parse_chat(body)
        assert req.messages is not None and req.messages[1]["reasoning_content"] == "because"
    bad = {"messages": [{"role": "assistant", "content": "y", "reasoning_content": 5}]}
    with pytest.raises(api.APIError) as e:
        api.parse_chat(bad)
    assert e.value.param == "messages[0].reasoning_content"
