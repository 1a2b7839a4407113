"""The router through the official `openai` client, unmodified, against real processes: one
prefill worker, one decode worker and the router, talking real gRPC and HTTP. Greedy text must
equal what one in-process engine generates for the same prompt; the error corpus must come back
as OpenAI-style 4xx bodies naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256  # the router and workers both run with this context limit
MAX_REQUEST_BYTES = 64 << 10


@pytest.fixture(scope="module")
def stack(tiny_model: Path, launch_module_worker: Any, worker_flags: Any) -> dict[str, Any]:
    limit = ["--max-model-len", str(MAX_MODEL_LEN)]
    prefill = launch_module_worker("prefill", worker_flags(tiny_model, *limit))
    decode = launch_module_worker(
        "decode", worker_flags(tiny_model, *limit, "--num-kv-blocks", "1024")
    )
    router = launch_module_worker(
        "router",
        [
            "--model",
            str(tiny_model),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--prefill",
            prefill.endpoint,
            "--decode",
            decode.endpoint,
            *limit,
            "--max-request-bytes",
            str(MAX_REQUEST_BYTES),
            "--model-name",
            "tiny",
            "--log-requests",
        ],
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    return {"base": base, "prefill": prefill, "decode": decode, "router": router}


def wait_ready(base: str) -> None:
    """Until the router has polled a healthy worker in each pool (bounds a hang; not timed)."""
    for _ in range(600):
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("router never became ready")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    import torch
    from splitserve_workers.engine import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN
        )
    )


def reference(engine: Any, prompt_ids: list[int], max_tokens: int) -> str:
    """Greedy text of one in-process engine, cut at EOS like the router does."""
    from splitserve_workers.engine import SamplingParams

    out = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    eos = set(engine.tokenizer.eos_token_ids)
    ids = []
    for t in out:
        if t in eos:
            break
        ids.append(t)
    return engine.tokenizer.decode(ids)


def chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )


def client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack["base"] + "/v1", api_key="unused", max_retries=0, timeout=120
    )


PROMPTS = [
    "The quick brown fox",
    "Disaggregated serving splits prefill from decode because",
    "1 2 3 4 5 6",
    "KV caches move layer by layer",
]


def test_models_lists_the_served_model(stack: dict[str, Any]) -> None:
    models = client(stack).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_streaming_completion_matches_engine(stack: dict[str, Any], engine: Any) -> None:
    prompt = PROMPTS[0]
    expected = reference(engine, engine.tokenizer.encode(prompt), 24)
    stream = client(stack).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(text) == expected
    assert finish in ("length", "stop")
    assert usage is not None
    assert usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert 1 <= usage.completion_tokens <= 24


def test_penalties_and_bias_match_the_engine(stack: dict[str, Any], engine: Any) -> None:
    # The prefill worker samples the first token, the decode worker the rest: both must
    # apply the bias and the penalties (and decode count the first token) as one engine does.
    from splitserve_workers.engine import SamplingParams

    def generate(prompt: list[int], n: int, **kw: Any) -> list[int]:
        return engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, **kw))[0]

    base = engine.tokenizer.encode(PROMPTS[1])
    prompt = base + generate(base, 6)  # holds the tokens the model favours next
    plain = generate(prompt, 16)
    want = generate(
        prompt, 16, frequency_penalty=1.1, presence_penalty=0.4, repetition_penalty=1.3,
        logit_bias={plain[0]: -5.0, plain[3]: 2.0},
    )  # fmt: skip
    assert want != plain
    for stream in (False, True):
        answer = client(stack).completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=stream,
            frequency_penalty=1.1, presence_penalty=0.4,
            logit_bias={str(plain[0]): -5, str(plain[3]): 2},
            extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
        )  # fmt: skip
        chunks = list(answer) if stream else [answer]
        text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
        assert text == engine.tokenizer.decode(want), stream


def _sse_events(stack: dict[str, Any], path: str, body: dict[str, Any]) -> list[Any]:
    """The parsed `data:` events of one streamed request, `[DONE]` as the string."""
    events: list[Any] = []
    with httpx.stream("POST", stack["base"] + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage_is_null_until_the_usage_chunk(stack: dict[str, Any], path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    events = _sse_events(stack, path, {**body, "stream_options": {"include_usage": True}})
    *chunks, last, done = events
    assert done == "[DONE]"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    # OpenAI: every other chunk has the key, with null.
    assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
    # Without stream_options the key is absent.
    plain = _sse_events(stack, path, body)
    assert all("usage" not in c for c in plain[:-1])
    # continuous_usage_stats: running totals on every chunk, ending at the usage chunk's.
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last, _ = _sse_events(stack, path, {**body, "stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1
    assert counts[-1] == last["usage"]["completion_tokens"] == 6
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)


def test_streaming_chat_matches_engine(stack: dict[str, Any], engine: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": PROMPTS[1]},
    ]
    expected = reference(engine, chat_ids(engine, messages), 20)
    stream = client(stack).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
    )
    roles, text, finish = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(text) == expected
    assert finish in ("length", "stop")


def test_continue_final_message_goes_on_from_the_prefilled_answer(
    stack: dict[str, Any], engine: Any
) -> None:
    # vLLM's chat-template controls: the prompt ends inside the assistant's turn, so the
    # model continues "The answer is" (a prefilled answer), as one engine does from that text.
    messages = [
        {"role": "user", "content": PROMPTS[2]},
        {"role": "assistant", "content": "The answer is"},
    ]
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("The answer is")
    ids = tok.encode(text, add_special_tokens=False)
    answer = client(stack).chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == reference(engine, ids, 12)
    # add_generation_prompt false: no assistant header after the user's turn.
    plain = [messages[0]]
    bare = tok.apply_chat_template(plain, add_generation_prompt=False)
    r = _post(
        stack,
        "/v1/chat/completions",
        json.dumps({"messages": plain, "max_tokens": 1, "add_generation_prompt": False}),
    )
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(bare, add_special_tokens=False))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        (
            {"continue_final_message": True, "messages": [{"role": "user", "content": "x"}]},
            "continue_final_message",
        ),  # noqa: E501
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ],
)
def test_bad_template_controls_are_400s(
    stack: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "assistant", "content": "So"}], "max_tokens": 1, **extra}
    r = _post(stack, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 400, r.text
    assert _error(r)["param"] == param


def test_non_streaming_chat_and_completion(stack: dict[str, Any], engine: Any) -> None:
    c = client(stack)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == reference(engine, chat_ids(engine, messages), 12)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids(engine, messages))
    comp = c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=0)
    assert comp.choices[0].text == reference(engine, engine.tokenizer.encode(PROMPTS[3]), 12)
    # Token-id prompts work too and give the same answer.
    ids = engine.tokenizer.encode(PROMPTS[3])
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == comp.choices[0].text


def test_stop_string_is_trimmed(stack: dict[str, Any], engine: Any) -> None:
    prompt = PROMPTS[0]
    full = reference(engine, engine.tokenizer.encode(prompt), 24)
    # Stop at a piece of the greedy text we know comes: everything before it comes back.
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        stop = full.strip()[-2:]
    cut = full.index(stop)
    comp = client(stack).completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
    )
    assert comp.choices[0].text == full[:cut]
    assert comp.choices[0].finish_reason == "stop"


def decode_load(stack: dict[str, Any]) -> pb.LoadReport:
    with grpc.insecure_channel(stack["decode"].endpoint) as channel:
        return pb_grpc.DecodeServiceStub(channel).Load(pb.LoadRequest(), timeout=60)


def assert_blocks_back(stack: dict[str, Any], initial: int) -> None:
    """The decode worker's free blocks return to `initial` (the aborts land asynchronously;
    the wait bounds a hang, it is not timed) and nothing runs."""
    deadline = time.monotonic() + 60
    while decode_load(stack).free_blocks != initial and time.monotonic() < deadline:
        time.sleep(0.1)
    report = decode_load(stack)
    assert report.free_blocks == initial
    assert report.running == 0


def test_early_finishes_free_the_decode_blocks(stack: dict[str, Any], engine: Any) -> None:
    """max_tokens=1 ends at the prefill worker's token; a stop string ends mid-decode. Both
    leave a reservation or a running sequence on the decode worker that the router aborts."""
    initial = decode_load(stack).free_blocks
    c = client(stack)
    one = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=1, temperature=0)
    assert one.choices[0].finish_reason == "length"
    assert one.usage is not None and one.usage.completion_tokens == 1
    chunks = list(
        c.completions.create(
            model="tiny", prompt=PROMPTS[2], max_tokens=1, temperature=0, stream=True
        )
    )
    assert [ch.choices[0].finish_reason for ch in chunks] == ["length"]
    full = reference(engine, engine.tokenizer.encode(PROMPTS[0]), 24)
    stop = full[len(full) // 3 : len(full) // 3 + 1]
    stopped = c.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=200,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert_blocks_back(stack, initial)


def test_seeded_sampling_is_reproducible(stack: dict[str, Any]) -> None:
    c = client(stack)
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 16,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
    }
    a = c.completions.create(**kwargs).choices[0].text
    b = c.completions.create(**kwargs).choices[0].text
    assert a == b


async def test_64_concurrent_streaming_clients(stack: dict[str, Any], engine: Any) -> None:
    expected = {p: reference(engine, engine.tokenizer.encode(p), 16) for p in PROMPTS}
    aclient = openai.AsyncOpenAI(
        base_url=stack["base"] + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)),
    )

    async def one(i: int) -> tuple[str, str, str | None]:
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.text)
                finish = choice.finish_reason or finish
        return prompt, "".join(parts), finish

    results = await asyncio.gather(*(one(i) for i in range(64)))
    await aclient.close()
    assert len(results) == 64
    for prompt, text, finish in results:
        assert finish in ("length", "stop")
        assert text == expected[prompt], prompt


def test_priority_passes_through(stack: dict[str, Any]) -> None:
    c = client(stack)
    r = c.completions.create(
        model="tiny", prompt="x y z", max_tokens=4, extra_body={"priority": "background"}
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(
        stack["base"] + "/v1/completions",
        json={"prompt": "x y z", "max_tokens": 4},
        headers={"x-splitserve-priority": "background"},
        timeout=120,
    )
    assert r.status_code == 200


# ---- the error corpus ---------------------------------------------------------------------


def _post(
    stack: dict[str, Any], path: str, content: bytes | str, headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        stack["base"] + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json", **(headers or {})},
    )


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": 42}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 65}, 400, "n"),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 22}, 400, "n"),
        ("/v1/completions", {"prompt": ["a", [1, "x"]]}, 400, "prompt[1]"),
        ("/v1/completions", {"prompt": [[1, 2], [-1]]}, 400, "prompt[1]"),
        ("/v1/completions", {"prompt": ["a"] * 65}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[1], [999999]]}, 400, "prompt[1]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 65},
            400,
            "n",
        ),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"a": 5}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (
            "/v1/completions",
            {"prompt": "hi", "repetition_penalty": 1e-9},
            400,
            "repetition_penalty",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "whatever": 1}, 400, "whatever"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            400,
            "stream",
        ),
    ],
)
def test_error_corpus(
    stack: dict[str, Any], path: str, body: Any, status: int, param: str | None
) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    r = _post(stack, path, raw)
    assert r.status_code == status, r.text
    err = _error(r)
    assert err["param"] == param
    if param:
        assert param.split("[")[0] in err["message"]


def test_an_empty_prompt_is_the_bos_token_alone(stack: dict[str, Any], engine: Any) -> None:
    bos = engine.tokenizer.encode("")
    assert len(bos) == 1  # tiny-llama's tokenizer adds a BOS token
    answer = client(stack).completions.create(model="tiny", prompt="", max_tokens=4, temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens == 1
    assert answer.choices[0].text == reference(engine, bos, 4)


def test_too_long_prompt_names_the_limit(stack: dict[str, Any]) -> None:
    r = _post(stack, "/v1/completions", json.dumps({"prompt": "word " * 400}))
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in err["message"] and err["param"] == "prompt"
    r = _post(stack, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10_000}))
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
    # The error names the field the client used.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000}
    r = _post(stack, "/v1/chat/completions", json.dumps(chat))
    err = _error(r)
    assert r.status_code == 400 and err["param"] == "max_completion_tokens"
    assert "max_completion_tokens" in err["message"]


def test_oversized_body_is_413(stack: dict[str, Any]) -> None:
    big = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 10)})
    r = _post(stack, "/v1/completions", big)
    assert r.status_code == 413
    assert _error(r)["code"] == "request_too_large"


def test_openai_client_raises_bad_request(stack: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(info.value)


def test_edge_metrics_have_ttft_and_stage_split(stack: dict[str, Any]) -> None:
    client(stack).completions.create(model="tiny", prompt="metrics please", max_tokens=4)
    assert _post(stack, "/v1/completions", "{").status_code == 400
    text = httpx.get(stack["base"] + "/metrics", timeout=30).text
    from prometheus_client.parser import text_string_to_metric_families

    values = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }

    def total(name: str, **labels: str) -> float:
        return sum(
            v
            for k, v in values.items()
            if k.startswith(name + "{") and all(f'"{a}": "{b}"' in k for a, b in labels.items())
        )

    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "prefill_queue_seconds",
        "prefill_compute_seconds",
        "kv_transfer_seconds",
        "decode_admission_seconds",
    ):
        assert total(f"splitserve_{name}_count") >= 1, name
    assert total("splitserve_kv_transfer_bytes_total") > 0
    assert total("splitserve_requests_total", status="ok") >= 1
    assert total("splitserve_requests_total", status="rejected") >= 1
    assert total("splitserve_prompt_tokens_total") > 0
    assert total("splitserve_generation_tokens_total") > 0


def engine_logprobs(engine: Any, prompt_ids: list[int], max_tokens: int, top: int) -> list[Any]:
    """One in-process engine's outputs (token, logprob, top pairs) for a greedy request."""
    from splitserve_workers.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=top)
    engine.add_request("lp", prompt_ids, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.token_id is not None]
    return outs


