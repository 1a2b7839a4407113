"""What a client hears when a drain runs out of time, with real processes: a router whose drain
timeout passes with requests in flight ends each one with a 503 `draining` answer (an SSE error
event once tokens went out), aborts it on the workers (every KV block comes back) and exits 0;
a worker whose drain timeout passes cuts its streams, which the router relays as error events."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_failures import (
    WAIT_S,
    load,
    router_args,
    sse_events,
    stream_completion,
    wait_ready,
)

pytestmark = pytest.mark.slow


def start_disaggregated(
    tiny_model: Path, launch_worker: Any, worker_flags: Any, *router_flags: str
) -> tuple[Any, Any, Any, str]:
    prefill = launch_worker("prefill", worker_flags(tiny_model, "--num-kv-blocks", "64"))
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "128"))
    router = launch_worker(
        "router",
        router_args(
            tiny_model, "--prefill", prefill.endpoint, "--decode", decode.endpoint, *router_flags
        ),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    return prefill, decode, router, base


def free_blocks(prefill: Any, decode: Any) -> dict[str, int]:
    return {
        "prefill": load(prefill.endpoint, "prefill").free_blocks,
        "decode": load(decode.endpoint, "decode").free_blocks,
    }


def wait_free(prefill: Any, decode: Any, initial: dict[str, int]) -> None:
    deadline = time.monotonic() + WAIT_S
    while free_blocks(prefill, decode) != initial and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(prefill, decode) == initial


@contextmanager
def frozen(worker: Any) -> Iterator[None]:
    """The block freezes the worker (SIGSTOP); it is resumed when the block ends, however it
    ends. A frozen decode worker keeps a request in flight past the router's drain timeout
    however fast this machine generates; resumed, it reads what the router sent meanwhile (the
    cancelled stream) and frees the request's blocks."""
    try:
        yield
    finally:
        worker.proc.send_signal(signal.SIGCONT)


def check_cut_message(message: str) -> int:
    """The tokens the router says the request was cut after."""
    m = re.fullmatch(
        r"the router is shutting down and its drain timeout \(1s\) has passed; "
        r"the request was cut after (\d+) tokens",
        message,
    )
    assert m, message
    return int(m[1])


def test_router_drain_deadline_ends_a_stream_with_an_error_event(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill, decode, router, base = start_disaggregated(
        tiny_model, launch_worker, worker_flags, "--drain-timeout", "1"
    )
    initial = free_blocks(prefill, decode)
    body = {"prompt": "outlive the drain", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    def freeze_and_stop() -> None:
        decode.proc.send_signal(signal.SIGSTOP)
        router.proc.send_signal(signal.SIGTERM)

    with frozen(decode):
        events = stream_completion(base, body, freeze_and_stop)
        assert router.proc.wait(timeout=WAIT_S) == 0
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-2] == errors[0], events[-3:]
    error = errors[0]["error"]
    assert (error["code"], error["type"]) == ("draining", "server_error")
    tokens = [e for e in events[:-2] if e["choices"][0]["finish_reason"] is None]
    assert len(tokens) == len(events) - 2 >= 3  # the tokens before the cut all reached the client
    assert check_cut_message(error["message"]) >= len(tokens)
    wait_free(prefill, decode, initial)
    assert "Traceback" not in router.log(), router.log()[-3000:]


def test_router_drain_deadline_answers_a_non_streaming_request_503(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill, decode, router, base = start_disaggregated(
        tiny_model, launch_worker, worker_flags, "--drain-timeout", "1"
    )
    initial = free_blocks(prefill, decode)
    body = {"prompt": "outlive the drain", "max_tokens": 1000, "ignore_eos": True}
    answer: list[httpx.Response | Exception] = []

    def complete() -> None:
        try:
            answer.append(httpx.post(base + "/v1/completions", json=body, timeout=WAIT_S))
        except httpx.HTTPError as e:
            answer.append(e)

    client = threading.Thread(target=complete)
    client.start()
    with frozen(decode):
        # Freeze the decode worker once it generates for the request (1000 tokens take a while).
        deadline = time.monotonic() + WAIT_S
        while load(decode.endpoint, "decode").running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        decode.proc.send_signal(signal.SIGSTOP)
        router.proc.send_signal(signal.SIGTERM)
        client.join(timeout=WAIT_S)
        assert router.proc.wait(timeout=WAIT_S) == 0
    assert len(answer) == 1
    r = answer[0]
    assert isinstance(r, httpx.Response), f"no answer: {r!r}"
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == ("draining", "server_error")
    assert check_cut_message(error["message"]) >= 1
    wait_free(prefill, decode, initial)
    assert "Traceback" not in router.log(), router.log()[-3000:]


def test_worker_drain_deadline_reaches_the_client_as_an_error_event(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    """The decode worker's drain timeout passes with streams in flight: it cuts them, saying why,
    and exits 0, and each client stream still ends with an error event and [DONE], not a cut
    connection."""
    prefill = launch_worker("prefill", worker_flags(tiny_model, "--num-kv-blocks", "64"))
    # One sequence at a time: the four 1000-token streams below take seconds in all, so the
    # drain (0 s, then the gRPC server's 1 s grace) cuts some however fast the machine is.
    decode = launch_worker(
        "decode",
        worker_flags(
            tiny_model, "--num-kv-blocks", "512", "--max-batch-size", "1", "--drain-timeout", "0"
        ),
    )
    router = launch_worker(
        "router",
        router_args(tiny_model, "--prefill", prefill.endpoint, "--decode", decode.endpoint),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    initial = load(prefill.endpoint, "prefill").free_blocks
    streams: list[list[Any]] = [[] for _ in range(4)]
    failures: list[Exception] = []

    def run(events: list[Any], i: int) -> None:
        body = {"prompt": f"cut me {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with (
                httpx.Client(timeout=WAIT_S) as client,
                client.stream("POST", base + "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                events.extend(sse_events(r))
        except Exception as e:  # an assertion or a cut connection: reported below
            failures.append(e)

    clients = [threading.Thread(target=run, args=(s, i)) for i, s in enumerate(streams)]
    for c in clients:
        c.start()
    # Every stream has its first token (from the prefill worker); most wait for the decode one.
    deadline = time.monotonic() + WAIT_S
    while not all(streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    decode.proc.send_signal(signal.SIGTERM)
    for c in clients:
        c.join(timeout=WAIT_S)
    assert failures == []
    assert decode.proc.wait(timeout=WAIT_S) == 0
    cut = 0
    reasons = []
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if errors:
            assert len(errors) == 1 and events[-2] == errors[0], events[-3:]
            assert errors[0]["error"]["code"] == "upstream_error"
            assert f"decode worker {decode.endpoint}" in errors[0]["error"]["message"]
            reasons.append(errors[0]["error"]["message"])
            cut += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert cut >= 1
    # The streams the worker was serving, generating or still waiting for their KV, hear why:
    # it ends them with its reason instead of the server's bare "Cancelling all calls". (A
    # Generate that arrives after the worker stopped listening gets a connection error.)
    why = "draining: the worker's drain timeout (0s) passed"
    assert any(why in r for r in reasons), reasons
    assert not any("Cancelling all calls" in r for r in reasons), reasons
    deadline = time.monotonic() + WAIT_S
    while load(prefill.endpoint, "prefill").free_blocks != initial and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load(prefill.endpoint, "prefill").free_blocks == initial
