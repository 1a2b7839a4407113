"""The router's edge metrics tell what the client saw: a request the router refused counts no
tokens, one a bug ends (a 500) is an error, not an abort, the TTFT stage split holds only what
the first token waited for, a colocated request has no stage split, and `splitserve up`'s live
line counts requests, not choices. Flows are scripted or the workers faked, in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from splitserve_workers.local import LiveLine
from splitserve_workers.metrics import router_metrics
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.protocol import kv_transfer_failed
from splitserve_workers.router import app as app_mod
from splitserve_workers.router.app import Router, RouterOptions, load_tokenizer
from splitserve_workers.router.discovery import StaticDiscovery
from splitserve_workers.router.flow import (
    Flow,
    FlowError,
    FlowRequest,
    FlowSettings,
    FlowStats,
    TokenChunk,
)
from test_router_core import ScriptedCall, fake_pool

# ---- status and token counters at the HTTP edge ---------------------------------------------


class _FailingFlow:
    """A flow that fails before its first token with `error` (what the workers would cause)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.stats = FlowStats()

    def tokens(self) -> AsyncIterator[TokenChunk]:
        async def gen() -> AsyncIterator[TokenChunk]:
            raise self.error
            yield  # an async generator

        return gen()


def _router(tiny_model: Path) -> Router:
    options = RouterOptions(
        model_name="tiny",
        model_dir=str(tiny_model),
        max_model_len=1024,
        # Nothing listens there: every flow below is scripted.
        discovery=StaticDiscovery(["127.0.0.1:9"], ["127.0.0.1:9"], []),
        poll_interval=5.0,
    )
    return Router(options, load_tokenizer(str(tiny_model)))


def _value(router: Router, name: str, **labels: str) -> float:
    value = router.registry.get_sample_value(name, {**router.labels, **labels})
    return value or 0.0


@pytest.mark.parametrize(
    ("error", "http_status", "status"),
    [
        # No worker can hold it: refused, nothing computed, no usage.
        (FlowError(400, "too large", code="request_too_large_for_workers"), 400, "rejected"),
        # Refused too, but for want of capacity (the operator's SLO alerts count these apart
        # from the client's own mistakes).
        (FlowError(503, "busy", code="no_capacity"), 503, "no_capacity"),
        (FlowError(502, "prefill failed"), 502, "error"),
        # A bug: the middleware answers 500; the request did not abort.
        (RuntimeError("a bug"), 500, "error"),
    ],
)
async def test_a_request_that_fails_counts_its_status_and_no_refused_tokens(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    http_status: int,
    status: str,
) -> None:
    router = _router(tiny_model)
    monkeypatch.setattr(app_mod, "Flow", lambda *a, **k: _FailingFlow(error))
    async with TestClient(TestServer(router.app())) as c:
        for stream in (False, True):
            r = await c.post(
                "/v1/completions", json={"prompt": "hello world", "max_tokens": 4, "stream": stream}
            )
            assert r.status == http_status, await r.text()
    assert _value(router, "splitserve_requests_total", status=status) == 2
    for other in {"ok", "error", "abort", "rejected", "no_capacity"} - {status}:
        assert _value(router, "splitserve_requests_total", status=other) == 0, other
    sent = 2 * len(router.tokenizer.encode("hello world", add_special_tokens=True))
    prompt_tokens = _value(router, "splitserve_prompt_tokens_total")
    assert prompt_tokens == (0 if status in ("rejected", "no_capacity") else sent), prompt_tokens
    assert _value(router, "splitserve_router_requests_in_flight") == 0


# ---- the TTFT stage split -------------------------------------------------------------------


class _Prefill:
    """Sends the first token each time; the first call's KV transfer then fails on the decode
    side (the decode worker died), the next one's is done."""

    def __init__(self) -> None:
        self.calls = 0

    def Prefill(self, req: pb.PrefillRequest) -> ScriptedCall:
        self.calls += 1
        first = pb.PrefillEvent(
            first_token=pb.FirstToken(token_id=7, queue_seconds=0.001, compute_seconds=0.002)
        )
        if self.calls == 1:
            failed = grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=kv_transfer_failed(req.decode_endpoint, "Socket closed"),
            )
            return ScriptedCall([first], failed)
        done = pb.PrefillEvent(transfer_done=pb.TransferDone(transfer_seconds=0.001, bytes=64))
        return ScriptedCall([first, done])

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