def test_chat_logprobs_match_the_engine_streamed_or_not(stack: dict[str, Any], engine: Any) -> None:
    # The first token's logprobs come from the prefill worker, the rest from the decode
    # worker; both must equal one engine's, and the stream must carry the same entries.
    messages = [{"role": "user", "content": PROMPTS[2]}]
    expected = engine_logprobs(engine, chat_ids(engine, messages), 8, 3)
    tok = engine.tokenizer
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    resp = client(stack).chat.completions.create(**args)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == len(expected) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for got, want in zip(content, expected, strict=True):
        text, raw = tok.token_text(want.token_id)
        assert (got.token, bytes(got.bytes or [])) == (text, raw)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [v for _, v in want.top_logprobs], abs=1e-4
        )
        assert [t.token for t in got.top_logprobs] == [
            tok.token_text(t)[0] for t, _ in want.top_logprobs
        ]
        assert got.top_logprobs[0].token == got.token  # greedy: the sampled one is the top one
    streamed = []
    for chunk in client(stack).chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_follow_the_legacy_shape(stack: dict[str, Any], engine: Any) -> None:
    prompt = PROMPTS[0]
    expected = engine_logprobs(engine, engine.tokenizer.encode(prompt), 6, 2)
    resp = client(stack).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.token_logprobs == pytest.approx([o.logprob for o in expected], abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # N, plus the sampled one
    assert all(
        top[token] == value
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    # text_offset: where each token starts in the completion's text (U+FFFD for invalid
    # bytes included; a special token adds nothing to the text).
    text = resp.choices[0].text
    assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)
    for o, token, offset in zip(expected, lp.tokens, lp.text_offset, strict=True):
        if engine.tokenizer.shown_bytes(o.token_id) and not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token


def test_echo_with_logprobs_scores_the_prompt(stack: dict[str, Any], engine: Any) -> None:
    # What evaluation harnesses send for log-likelihoods: echo, logprobs, one new token. The
    # prompt's logprobs come from the prefill worker and must equal one engine's.
    from splitserve_workers.engine import SamplingParams

    prompt = PROMPTS[1]
    ids = engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=True, prompt_logprobs=1)
    engine.add_request("echo", ids, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.token_id is not None]
    (first,) = outs
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    resp = client(stack).completions.create(**args)
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    tok = engine.tokenizer
    assert lp.tokens == [tok.token_text(t)[0] for t in [*ids, first.token_id]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [v for v, _ in first.prompt_logprobs] + [first.logprob]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for (_, top), alternatives in zip(first.prompt_logprobs, lp.top_logprobs[1:], strict=False):
        assert top is not None and alternatives is not None
        assert alternatives[tok.token_text(top[0][0])[0]] == pytest.approx(top[0][1], abs=1e-4)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)
    # text_offset indexes the echoed text, which the prompt's BOS is not part of.
    assert lp.tokens[0] == tok.bos_token and lp.text_offset is not None
    assert lp.text_offset[:2] == [0, 0]
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        if not token.startswith("bytes:"):
            assert choice.text[offset : offset + len(token)] == token
    # Streamed: the same entries, the prompt's with the first chunk.
    streamed_tokens: list[str] = []
    streamed_values: list[float | None] = []
    for chunk in client(stack).completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.tokens:
                streamed_tokens += c.logprobs.tokens
                streamed_values += c.logprobs.token_logprobs or []
    assert streamed_tokens == lp.tokens
    assert streamed_values[0] is None
    assert streamed_values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    # A hand-formatted prompt spells special tokens out: they are in the echoed text (only the
    # BOS the tokenizer added is not), so the offsets after them count their characters.
    spelled = "<|im_start|>user hi<|im_end|> ok"
    assert tok.token_to_id("<|im_start|>") in tok.encode(spelled)
    resp = client(stack).completions.create(**{**args, "prompt": spelled})
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.text_offset is not None
    assert choice.text.startswith(spelled) and lp.tokens[0] == tok.bos_token
    assert lp.text_offset[:2] == [0, 0]
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        if not token.startswith("bytes:"):
            assert choice.text[offset : offset + len(token)] == token, (token, offset)


