"""What the router does when things go wrong, with real processes: a client that hangs up
mid-stream gets its request aborted on both pools (every KV block comes back), a prefill worker
that is dead before the first token is replaced by another, a decode worker killed mid-stream
ends the client's SSE stream with an error event instead of a hang; and a colocated pool is
served through the same API."""

from __future__ import annotations

import json
import signal
import socket
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

# Bounds on waits so a broken build fails instead of hanging; nothing here measures speed.
WAIT_S = 60.0


def router_args(model: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--model-name",
        "tiny",
        *extra,
    ]


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("router never became ready")


def load(endpoint: str, role: str) -> pb.LoadReport:
    stub_type = {
        "prefill": pb_grpc.PrefillServiceStub,
        "decode": pb_grpc.DecodeServiceStub,
        "colocated": pb_grpc.ColocatedServiceStub,
    }[role]
    with grpc.insecure_channel(endpoint) as channel:
        return stub_type(channel).Load(pb.LoadRequest(), timeout=WAIT_S)


def sse_events(response: httpx.Response) -> Any:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def stream_completion(base: str, body: dict[str, Any], after_three: Any) -> list[Any]:
    """Stream a completion, call after_three() once its third event arrived, and return every
    event. The read timeout turns a hang into a failure; the stream must end long before."""
    events: list[Any] = []
    with (
        httpx.Client(timeout=httpx.Timeout(WAIT_S)) as client,
        client.stream("POST", base + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for event in sse_events(r):
            events.append(event)
            if len(events) == 3:
                after_three()
    return events


def test_client_disconnect_aborts_on_both_pools(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill = launch_worker("prefill", worker_flags(tiny_model, "--num-kv-blocks", "64"))
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "64"))
    router = launch_worker(
        "router",
        router_args(tiny_model, "--prefill", prefill.endpoint, "--decode", decode.endpoint),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    # Worker addresses stay private unless --debug-endpoints is given (the tests below do).
    hidden = httpx.get(base + "/debug/workers", timeout=WAIT_S)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "not_found"
    initial = {
        "prefill": load(prefill.endpoint, "prefill").free_blocks,
        "decode": load(decode.endpoint, "decode").free_blocks,
    }
    assert initial["decode"] == 64

    body = {
        "model": "tiny",
        "prompt": "a long story begins " * 8,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    got = 0
    with (
        httpx.Client(timeout=WAIT_S) as client,
        client.stream("POST", base + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for event in sse_events(r):
            assert event != "[DONE]"
            got += 1
            if got == 3:
                # Mid-generation the decode worker holds this request's blocks.
                assert load(decode.endpoint, "decode").free_blocks < initial["decode"]
                break  # leaving the block closes the connection: the client is gone
    deadline = time.monotonic() + WAIT_S
    free = {}
    while time.monotonic() < deadline:
        free = {
            "prefill": load(prefill.endpoint, "prefill").free_blocks,
            "decode": load(decode.endpoint, "decode").free_blocks,
        }
        if free == initial and load(decode.endpoint, "decode").running == 0:
            break
        time.sleep(0.1)
    assert free == initial
    metrics = httpx.get(base + "/metrics", timeout=WAIT_S).text
    assert 'status="abort"' in metrics
    # The pools still serve.
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "again", "max_tokens": 4}, timeout=WAIT_S
    )
    assert r.status_code == 200, r.text


def test_dead_prefill_worker_is_retried_on_another(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefills = [launch_worker("prefill", worker_flags(tiny_model)) for _ in range(2)]
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "128"))
    # Slow polling: the router keeps believing the killed worker is healthy, so the request
    # really goes to the dead one first (as it would between two polls in production).
    router = launch_worker(
        "router",
        router_args(
            tiny_model,
            "--prefill",
            ",".join(p.endpoint for p in prefills),
            "--decode",
            decode.endpoint,
            "--poll-interval",
            "600",
            "--debug-endpoints",
        ),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    initial = load(decode.endpoint, "decode").free_blocks
    # Both report zero queued tokens; ties go to the lowest endpoint name: kill that one.
    victim = min(prefills, key=lambda p: p.endpoint)
    survivor = max(prefills, key=lambda p: p.endpoint)
    victim.kill()

    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    stream = c.completions.create(
        model="tiny", prompt="retry me please", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    plain = c.completions.create(
        model="tiny", prompt="retry me please", max_tokens=8, temperature=0
    )
    assert text == plain.choices[0].text  # same greedy answer, served by the survivor

    workers = httpx.get(base + "/debug/workers", timeout=WAIT_S).json()
    health = {w["endpoint"]: w["healthy"] for w in workers["prefill"]}
    assert health == {victim.endpoint: False, survivor.endpoint: True}
    # The failed attempt's reservation was released: blocks are back on the decode worker.
    deadline = time.monotonic() + WAIT_S
    while load(decode.endpoint, "decode").free_blocks != initial and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load(decode.endpoint, "decode").free_blocks == initial


def test_decode_killed_mid_stream_ends_with_error_event(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "128"))
    router = launch_worker(
        "router",
        router_args(tiny_model, "--prefill", prefill.endpoint, "--decode", decode.endpoint),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    body = {
        "model": "tiny",
        "prompt": "tell me everything",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    killed_at: list[float] = []

    def kill() -> None:
        decode.kill()
        killed_at.append(time.monotonic())

    events = stream_completion(base, body, kill)
    ended_at = time.monotonic()
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events[-3:]
    assert "decode worker" in errors[0]["error"]["message"]
    assert events[-1] == "[DONE]"
    assert len(events) < 200  # it did not somehow finish the generation
    print(f"stream ended {ended_at - killed_at[0]:.3f}s after the decode worker was killed")
    metrics = httpx.get(base + "/metrics", timeout=WAIT_S).text
    assert 'status="error"' in metrics


def test_colocated_pool_via_dns_discovery_and_router_drain(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    colocated = launch_worker("colocated", worker_flags(tiny_model, "--num-kv-blocks", "128"))
    # DNS discovery as on Kubernetes: the name resolves (A record) to the worker's address.
    router = launch_worker(
        "router",
        router_args(
            tiny_model,
            "--discovery",
            "dns",
            "--colocated",
            f"localhost:{colocated.port}",
            # Long enough that the 900-token stream below finishes on a loaded machine.
            "--drain-timeout",
            "300",
            "--debug-endpoints",
        ),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    workers = httpx.get(base + "/debug/workers", timeout=WAIT_S).json()
    assert [w["endpoint"] for w in workers["colocated"]] == [colocated.endpoint]
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    messages = [{"role": "user", "content": "hello colocated"}]
    stream = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert streamed == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    text = httpx.get(base + "/metrics", timeout=WAIT_S).text
    assert "splitserve_time_to_first_token_seconds_count" in text

    # SIGTERM: the router stops taking requests but lets the one in flight finish.
    body = {"prompt": "drain me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[Any] = []
    with (
        httpx.Client(timeout=WAIT_S) as client,
        client.stream("POST", base + "/v1/completions", json=body) as r,
    ):
        for event in sse_events(r):
            events.append(event)
            if len(events) == 1:
                router.proc.send_signal(signal.SIGTERM)
                # Wait for the signal to land (a busy machine may take a while to run the
                # handler); the stream has seconds left to run.
                deadline = time.monotonic() + WAIT_S
                while time.monotonic() < deadline:
                    if httpx.get(base + "/ready", timeout=WAIT_S).status_code == 503:
                        break
                    time.sleep(0.05)
                assert httpx.get(base + "/ready", timeout=WAIT_S).status_code == 503
                refused = httpx.post(
                    base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=WAIT_S
                )
                assert refused.status_code == 503
    assert events[-1] == "[DONE]"
    finished = [e for e in events if isinstance(e, dict) and e["choices"][0]["finish_reason"]]
    assert [e["choices"][0]["finish_reason"] for e in finished] == ["length"]
    assert router.proc.wait(timeout=WAIT_S) == 0


def test_request_no_decode_worker_can_hold_is_refused_at_once(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "2"))
    router = launch_worker(
        "router",
        router_args(
            tiny_model,
            "--prefill",
            prefill.endpoint,
            "--decode",
            decode.endpoint,
            "--admission-timeout",
            "600",
        ),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    # 2 blocks of 16 tokens cannot hold 100 prompt tokens: no amount of waiting helps, so the
    # answer is a 400 now, not a 503 after the 600 s admission timeout.
    r = httpx.post(
        base + "/v1/completions", json={"prompt": list(range(2, 102)), "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 400, r.text
    assert "KV blocks" in r.json()["error"]["message"]
    ok = httpx.post(
        base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=120
    )
    assert ok.status_code == 200, ok.text
    assert_cache_bound_on_max_tokens(base, prompt_tokens=3, cache_tokens=32)


def assert_cache_bound_on_max_tokens(base: str, prompt_tokens: int, cache_tokens: int) -> None:
    """A worker's whole cache holds the prompt and every generated token but the last: the
    largest max_tokens that fits is answered in full, one more is a 400 naming max_tokens
    (before, it was accepted and cut short with finish_reason "length")."""
    most = cache_tokens - prompt_tokens + 1
    prompt = list(range(5, 5 + prompt_tokens))
    body = {"prompt": prompt, "max_tokens": most, "ignore_eos": True, "temperature": 0}
    full = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["completion_tokens"] == most
    too_many = httpx.post(
        base + "/v1/completions", json={**body, "max_tokens": most + 1}, timeout=120
    )
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["code"] == "request_too_large_for_workers"
    assert f"max_tokens ({most + 1})" in error["message"]
    # Chat without max_tokens runs to the context limit; on a smaller cache it is not refused
    # but ends at the cache's end with finish_reason "length".
    chat = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "length"


def test_colocated_request_larger_than_the_cache_is_refused(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    colocated = launch_worker("colocated", worker_flags(tiny_model, "--num-kv-blocks", "2"))
    router = launch_worker("router", router_args(tiny_model, "--colocated", colocated.endpoint))
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    assert_cache_bound_on_max_tokens(base, prompt_tokens=3, cache_tokens=32)
    r = httpx.post(
        base + "/v1/completions", json={"prompt": list(range(2, 102)), "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] is None


def test_worker_leaving_discovery_mid_stream_finishes_its_streams(
    tiny_model: Path, launch_worker: Any, worker_flags: Any, tmp_path: Path
) -> None:
    """Scale-down as local mode's autoscaler (and a Kubernetes pod leaving DNS) does it: the
    decode worker is removed from discovery and sent SIGTERM while it serves a stream. The
    stream must finish (the router keeps the worker's channel for it), new requests go to the
    worker added in its place, and the drained worker exits 0."""
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    old = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "128"), name="old")
    workers_file = tmp_path / "workers.json"

    def publish(decode: list[str]) -> None:
        tmp = workers_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"prefill": [prefill.endpoint], "decode": decode}))
        tmp.replace(workers_file)

    publish([old.endpoint])
    router = launch_worker(
        "router",
        router_args(tiny_model, "--workers-file", str(workers_file), "--debug-endpoints"),
    )
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    new = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "128"), name="new")

    def decode_endpoints() -> list[str]:
        workers = httpx.get(base + "/debug/workers", timeout=WAIT_S).json()
        return [w["endpoint"] for w in workers["decode"]]

    def retire_old() -> None:
        publish([new.endpoint])
        deadline = time.monotonic() + WAIT_S
        while decode_endpoints() != [new.endpoint] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode_endpoints() == [new.endpoint]
        old.proc.send_signal(signal.SIGTERM)
        # A request made now is served by the new worker while the old one drains.
        other = httpx.post(
            base + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
            timeout=WAIT_S,
        )
        assert other.status_code == 200, other.text
        assert other.json()["usage"]["completion_tokens"] == 4

    body = {"prompt": "keep going", "max_tokens": 300, "ignore_eos": True, "stream": True}
    events = stream_completion(base, body, retire_old)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors == []
    assert events[-1] == "[DONE]"
    tokens = [e for e in events if isinstance(e, dict) and e["choices"][0]["text"] is not None]
    finished = [
        e["choices"][0]["finish_reason"] for e in tokens if e["choices"][0]["finish_reason"]
    ]
    assert finished == ["length"]
    assert old.proc.wait(timeout=WAIT_S) == 0, old.log()[-2000:]
    assert load(new.endpoint, "decode").free_blocks == load(new.endpoint, "decode").total_blocks


async def test_a_worker_picked_before_it_left_discovery_can_still_be_called(
    tiny_model: Path, launch_worker: Any, worker_flags: Any, tmp_path: Path
) -> None:
    """A request picks its decode worker, then spends seconds in prefill; meanwhile the worker
    leaves discovery (retired). Its channel must still carry the request's next call."""
    from splitserve_workers.router.discovery import FileDiscovery
    from splitserve_workers.router.picking import WorkerPool

    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "16"))
    path = tmp_path / "workers.json"

    def publish(endpoints: list[str]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"prefill": [], "decode": endpoints}))
        tmp.replace(path)

    publish([decode.endpoint])
    pool = WorkerPool("decode", FileDiscovery(str(path)), "most_free_blocks", poll_interval=60)
    await pool.start()
    try:
        picked = pool.pick()
        assert picked is not None
        publish([])
        await pool.refresh()
        assert pool.pick() is None and picked.load.draining
        report = await picked.stub.Load(pb.LoadRequest(), timeout=WAIT_S)
        assert report.total_blocks == 16
    finally:
        await pool.close()


def test_a_router_for_pools_that_scale_to_zero_stays_ready_and_waits(
    tiny_model: Path, launch_worker: Any
) -> None:
    # No worker answers at these addresses (a pool at zero). By default the router is not
    # ready; with --ready-without-workers it is (so the requests that wake the pools reach it),
    # and a request waits --empty-pool-wait for a worker before its 503.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    pools = ("--prefill", nobody, "--decode", nobody, "--empty-pool-wait", "1")
    strict = launch_worker("router", router_args(tiny_model, *pools))
    waiting = launch_worker("router", router_args(tiny_model, *pools, "--ready-without-workers"))
    time.sleep(1.0)  # a few Load polls
    r = httpx.get(f"http://127.0.0.1:{strict.port}/ready", timeout=5)
    assert r.status_code == 503 and r.json()["pools"] == {"prefill": False, "decode": False}
    base = f"http://127.0.0.1:{waiting.port}"
    assert httpx.get(base + "/ready", timeout=5).status_code == 200
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "no_capacity"
    # It names what the router last saw go wrong there: the refused Load polls.
    assert error["message"].startswith(
        f"no prefill worker became available within 1s (last failure: {nobody}: UNAVAILABLE: "
    ), error["message"]