class _Decode:
    """Admits after `wait` seconds; generates the last token."""

    def __init__(self, wait: float) -> None:
        self.wait = wait

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        await asyncio.sleep(self.wait)
        return pb.ReserveResponse(accepted=True, free_blocks=10)

    def Generate(self, req: pb.GenerateRequest) -> ScriptedCall:
        return ScriptedCall([pb.TokenEvent(token_ids=[8], finished=True, finish_reason="length")])

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


async def test_decode_admission_after_the_first_token_is_not_a_ttft_stage() -> None:
    # The first token goes out, then the KV transfer fails with its decode worker: the retry
    # waits for another decode worker (here at least 1 s; a restarting one took 26 s) while
    # the client waits for its second token. That wait is no part of the time to first token,
    # which the stage split describes (it was reported as decode admission, larger than TTFT).
    prefill = fake_pool("prefill", {"p:1": (64, 64)})
    prefill.workers["p:1"].stub = _Prefill()
    decode = fake_pool("decode", {"d:1": (64, 64), "e:1": (64, 32)})  # "d:1" is picked first
    decode.workers["d:1"].stub = _Decode(0.0)
    decode.workers["e:1"].stub = _Decode(1.0)
    req = FlowRequest(
        "r", list(range(5, 25)), pb.SamplingParams(max_tokens=2), pb.PRIORITY_INTERACTIVE
    )
    flow = Flow(req, FlowSettings(), prefill=prefill, decode=decode)
    chunks = [chunk async for chunk in flow.tokens()]
    assert [c.token_ids for c in chunks] == [[7], [8]]
    assert flow.stats.prefill_attempts == 2 and flow.stats.decode_endpoint == "e:1"
    admission = flow.stats.decode_admission_seconds
    assert admission is not None and admission < 1.0, admission  # the retry alone took 1 s or more


async def test_decode_admission_adds_every_wait_before_the_first_token() -> None:
    # The first attempt's prefill worker fails before its first token: the first token waited
    # for both reservations.
    class _PrefillFailsFirst(_Prefill):
        def Prefill(self, req: pb.PrefillRequest) -> ScriptedCall:
            self.calls += 1
            if self.calls == 1:
                lost = grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
                )
                return ScriptedCall([], lost)
            return super().Prefill(req)

    prefill = fake_pool("prefill", {"p:1": (64, 64), "q:1": (64, 64)})
    stub = _PrefillFailsFirst()  # the first call, on either worker, fails
    for worker in prefill.workers.values():
        worker.stub = stub
    decode = fake_pool("decode", {"d:1": (64, 64)})
    decode.workers["d:1"].stub = _Decode(0.2)
    req = FlowRequest(
        "r", list(range(5, 25)), pb.SamplingParams(max_tokens=2), pb.PRIORITY_INTERACTIVE
    )
    flow = Flow(req, FlowSettings(), prefill=prefill, decode=decode)
    assert len([chunk async for chunk in flow.tokens()]) == 2
    assert flow.stats.prefill_attempts == 2
    admission = flow.stats.decode_admission_seconds
    assert admission is not None and admission >= 0.4, admission


class _Colocated:
    def Complete(self, req: Any, **_: Any) -> ScriptedCall:
        return ScriptedCall(
            [
                pb.TokenEvent(token_ids=[7]),
                pb.TokenEvent(token_ids=[8], finished=True, finish_reason="length"),
            ]
        )

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