def test_the_router_process_never_loads_torch(stack: dict[str, Any]) -> None:
    # The router tokenizes and relays; it never runs the model. By now it has served chat,
    # completions, logprobs and errors. torch in a router costs every router pod about
    # 500 MiB of memory and seconds of start-up (the engine package used to import it eagerly).
    router = stack["router"]
    assert router.proc.poll() is None
    maps = Path(f"/proc/{router.proc.pid}/maps").read_text()
    loaded = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    assert not [path for path in loaded if "libtorch" in Path(path).name], "torch is loaded"
    assert any("tokenizers" in path for path in loaded)  # what the router does load


# ---- several choices: `n`, and a batch of prompts -------------------------------------------


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with these labels on the /metrics page at `url` (a
    router's, or a worker's metrics port)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _metric(stack: dict[str, Any], name: str, **labels: str) -> float:
    return metric(stack["base"] + "/metrics", name, **labels)


def test_n_choices_sample_with_consecutive_seeds(stack: dict[str, Any]) -> None:
    """Copy j of a seeded request samples as the same request with seed + j would (vLLM's
    rule), so an answer with n choices is reproducible and its choices differ."""
    c = client(stack)
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    ttft = _metric(stack, "splitserve_time_to_first_token_seconds_count")
    ok = _metric(stack, "splitserve_requests_total", status="ok")
    many = c.completions.create(n=3, seed=77, **kwargs)
    assert [choice.index for choice in many.choices] == [0, 1, 2]
    singles = [c.completions.create(seed=77 + j, **kwargs).choices[0].text for j in range(3)]
    assert [choice.text for choice in many.choices] == singles
    assert len(set(singles)) == 3  # 12 tokens sampled at temperature 1 from 3 seeds
    assert all(choice.finish_reason == "length" for choice in many.choices)
    # The prompt counts once; every choice's tokens count.
    assert many.usage is not None
    assert many.usage.prompt_tokens == c.completions.create(**kwargs).usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * 12
    # One request, three generations (each with its own TTFT), then the 4 single requests.
    assert _metric(stack, "splitserve_requests_total", status="ok") == ok + 4 + 1
    assert _metric(stack, "splitserve_time_to_first_token_seconds_count") == ttft + 3 + 4


def test_n_streamed_chat_choices_each_start_and_finish(stack: dict[str, Any], engine: Any) -> None:
    messages = [{"role": "user", "content": "Say something long."}]
    expected = reference(engine, chat_ids(engine, messages), 10)
    stream = client(stack).chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    text: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, list[str | None]] = {0: [], 1: []}
    finish: dict[int, list[str]] = {0: [], 1: []}
    usages = []
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            roles[choice.index].append(choice.delta.role)
            if choice.finish_reason:
                finish[choice.index].append(choice.finish_reason)
    assert len(ids) == 1
    assert text == {0: expected, 1: expected}  # greedy: two equal choices
    for index in (0, 1):
        # The role in each choice's first delta only, one finish reason, at its end.
        assert roles[index][0] == "assistant" and set(roles[index][1:]) <= {None}
        assert len(finish[index]) == 1
    single = client(stack).chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert single.usage is not None and len(usages) == 1
    assert usages[0].prompt_tokens == single.usage.prompt_tokens
    assert usages[0].completion_tokens == 2 * single.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_answers_each_in_order(
    stack: dict[str, Any], engine: Any, stream: bool
) -> None:
    """OpenAI's completions batch: prompt i's n choices have indexes i*n .. i*n+n-1. Prompts as
    text and as token ids."""
    ids = engine.tokenizer.encode(PROMPTS[3])
    prompts: list[Any] = [PROMPTS[0], PROMPTS[2], ids]
    expected = [reference(engine, engine.tokenizer.encode(p), 8) for p in prompts[:2]]
    expected.append(reference(engine, ids, 8))
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "n": 2, "stream": stream}
    if stream:
        events = _sse_events(stack, "/v1/completions", body)
        assert events[-1] == "[DONE]"
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        for event in events[:-1]:
            (choice,) = event["choices"]  # one choice per chunk
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
        assert sorted(reasons) == list(range(6))
        got = [texts.get(i, "") for i in range(6)]
    else:
        r = _post(stack, "/v1/completions", json.dumps(body))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert r.headers["x-request-id"] == answer["id"]
        assert [c["index"] for c in answer["choices"]] == list(range(6))
        got = [c["text"] for c in answer["choices"]]
        prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in prompts[:2]) + len(ids)
        assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert got == [text for text in expected for _ in range(2)]