async def test_a_colocated_request_has_no_stage_split() -> None:
    # The Complete call's wait for its first token holds the worker's queue and its compute:
    # it was reported as prefill compute ("prefill forward passes").
    pool = fake_pool("colocated", {"c:1": (64, 64)})
    pool.workers["c:1"].stub = _Colocated()
    req = FlowRequest(
        "r", list(range(5, 25)), pb.SamplingParams(max_tokens=2), pb.PRIORITY_INTERACTIVE
    )
    flow = Flow(req, FlowSettings(), colocated=pool)
    assert len([chunk async for chunk in flow.tokens()]) == 2
    stats = flow.stats
    assert stats.prefill_queue_seconds is None and stats.prefill_compute_seconds is None
    assert stats.decode_admission_seconds is None and stats.kv_transfer_seconds is None


# ---- splitserve up's live line --------------------------------------------------------------


def test_the_live_line_counts_requests_not_choices() -> None:
    registry = CollectorRegistry()
    m = router_metrics(registry)
    labels = {"service": "local", "pool": "router", "model": "tiny"}
    line = LiveLine()
    m.requests.labels(**labels, status="ok").inc()  # one request with n=3: three TTFTs
    for _ in range(3):
        m.ttft.labels(**labels).observe(0.05)
        m.tpot.labels(**labels).observe(0.01)
    text = line.update(generate_latest(registry).decode())
    assert text is not None and text.startswith("1 new request(s)"), text
    m.requests.labels(**labels, status="ok").inc()
    m.requests.labels(**labels, status="abort").inc()
    m.ttft.labels(**labels).observe(0.05)
    m.ttft.labels(**labels).observe(0.05)
    text = line.update(generate_latest(registry).decode())
    assert text is not None and text.startswith("2 new request(s)"), text
    assert line.update(generate_latest(registry).decode()) is None  # nothing new


# ---- priority at decode admission -------------------------------------------------------------


class _Slots:
    """A decode worker whose Reserve accepts only while it has `free` reservations to give (a
    full KV cache as the router meets it: refusals until blocks free up), in arrival order."""

    def __init__(self) -> None:
        self.free = 0
        self.accepted: list[str] = []
        self.asked: list[tuple[str, bool]] = []  # (request id, waiting) of every call

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        self.asked.append((req.request_id, req.waiting))
        if self.free <= 0:
            return pb.ReserveResponse(accepted=False, reason="no_free_blocks", free_blocks=0)
        self.free -= 1
        self.accepted.append(req.request_id)
        return pb.ReserveResponse(accepted=True, free_blocks=0)

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


async def test_blocks_that_free_up_go_to_a_waiting_interactive_request_first() -> None:
    # A decode worker's Reserve does not rank its callers: without the router holding
    # background requests back, the one that happened to poll first took the freed blocks,
    # however long an interactive request had waited.
    decode = fake_pool("decode", {"d:1": (64, 64)})
    slots = _Slots()
    decode.workers["d:1"].stub = slots
    prompt = list(range(5, 25))

    def reserve(rid: str, priority: int) -> asyncio.Task[Any]:
        flow = Flow(
            FlowRequest(rid, prompt, pb.SamplingParams(max_tokens=2), priority),
            FlowSettings(),
            prefill=fake_pool("prefill", {"p:1": (64, 64)}),
            decode=decode,
        )
        return asyncio.create_task(flow._reserve(rid, pb.ModelSpec(), decode.prompt_key(prompt)))

    background = reserve("background", pb.PRIORITY_BACKGROUND)
    await asyncio.sleep(0.1)  # refused first: it retries first
    interactive = reserve("interactive", pb.PRIORITY_INTERACTIVE)
    await asyncio.sleep(0.1)
    assert decode.interactive_waiting == 1
    slots.free = 1  # one request's blocks free up
    await interactive
    assert slots.accepted == ["interactive"] and decode.interactive_waiting == 0
    # The interactive request tells the workers it waits (refused everywhere once), so they
    # hold background requests of other routers back too; its first call does not.
    interactive_calls = [waiting for rid, waiting in slots.asked if rid == "interactive"]
    assert interactive_calls[0] is False and interactive_calls[-1] is True
    assert all(not waiting for rid, waiting in slots.asked if rid == "background")
    slots.free = 1
    await background
    assert slots.accepted == ["interactive", "background"]