def test_a_batch_refuses_the_prompt_that_is_too_long(stack: dict[str, Any]) -> None:
    r = _post(stack, "/v1/completions", json.dumps({"prompt": ["hi", [5] * MAX_MODEL_LEN], "n": 2}))
    error = _error(r)
    assert r.status_code == 400 and error["param"] == "prompt[1]"
    assert error["code"] == "context_length_exceeded"


def _generated_on_decode(stack: dict[str, Any]) -> float:
    url = f"http://127.0.0.1:{stack['decode'].metrics_port}/metrics"
    return metric(url, "splitserve_generation_tokens_processed_total")


def test_n_choices_hung_up_on_mid_stream_are_aborted(stack: dict[str, Any]) -> None:
    initial = decode_load(stack).free_blocks
    generated = _generated_on_decode(stack)
    max_tokens = MAX_MODEL_LEN - 32
    body = {"prompt": PROMPTS[1], "max_tokens": max_tokens, "n": 4, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", stack["base"] + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 4:
                break  # every choice is generating: hang up
    assert_blocks_back(stack, initial)
    # Aborted, not run to the end (each choice's first token comes from the prefill worker).
    assert _generated_on_decode(stack) - generated < 4 * (max_tokens - 1)


def _request_log(stack: dict[str, Any], rid: str) -> dict[str, Any]:
    """The router's JSON log line of request `rid` (--log-requests); the line is written when
    the handler ends, just after the answer's last byte: polled, not timed."""
    deadline = time.monotonic() + 30
    while True:
        for line in stack["router"].log().splitlines():
            _, sep, record = line.partition(" INFO splitserve.requests: ")
            if sep and json.loads(record)["id"] == rid:
                return json.loads(record)
        assert time.monotonic() < deadline, f"no request log line for {rid}"
        time.sleep(0.05)


def test_each_request_logs_one_json_line(stack: dict[str, Any]) -> None:
    c = client(stack)
    secret = "do not log this prompt"
    ok = c.completions.create(model="tiny", prompt=secret, max_tokens=5, n=2, temperature=0)
    record = _request_log(stack, ok.id)
    assert record["path"] == "/v1/completions" and record["status"] == "ok"
    assert record["choices"] == 2 and record["finish_reasons"] == ["length", "length"]
    assert ok.usage is not None
    assert record["prompt_tokens"] == ok.usage.prompt_tokens
    assert record["completion_tokens"] == ok.usage.completion_tokens == 10
    assert record["prefill"] == [stack["prefill"].endpoint]
    assert record["decode"] == [stack["decode"].endpoint]
    assert 0 < record["ttft_ms"] <= record["e2e_ms"]
    assert secret not in stack["router"].log()  # prompts and answers are never logged
    # A refused request is logged too, with its error.
    r = _post(stack, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 10**6}))
    assert r.status_code == 400
    refused = [
        json.loads(line.partition(" INFO splitserve.requests: ")[2])
        for line in stack["router"].log().splitlines()
        if " INFO splitserve.requests: " in line
    ]
    assert any(
        x["status"] == "rejected"
        and x["http_status"] == 400
        and x["error_code"] == "context_length_exceeded"
        and "maximum context length" in x["error"]
        for x in refused
    )


def test_a_prompts_tokens_count_once_in_the_metrics(stack: dict[str, Any]) -> None:
    """splitserve_prompt_tokens_total counts a prompt once however many choices it has, as
    usage does (it counted every copy's, and copies never started for a refused request)."""
    c = client(stack)
    before = _metric(stack, "splitserve_prompt_tokens_total")
    many = c.completions.create(
        model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], n=4, max_tokens=2, temperature=1.0
    )
    assert many.usage is not None and len(many.choices) == 8
    assert _metric(stack, "splitserve_prompt_tokens_total") == before + many.usage.prompt_tokens


def test_n_choices_continuous_usage_counts_what_was_streamed(stack: dict[str, Any]) -> None:
    """continuous_usage_stats with several choices: each chunk's completion_tokens is the
    tokens streamed so far, not those generated (the choices run ahead of the stream)."""
    body = {
        "model": "tiny",
        "prompt": [PROMPTS[0], PROMPTS[2]],
        "n": 3,
        "max_tokens": 12,
        "logprobs": 0,  # each chunk lists its tokens
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, last, done = _sse_events(stack, "/v1/completions", body)
    assert done == "[DONE]" and last["choices"] == []
    streamed = 0
    for chunk in chunks:
        streamed += len(chunk["choices"][0]["logprobs"]["tokens"])
        assert chunk["usage"]["completion_tokens"] == streamed
    assert streamed == last["usage"]["completion_tokens"] == 6 * 12
