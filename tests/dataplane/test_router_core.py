"""The router's pure parts: request validation (every bad field named), incremental
detokenization with stop strings, the picking policies, discovery (static and real DNS), and
refusing up front a request no worker's cache can hold."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.protocol import kv_transfer_failed
from splitserve_workers.router import openai_api as api
from splitserve_workers.router.detok import IncrementalDetokenizer
from splitserve_workers.router.discovery import DnsDiscovery, StaticDiscovery, split_endpoints
from splitserve_workers.router.flow import (
    Flow,
    FlowError,
    FlowRequest,
    FlowSettings,
    _claim,
    _prefilled,
    _unclaim,
)
from splitserve_workers.router.picking import PrefixIndex, Worker, WorkerLoad, WorkerPool, choose

# ---- detokenization -----------------------------------------------------------------------


class ByteDecoder:
    """Token i is byte i: multi-byte characters span several tokens, like byte-level BPE."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(detok: IncrementalDetokenizer, text: str, per_event: int = 1) -> list[str]:
    ids = list(text.encode())
    out = []
    for i in range(0, len(ids), per_event):
        out.append(detok.add(ids[i : i + per_event]))
    out.append(detok.finish())
    return out


def test_detok_never_splits_a_character() -> None:
    text = "héllo wörld ✓ 你好"
    deltas = feed(IncrementalDetokenizer(ByteDecoder()), text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("per_event", [1, 2, 5])
def test_detok_trims_stop_string_spanning_events(per_event: int) -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), stop=["STOP", "\n\n"])
    deltas = feed(detok, "abc ST and STOP more", per_event)
    assert "".join(deltas) == "abc ST and "
    assert detok.stopped
    assert detok.text == "abc ST and "


def test_detok_holds_back_only_possible_stop_prefixes() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), stop=["xyz"])
    assert detok.add(list(b"abx")) == "ab"  # "x" could start "xyz"
    assert detok.add(list(b"q")) == "xq"  # it did not
    assert detok.finish() == ""


def test_detok_releases_held_text_at_the_end() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), stop=["xyz"])
    assert detok.add(list(b"abxy")) == "ab"
    assert detok.finish() == "xy"
    assert not detok.stopped


def test_detok_skips_eos_ids() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), skip_ids=[0])
    assert detok.add([104, 105, 0]) == "hi"


# ---- request parsing ----------------------------------------------------------------------


def error_of(fn, body: dict, header: str | None = None) -> api.APIError:  # type: ignore[no-untyped-def]
    with pytest.raises(api.APIError) as info:
        fn(body, header)
    return info.value


def test_completion_defaults_and_fields() -> None:
    req = api.parse_completion(
        {
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "stop": "x",
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "user": "u",
        }
    )
    assert (req.prompts, req.max_tokens, req.temperature, req.stop, req.seed) == (
        ["hi"],
        5,
        0.0,
        ["x"],
        3,
    )
    assert req.stream and req.include_usage and req.priority == "interactive"
    assert api.parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert api.parse_completion({"prompt": ["one"]}).prompts == ["one"]
    assert api.parse_completion({"prompt": [[1, 2]]}).prompts == [[1, 2]]
    batch = api.parse_completion({"prompt": ["a", [7, 8]], "n": 2})
    assert (batch.prompts, batch.n) == (["a", [7, 8]], 2)
    assert [batch.prompt_label(i) for i in (0, 1)] == ["prompt[0]", "prompt[1]"]
    assert api.parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3}).n == 3
    assert api.parse_completion({"prompt": "x"}).max_tokens == 16


def test_priority_from_body_or_header() -> None:
    assert (
        api.parse_chat(
            {"messages": [{"role": "user", "content": "x"}], "priority": "background"}
        ).priority
        == "background"
    )
    assert api.parse_completion({"prompt": "x"}, "Background").priority == "background"
    err = error_of(api.parse_completion, {"prompt": "x"}, "urgent")
    assert err.param == api.PRIORITY_HEADER


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "x", "temperature": 3}, "temperature", "invalid_value"),
        ({"prompt": "x", "temperature": True}, "temperature", "invalid_type"),
        ({"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        ({"prompt": "x", "n": 0}, "n", "invalid_value"),
        ({"prompt": "x", "n": 1.5}, "n", "invalid_type"),
        ({"prompt": "x", "n": 2, "best_of": 2}, "best_of", "unsupported_parameter"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "invalid_value"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "unknown_parameter"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "invalid_value"),
        ({"prompt": "x", "stop": [1]}, "stop", "invalid_type"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
        ),
        ({"prompt": 5}, "prompt", "invalid_type"),
        ({"prompt": ["a", 5]}, "prompt", "invalid_type"),
        ({"prompt": ["a", "b", []]}, "prompt[2]", "invalid_type"),
        ({}, "prompt", "missing_required_parameter"),
        ({"prompt": "x", "priority": "now"}, "priority", "invalid_value"),
        ({"prompt": "x", "seed": 1.5}, "seed", "invalid_type"),
    ],
)
def test_completion_errors_name_the_param(body: dict, param: str, code: str) -> None:
    err = error_of(api.parse_completion, body)
    assert err.status == 400
    assert err.param == param
    assert err.code == code
    assert param.split(".")[0] in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ],
)
def test_chat_errors_name_the_param(body: dict, param: str) -> None:
    err = error_of(api.parse_chat, body)
    assert err.status == 400 and err.param == param


def test_chat_content_parts_are_flattened() -> None:
    req = api.parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 7,
        }
    )
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.max_tokens == 7


def test_json_body_errors() -> None:
    with pytest.raises(api.APIError) as info:
        api.parse_json_body(b"{not json")
    assert info.value.status == 400 and info.value.code == "invalid_json"
    with pytest.raises(api.APIError):
        api.parse_json_body(b"[1, 2]")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than the stack
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # past int's digit limit
        b'{"prompt": "\xff"}',  # not UTF-8
    ],
)
def test_hostile_json_is_a_400_not_a_500(raw: bytes) -> None:
    with pytest.raises(api.APIError) as info:
        api.parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


# ---- picking ------------------------------------------------------------------------------


def test_prefill_picks_least_queued_tokens_and_counts_pending() -> None:
    a = WorkerLoad("a:1", healthy=True, queued_tokens=100)
    b = WorkerLoad("b:1", healthy=True, queued_tokens=50)
    assert choose([a, b], "least_queued_tokens") is b
    b.pending_tokens = 80  # this router already sent b work since the last report
    assert choose([a, b], "least_queued_tokens") is a


def test_decode_picks_most_free_blocks_skipping_unhealthy_draining_excluded() -> None:
    a = WorkerLoad("a:1", healthy=True, free_blocks=10)
    b = WorkerLoad("b:1", healthy=True, free_blocks=90, draining=True)
    c = WorkerLoad("c:1", healthy=False, free_blocks=99)
    d = WorkerLoad("d:1", healthy=True, free_blocks=50)
    assert choose([a, b, c, d], "most_free_blocks") is d
    assert choose([a, b, c, d], "most_free_blocks", exclude={"d:1"}) is a
    assert choose([b, c], "most_free_blocks") is None


def test_round_robin_and_unknown_policy() -> None:
    ws = [WorkerLoad("a:1", healthy=True), WorkerLoad("b:1", healthy=True)]
    picked = {choose(ws, "round_robin", counter=i).endpoint for i in range(4)}  # type: ignore[union-attr]
    assert picked == {"a:1", "b:1"}
    with pytest.raises(ValueError, match="policy"):
        choose(ws, "fastest")


def test_cache_aware_counts_the_tokens_left_to_compute() -> None:
    a = WorkerLoad("a:1", healthy=True, queued_tokens=300)
    b = WorkerLoad("b:1", healthy=True, queued_tokens=100)
    # Without cache hits it is least_queued_tokens.
    assert choose([a, b], "cache_aware", prompt_tokens=1000) is b
    # a holds 512 of the prompt's tokens: the pool computes 300 + 488 before this prompt's
    # first token there; on b 100 + 1000, and b recomputes 512 tokens a already holds.
    assert choose([a, b], "cache_aware", prompt_tokens=1000, cached_tokens={"a:1": 512}) is a
    a.pending_tokens = 1100  # a: 1400 + 488 = 1888 against b: 100 + 1000 + 512 = 1612
    assert choose([a, b], "cache_aware", prompt_tokens=1000, cached_tokens={"a:1": 512}) is b
    # a: 1100 + 488 = 1588. This request alone would start sooner on b (after 1100 tokens,
    # not 1588), but moving it costs the pool 512 recomputed tokens: it stays with its cache.
    a.pending_tokens = 800
    assert choose([a, b], "cache_aware", prompt_tokens=1000, cached_tokens={"a:1": 512}) is a


def test_a_computed_prompt_stops_counting_as_queued() -> None:
    load = WorkerLoad("a:1", healthy=True)
    load.pending_tokens, load.pending_requests = 100, 1  # sent since the last report
    _prefilled(load, load.reports, 100, 100, 1)
    assert (load.pending_tokens, load.pending_requests) == (0, 0)
    load.pending_tokens = 50
    sent = load.reports
    # A report landed while it was computed, counting it as queued (and dropping the delta).
    load.reports, load.queued_tokens, load.pending_tokens = load.reports + 1, 80, 0
    _prefilled(load, sent, 50, 50)
    assert (load.queued_tokens, load.pending_tokens) == (30, 0)


def test_prefix_index_matches_leading_blocks_only() -> None:
    index = PrefixIndex()
    first = list(range(100, 148))  # 3 blocks of 16
    index.record(index.hashes(first, 16), "a:1")
    index.record(index.hashes(first[:32] + [7] * 16, 16), "b:1")
    assert index.matched_blocks(index.hashes(first + [1, 2, 3], 16)) == {"a:1": 3, "b:1": 2}
    assert index.matched_blocks(index.hashes(first[:20], 16)) == {"a:1": 1, "b:1": 1}
    # The same block after a different first block is another prefix.
    assert index.matched_blocks(index.hashes([9] * 16 + first[16:], 16)) == {}
    assert index.hashes(first[:15], 16) == []  # no full block


def test_prefix_index_forgets_least_recently_used() -> None:
    index = PrefixIndex(max_entries=4)
    old, new = [1] * 32, [2] * 48
    index.record(index.hashes(old, 16), "a:1")
    index.record(index.hashes(new, 16), "b:1")  # 5 entries: old's first block goes
    assert len(index) == 4
    assert index.matched_blocks(index.hashes(old, 16)) == {}
    assert index.matched_blocks(index.hashes(new, 16)) == {"b:1": 3}


def test_cache_aware_pool_sends_a_conversation_back_to_its_worker() -> None:
    pool = fake_pool("prefill", {"a:1": (64, 64), "b:1": (64, 64)})
    pool.policy = "cache_aware"
    turn1 = list(range(10, 90))
    first = pool.pick(prompt=pool.prompt_key(turn1))
    assert first is not None
    pool.sent(first, pool.prompt_key(turn1))
    first.load.pending_tokens += 50  # a little busier than the other now
    turn2 = pool.prompt_key(turn1 + list(range(200, 240)))
    assert pool.pick(prompt=turn2) is first  # 80 cached tokens outweigh 50 queued
    other = pool.pick(prompt=pool.prompt_key(list(range(500, 580))))  # the idler worker
    assert other is not None and other is not first
    # A worker excluded (it failed) is never picked, cache or not.
    assert pool.pick({first.load.endpoint}, prompt=turn2) is other


# ---- discovery ----------------------------------------------------------------------------


async def test_static_discovery() -> None:
    d = StaticDiscovery(prefill=["a:1"], decode=["b:2", "c:3"])
    assert await d.endpoints("decode") == ["b:2", "c:3"]
    assert d.roles() == ["prefill", "decode"]
    with pytest.raises(ValueError, match="host:port"):
        split_endpoints("a:1,nohost")


async def test_dns_discovery_resolves_a_records() -> None:
    d = DnsDiscovery({"prefill": "localhost:5000", "decode": "localhost:6000"})
    assert await d.endpoints("prefill") == ["127.0.0.1:5000"]
    assert await d.endpoints("colocated") == []
    # A resolver failure (a DNS hiccup) keeps the last good answer...
    loop = asyncio.get_running_loop()

    async def hiccup(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    real = loop.getaddrinfo
    loop.getaddrinfo = hiccup  # type: ignore[method-assign]
    try:
        assert await d.endpoints("prefill") == ["127.0.0.1:5000"]
    finally:
        loop.getaddrinfo = real  # type: ignore[method-assign]
    # ...but a name that does not exist is an empty pool: a headless Service with no ready pod
    # (a pool at zero) has no record, and its old pod addresses may belong to others by now.
    d._services["prefill"] = "no-such-host.invalid:5000"
    assert await d.endpoints("prefill") == []


# ---- health from Load polls ---------------------------------------------------------------


class _ScriptedLoad:
    """A Load stub answering from a script: a LoadReport, or a gRPC status code to fail with."""

    def __init__(self, script: list[object]) -> None:
        self.script = script

    async def Load(self, request: object, timeout: float) -> object:
        import grpc

        step = self.script.pop(0)
        if isinstance(step, grpc.StatusCode):
            raise grpc.aio.AioRpcError(step, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")
        return step


async def test_late_load_answers_mean_busy_until_several_in_a_row() -> None:
    import grpc
    from splitserve_workers.proto import serving_pb2
    from splitserve_workers.router.picking import MAX_LATE_POLLS, WorkerPool

    late, gone = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE
    report = serving_pb2.LoadReport(free_blocks=7, total_blocks=8)
    pool = WorkerPool("decode", StaticDiscovery(decode=["127.0.0.1:1"]), "most_free_blocks")
    script: list[object] = [report, late, report, *[late] * MAX_LATE_POLLS, report, gone]
    try:
        await pool.refresh()  # creates the worker (its first poll fails: nothing listens)
        worker = pool.workers["127.0.0.1:1"]
        worker.stub = _ScriptedLoad(script)
        await pool.refresh()
        assert pool.pick() is worker
        await pool.refresh()  # one late answer: busy, still picked, last report kept
        assert pool.pick() is worker and worker.load.free_blocks == 7
        await pool.refresh()  # an answer resets the count
        for _ in range(MAX_LATE_POLLS - 1):
            await pool.refresh()
            assert pool.pick() is worker
        await pool.refresh()  # late MAX_LATE_POLLS times in a row: taken out of picking
        assert pool.pick() is None
        await pool.refresh()
        assert pool.pick() is worker
        await pool.refresh()  # refused: out at once
        assert pool.pick() is None
        assert script == []
    finally:
        await pool.close()


# ---- requests no worker's whole KV cache can hold ------------------------------------------


def fake_pool(role: str, sizes: dict[str, tuple[int, int]]) -> WorkerPool:
    """A pool of workers as their last Load reports left them: endpoint -> (total blocks, free
    blocks), 16-token blocks. No channel: a request refused up front makes no call."""
    policy = "least_queued_tokens" if role == "prefill" else "most_free_blocks"
    pool = WorkerPool(role, StaticDiscovery(), policy)
    for endpoint, (total, free) in sizes.items():
        load = WorkerLoad(endpoint, healthy=True, total_blocks=total, free_blocks=free)
        pool.workers[endpoint] = Worker(load, None, None, pb.ModelSpec(block_size=16))  # type: ignore[arg-type]
    return pool


@pytest.mark.parametrize("role", ["decode", "colocated"])
@pytest.mark.parametrize("big_free", [0, 2])  # the larger worker picked last / first
async def test_too_large_request_is_explained_by_the_largest_worker(
    role: str, big_free: int
) -> None:
    # A 20-token prompt with max_tokens 20 needs 3 blocks of 16. The 1-block worker cannot hold
    # even the prompt; the 2-block one can, so lowering max_tokens is the fix, whichever worker
    # was asked first.
    workers = fake_pool(role, {"small:1": (1, 1), "big:1": (2, big_free)})
    sampling = pb.SamplingParams(max_tokens=20)
    req = FlowRequest("r", list(range(5, 25)), sampling, pb.PRIORITY_INTERACTIVE)
    prefill = fake_pool("prefill", {"prefill:1": (64, 64)}) if role == "decode" else None
    flow = Flow(req, FlowSettings(), prefill=prefill, **{role: workers})
    with pytest.raises(FlowError) as info:
        async for _ in flow.tokens():
            pass
    e = info.value
    assert (e.status, e.code, e.param) == (400, "request_too_large_for_workers", "max_tokens")
    assert "big:1 has 2 in all" in e.message, e.message


@pytest.mark.parametrize("role", ["decode", "colocated"])
async def test_too_large_for_the_healthy_workers_only_is_busy_not_refused(role: str) -> None:
    # The only worker that could hold the request is unhealthy right now (restarting, or
    # mid-rollout): that is a capacity problem (503), not a request that can never be served.
    workers = fake_pool(role, {"small:1": (1, 1), "big:1": (8, 8)})
    workers.workers["big:1"].load.healthy = False
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=20), 0)
    prefill = fake_pool("prefill", {"prefill:1": (64, 64)}) if role == "decode" else None
    settings = FlowSettings(admission_timeout_seconds=0.2)
    flow = Flow(req, settings, prefill=prefill, **{role: workers})
    with pytest.raises(FlowError) as info:
        async for _ in flow.tokens():
            pass
    assert (info.value.status, info.value.code) == (503, "no_capacity"), info.value.message


class _Stop(Exception):
    """Ends the flow right after the Prefill call is made (which worker got it is the point)."""


class _FakeDecode:
    """Accepts every reservation; `during_reserve` runs while the router waits for it."""

    def __init__(self, during_reserve: Any) -> None:
        self.during_reserve = during_reserve
        self.aborted: list[str] = []

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        self.during_reserve()
        return pb.ReserveResponse(accepted=True, free_blocks=10)

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        self.aborted.append(req.request_id)
        return pb.AbortResponse()


class _FakePrefill:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def Prefill(self, req: pb.PrefillRequest) -> Any:
        self.calls.append(self.name)
        raise _Stop

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


async def test_prefill_worker_lost_while_waiting_for_decode_blocks_is_replaced() -> None:
    # The prefill worker is picked first (decode checks its ModelSpec), then the router may wait
    # for decode blocks; if that worker died meanwhile, its twin gets the Prefill call instead
    # of a doomed attempt.
    calls: list[str] = []
    prefill = fake_pool("prefill", {"a:1": (64, 64), "b:1": (64, 64)})
    for endpoint, worker in prefill.workers.items():
        worker.stub = _FakePrefill(endpoint, calls)
    prefill.workers["b:1"].load.queued_tokens = 1000  # "a:1" is picked first
    decode = fake_pool("decode", {"d:1": (64, 64)})

    def a_dies() -> None:
        prefill.workers["a:1"].load.healthy = False

    decode.workers["d:1"].stub = _FakeDecode(a_dies)
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
    flow = Flow(req, FlowSettings(), prefill=prefill, decode=decode)
    with pytest.raises(_Stop):
        async for _ in flow.tokens():
            pass
    assert calls == ["b:1"]


class _DecodeAt:
    """Accepts every reservation and records which worker got it."""

    def __init__(self, name: str, reserves: list[str]) -> None:
        self.name, self.reserves = name, reserves

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        self.reserves.append(self.name)
        return pb.ReserveResponse(accepted=True, free_blocks=10)

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


class _KVTransferFailed:
    """A Prefill call ending as a prefill worker ends one whose decode worker died or froze
    mid-transfer: with the decode side's status (protocol.kv_transfer_failed)."""

    def __init__(self, decode_endpoint: str) -> None:
        self.decode_endpoint = decode_endpoint

    def __aiter__(self) -> _KVTransferFailed:
        return self

    async def __anext__(self) -> pb.PrefillEvent:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=kv_transfer_failed(self.decode_endpoint, "Stream removed (ping timeout)"),
        )

    def cancel(self) -> bool:
        return False


class _PrefillKVFailsOnce:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls  # the decode endpoint of each Prefill call

    def Prefill(self, req: pb.PrefillRequest) -> Any:
        self.calls.append(req.decode_endpoint)
        if len(self.calls) > 1:
            raise _Stop
        return _KVTransferFailed(req.decode_endpoint)

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


async def test_kv_transfer_failure_is_the_decode_workers_not_the_prefill_workers() -> None:
    # A decode worker that dies or freezes mid-transfer fails the Prefill call with its own
    # status. That must not take the (healthy) prefill worker out of picking: with one prefill
    # worker the retry found none (the router's /ready went 503 too) until its next Load poll.
    calls: list[str] = []
    reserves: list[str] = []
    prefill = fake_pool("prefill", {"p:1": (64, 64)})
    prefill.workers["p:1"].stub = _PrefillKVFailsOnce(calls)
    decode = fake_pool("decode", {"d:1": (64, 64), "e:1": (64, 32)})  # "d:1" is picked first
    for endpoint, worker in decode.workers.items():
        worker.stub = _DecodeAt(endpoint, reserves)
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
    flow = Flow(req, FlowSettings(empty_pool_wait_seconds=0.3), prefill=prefill, decode=decode)
    try:
        async for _ in flow.tokens():
            pass
    except _Stop:
        pass
    except FlowError as e:
        pytest.fail(f"the retry found no prefill worker: {e.status} {e.message}")
    assert calls == ["d:1", "e:1"]  # the same prefill worker, another decode worker
    assert reserves == ["d:1", "e:1"]
    assert prefill.workers["p:1"].load.healthy and prefill.ready()
    assert not decode.workers["d:1"].load.healthy


class _FrozenThenAbort:
    """A decode worker that does not answer its first Aborts in time (frozen), then does."""

    def __init__(self, late: int) -> None:
        self.late, self.calls = late, 0

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        self.calls += 1
        if self.calls <= self.late:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return pb.AbortResponse(found=True)


async def test_abort_to_a_frozen_worker_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A decode worker frozen while a request's KV was on its way completes the reservation when
    # it resumes; an Abort that timed out meanwhile must be sent again, or the blocks wait for
    # the lease.
    from splitserve_workers.router import flow as flow_mod

    monkeypatch.setattr(flow_mod, "ABORT_RETRY_PAUSE_S", 0.01, raising=False)
    pool = fake_pool("decode", {"d:1": (64, 64)})
    stub = _FrozenThenAbort(late=3)
    pool.workers["d:1"].stub = stub
    await flow_mod._abort(pool.workers["d:1"], "r", 0.1)
    assert stub.calls == 4


def _poll_lands(pool: WorkerPool) -> None:
    """What a Load poll does when it ends: wakes whoever waits for the pool to change."""
    pool._changed.set()
    pool._changed = asyncio.Event()


def _with_the_other_pool(role: str, pool: WorkerPool, calls: list[str]) -> dict[str, WorkerPool]:
    """`pool` as the flow's `role` pool, with a healthy fake of the pool a split flow also needs
    (prefill's decode, decode's prefill; colocated needs none)."""
    pools: dict[str, WorkerPool] = {role: pool}
    if role == "prefill":
        pools["decode"] = fake_pool("decode", {"d:1": (64, 64)})
        pools["decode"].workers["d:1"].stub = _FakeDecode(lambda: None)
    elif role == "decode":
        pools["prefill"] = fake_pool("prefill", {"p:1": (64, 64)})
        pools["prefill"].workers["p:1"].stub = _FakePrefill("p:1", calls)
    return pools


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
async def test_a_pool_with_no_worker_is_waited_for(role: str) -> None:
    # Scaled to zero (or every worker restarting): the request waits for a worker to appear
    # instead of failing at once, and gets it when the next poll brings one.
    calls: list[str] = []
    pool = fake_pool(role, {})
    pools = _with_the_other_pool(role, pool, calls)

    async def wake() -> None:
        await asyncio.sleep(0.3)
        pool.workers.update(fake_pool(role, {"new:1": (64, 64)}).workers)
        stubs = {"prefill": _FakePrefill, "colocated": _FakeColocated}
        if role == "decode":
            pool.workers["new:1"].stub = _FakeDecode(lambda: calls.append("reserved on new:1"))
        else:
            pool.workers["new:1"].stub = stubs[role]("new:1", calls)
        _poll_lands(pool)

    waker = asyncio.create_task(wake())
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
    # A short admission timeout (free decode blocks) does not bound the wait for an empty pool.
    settings = FlowSettings(admission_timeout_seconds=0.1, empty_pool_wait_seconds=10)
    flow = Flow(req, settings, **pools)  # type: ignore[arg-type]
    with pytest.raises(_Stop):
        async for _ in flow.tokens():
            pass
    await waker
    expected = {"decode": ["reserved on new:1", "p:1"]}.get(role, ["new:1"])
    assert calls == expected
    # With none arriving, it gives up after the wait and says so.
    pools[role] = fake_pool(role, {})
    empty = Flow(req, FlowSettings(empty_pool_wait_seconds=0.2), **pools)  # type: ignore[arg-type]
    with pytest.raises(FlowError) as info:
        async for _ in empty.tokens():
            pass
    assert (info.value.status, info.value.code) == (503, "no_capacity")
    assert info.value.message == f"no {role} worker became available within 0.2s"


class _FakeColocated:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def Complete(self, req: Any, **_: Any) -> Any:
        self.calls.append(self.name)
        raise _Stop

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


class _Refusing:
    """A worker whose Prefill or Complete call refuses the request as an engine does a prompt
    over its limits (INVALID_ARGUMENT), or serves it (raises _Stop) when `serves`."""

    def __init__(
        self,
        name: str,
        calls: list[str],
        serves: bool = False,
        details: str = "prompt_token_ids: 20 tokens, more than max_model_len 16",
    ) -> None:
        self.name, self.calls, self.serves, self.details = name, calls, serves, details

    def _call(self, req: Any, **_: Any) -> Any:
        self.calls.append(self.name)
        if self.serves:
            raise _Stop
        return self

    Prefill = Complete = _call

    def __aiter__(self) -> _Refusing:
        return self

    async def __anext__(self) -> pb.TokenEvent:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=self.details,
        )

    def cancel(self) -> bool:
        return False

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


def _refusing_pools(role: str, calls: list[str], **refusal: Any) -> dict[str, WorkerPool]:
    """Two `role` workers (a:1, b:1) that refuse every request (_Refusing), and for prefill a
    decode pool that takes its reservations."""
    pool = fake_pool(role, {"a:1": (64, 64), "b:1": (64, 32)})
    for endpoint, worker in pool.workers.items():
        worker.stub = _Refusing(endpoint, calls, **refusal)
    pools: dict[str, WorkerPool] = {role: pool}
    if role == "prefill":
        pools["decode"] = fake_pool("decode", {"d:1": (64, 64)})
        pools["decode"].workers["d:1"].stub = _DecodeAt("d:1", [])
    return pools


@pytest.mark.parametrize("role", ["prefill", "colocated"])
async def test_a_worker_refusing_the_prompt_is_the_clients_400_not_a_failed_worker(
    role: str,
) -> None:
    # A worker's own limits (its --max-model-len below the router's, a cache smaller than the
    # prompt before its first Load report) refuse the request with INVALID_ARGUMENT. Every
    # worker refusing it: a 400 that quotes why, each asked once; never a 502 after asking the
    # same worker again, and the worker stays in picking for everyone else.
    calls: list[str] = []
    pools = _refusing_pools(role, calls)
    pool = pools[role]
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
    flow = Flow(req, FlowSettings(empty_pool_wait_seconds=0.2), **pools)  # type: ignore[arg-type]
    with pytest.raises(FlowError) as info:
        async for _ in flow.tokens():
            pass
    e = info.value
    assert (e.status, e.code) == (400, "request_too_large_for_workers"), e.message
    assert "more than max_model_len 16" in e.message
    assert sorted(calls) == ["a:1", "b:1"]
    assert all(w.load.healthy for w in pool.workers.values()) and pool.ready()
    # One that takes it gets it after the other refused.
    calls.clear()
    pool.workers["b:1"].stub = _Refusing("b:1", calls, serves=True)
    flow = Flow(req, FlowSettings(empty_pool_wait_seconds=0.2), **pools)  # type: ignore[arg-type]
    with pytest.raises(_Stop):
        async for _ in flow.tokens():
            pass
    assert calls == ["a:1", "b:1"]


@pytest.mark.parametrize("role", ["prefill", "colocated"])
async def test_a_grammar_a_worker_refuses_is_a_400_naming_its_field(role: str) -> None:
    # A grammar that compiles but fails in the workers' grammar engine (a lexer limit at its
    # first token): the 400 names the request field it came from, and asks no other worker.
    calls: list[str] = []
    details = "grammar: lexer error: too many expressions constructed (at the first token)"
    pools = _refusing_pools(role, calls, details=details)
    sampling = pb.SamplingParams(max_tokens=4, grammar="start: /(a{1000}){1000}/")
    param = "structured_outputs.regex"
    req = FlowRequest("r", list(range(5, 25)), sampling, 0, grammar_param=param)
    flow = Flow(req, FlowSettings(), **pools)  # type: ignore[arg-type]
    with pytest.raises(FlowError) as info:
        async for _ in flow.tokens():
            pass
    e = info.value
    assert (e.status, e.code, e.param) == (400, "invalid_value", "structured_outputs.regex")
    assert e.message == (
        "'structured_outputs.regex' cannot be used: lexer error: too many expressions "
        "constructed (at the first token)"
    )
    assert len(calls) == 1


class ScriptedCall:
    """A streaming call's answer: these events, then `error` if given (test_router_metrics.py
    uses it too)."""

    def __init__(self, events: list[Any], error: grpc.aio.AioRpcError | None = None) -> None:
        self.events, self.error = list(events), error

    def __aiter__(self) -> ScriptedCall:
        return self

    async def __anext__(self) -> Any:
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> bool:
        return False


class _SplitWorkers:
    """A prefill worker that answers with a first token and a finished transfer, and a decode
    worker whose Generate refuses with INVALID_ARGUMENT: the skew between pools that no real
    pair of this version's workers produces (a prefill side that did not hold its first token
    to the grammar), hence fakes. Records each Abort's `routine` flag."""

    def __init__(self) -> None:
        self.aborts: list[tuple[str, bool]] = []

    def Prefill(self, req: pb.PrefillRequest, **_: Any) -> Any:
        first = pb.PrefillEvent(first_token=pb.FirstToken(token_id=7))
        done = pb.PrefillEvent(transfer_done=pb.TransferDone(bytes=1))
        return ScriptedCall([first, done])

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        return pb.ReserveResponse(accepted=True, free_blocks=10)

    def Generate(self, req: pb.GenerateRequest, **_: Any) -> Any:
        details = "first_token: 7 is not allowed by the request's grammar"
        md = grpc.aio.Metadata()
        refused = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, md, md, details)
        return ScriptedCall([], refused)

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        self.aborts.append((req.request_id, req.routine))
        return pb.AbortResponse()


async def test_a_decode_worker_refusing_generate_stays_in_picking() -> None:
    # A decode worker answering Generate with INVALID_ARGUMENT refuses that request, as a
    # prefill worker refusing a prompt does: the first token is out, so the client gets a 502,
    # but the worker is not taken out of picking (every constrained request of a skewed
    # rollout would otherwise take one out, until the pool was empty). The request ended
    # there, so the decode reservation's Abort is routine.
    workers = _SplitWorkers()
    prefill = fake_pool("prefill", {"p:1": (64, 64)})
    decode = fake_pool("decode", {"d:1": (64, 64)})
    prefill.workers["p:1"].stub = decode.workers["d:1"].stub = workers  # type: ignore[assignment]
    req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
    flow = Flow(req, FlowSettings(), prefill=prefill, decode=decode)
    tokens = []
    with pytest.raises(FlowError) as info:
        async for chunk in flow.tokens():
            tokens.extend(chunk.token_ids)
    assert info.value.status == 502 and "is not allowed by" in info.value.message
    assert tokens == [7]
    assert decode.workers["d:1"].load.healthy and decode.ready()
    for _ in range(100):  # the Aborts are fire-and-forget tasks
        if workers.aborts:
            break
        await asyncio.sleep(0.01)
    assert [routine for _, routine in workers.aborts] == [True]


def test_logprobs_requests_parse_as_openai_defines_them() -> None:
    # Legacy completions: logprobs N (0-5) = the sampled token's logprob plus the N most likely.
    req = api.parse_completion({"prompt": "x", "logprobs": 0})
    assert (req.logprobs, req.top_logprobs) == (True, 0)
    req = api.parse_completion({"prompt": "x", "logprobs": 5})
    assert (req.logprobs, req.top_logprobs) == (True, 5)
    assert not api.parse_completion({"prompt": "x", "logprobs": None}).logprobs
    # With echo: the prompt's tokens get entries too; echo alone or logprobs alone do not.
    req = api.parse_completion({"prompt": "x", "logprobs": 1, "echo": True})
    assert (req.logprobs, req.top_logprobs, req.prompt_logprobs) == (True, 1, True)
    assert not api.parse_completion({"prompt": "x", "echo": True}).prompt_logprobs
    assert not api.parse_completion({"prompt": "x", "logprobs": 1}).prompt_logprobs
    # Chat: a boolean, and top_logprobs (0-20) only with it.
    chat = {"messages": [{"role": "user", "content": "x"}]}
    req = api.parse_chat({**chat, "logprobs": True, "top_logprobs": 20})
    assert (req.logprobs, req.top_logprobs) == (True, 20)
    assert api.parse_chat({**chat, "logprobs": False, "top_logprobs": 0}).logprobs is False
    for body, param, code in [
        ({**chat, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({**chat, "logprobs": 1}, "logprobs", "invalid_type"),
    ]:
        err = error_of(api.parse_chat, body)
        assert (err.status, err.param, err.code) == (400, param, code), body


def test_logprobs_objects_have_openai_shapes() -> None:
    entries = [
        api.TokenLogprob("He", b"He", -0.5, [("He", b"He", -0.5), ("We", b"We", -1.5)]),
        api.TokenLogprob("bytes:\\xc3", b"\xc3", -0.25, [("bytes:\\xc3", b"\xc3", -0.25)]),
    ]
    chat = api.chat_logprobs(entries)
    assert chat["refusal"] is None
    assert chat["content"][0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "We", "logprob": -1.5, "bytes": [87, 101]},
        ],
    }
    assert chat["content"][1]["bytes"] == [0xC3]
    legacy = api.completion_logprobs(entries, b"0123456789")
    assert legacy["tokens"] == ["He", "bytes:\\xc3"]
    assert legacy["token_logprobs"] == [-0.5, -0.25]
    assert legacy["top_logprobs"] == [{"He": -0.5, "We": -1.5}, {"bytes:\\xc3": -0.25}]
    assert legacy["text_offset"] == [10, 12]
    # text_offset counts whole characters: "é" split over two tokens, then "x" at 1.
    split = [
        api.TokenLogprob("bytes:\\xc3", b"\xc3", -1.0, []),
        api.TokenLogprob("bytes:\\xa9", b"\xa9", -1.0, []),
        api.TokenLogprob("x", b"x", -1.0, []),
    ]
    assert api.completion_logprobs(split)["text_offset"] == [0, 0, 1]
    assert api.completion_logprobs(split[2:], b"\xc3\xa9")["text_offset"] == [1]
    # logprobs 0: no alternatives, yet the sampled token is always listed.
    alone = api.completion_logprobs([api.TokenLogprob("a", b"a", -2.0, [])])
    assert alone["top_logprobs"] == [{"a": -2.0}]
    # echo: the prompt's first token has no logprob and no alternatives (null, as OpenAI's).
    echoed = api.completion_logprobs(
        [api.TokenLogprob("Hi", b"Hi", None, []), api.TokenLogprob("!", b"!", -0.1, [])]
    )
    assert echoed["token_logprobs"] == [None, -0.1]
    assert echoed["top_logprobs"] == [None, {"!": -0.1}]
    assert echoed["text_offset"] == [0, 2]


def test_text_offset_indexes_the_text_shown() -> None:
    def entry(raw: bytes, shown: bytes | None = None) -> api.TokenLogprob:
        return api.TokenLogprob(repr(raw), raw, -1.0, [], shown)

    # Bytes no character is made of show as one U+FFFD each run: "\x8f\x8fom" is "��om", so
    # "om" is at 2; an unfinished "\xe4\xbd" cut off by "a" is one U+FFFD too.
    stray = [entry(b"\x8f"), entry(b"\x8f"), entry(b"om")]
    assert api.completion_logprobs(stray)["text_offset"] == [0, 1, 2]
    cut = [entry(b"\xe4"), entry(b"\xbd"), entry(b"a"), entry(b"b")]
    assert api.completion_logprobs(cut)["text_offset"] == [0, 0, 1, 2]
    assert api.completion_logprobs(cut[2:], b"\xe4\xbd")["text_offset"] == [1, 2]
    # A special token (an echoed prompt's BOS, shown=b"") is not in the text: "Hi" is at 0.
    bos = [entry(b"<s>", b""), entry(b"Hi"), entry(b"!")]
    assert api.completion_logprobs(bos)["text_offset"] == [0, 0, 2]
    # A lead byte cut off by another: "\xc3" then "\xc3\xa9" shows as "�é".
    mixed = [entry(b"\xc3"), entry(b"\xc3\xa9"), entry(b"\xffy"), entry(b"\xed\xa0z")]
    assert b"\xc3\xc3\xa9\xffy\xed\xa0z".decode("utf-8", "replace") == "\ufffdé\ufffdy\ufffd\ufffdz"
    assert api.completion_logprobs(mixed)["text_offset"] == [0, 1, 2, 4]
    emoji = [entry(b"\xf0\x9f"), entry(b"\x98"), entry(b"\x80x")]
    assert api.completion_logprobs(emoji)["text_offset"] == [0, 0, 0]


def test_stop_lists_are_bounded() -> None:
    # Each is checked on every generated token, on the router's event loop and the engine's.
    for body, param, message in [
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64 ids, got 65"),
        ({"stop": ["x" * 1001]}, "stop", "at most 1000 characters"),
    ]:
        err = error_of(api.parse_completion, {"prompt": "x", **body})
        assert (err.status, err.param, err.code) == (400, param, "invalid_value")
        assert message in err.message
    ok = api.parse_completion(
        {"prompt": "x", "stop_token_ids": list(range(64)), "stop": "y" * 1000}
    )
    assert len(ok.stop_token_ids) == 64


def test_cache_aware_spreads_new_conversations_like_least_loaded() -> None:
    # Colocated: a runs 60 sequences, b none, nothing queued on either (a poll reset the
    # deltas). A new conversation goes to b, as least_loaded sent it.
    a = WorkerLoad("a:1", healthy=True, running=60, free_blocks=3, total_blocks=4096)
    b = WorkerLoad("b:1", healthy=True, free_blocks=4096, total_blocks=4096)
    assert choose([a, b], "cache_aware", prompt_tokens=500) is b


def test_a_cache_hit_comes_off_a_report_uncached_only() -> None:
    load = WorkerLoad("a:1", healthy=True)
    sent = load.reports
    load.pending_tokens = 8200
    # A report counts the admitted prompt's 8 uncached tokens and 4000 of a request behind it.
    load.reports, load.queued_tokens, load.pending_tokens = load.reports + 1, 4008, 0
    _prefilled(load, sent, 8200, 8200 - 8192, 1)
    assert load.effective_queued_tokens() == 4000


def test_prefix_index_forgets_a_worker_that_failed_or_left() -> None:
    index = PrefixIndex()
    prompt = list(range(100, 164))
    index.record(index.hashes(prompt, 16), "a:1")
    index.record(index.hashes(prompt[:32], 16), "b:1")
    assert index.matched_blocks(index.hashes(prompt, 16)) == {"a:1": 4, "b:1": 2}
    index.forget("a:1")
    assert index.matched_blocks(index.hashes(prompt, 16)) == {"b:1": 2}
    index.record(index.hashes(prompt, 16), "a:1")  # sent again after it came back
    assert index.matched_blocks(index.hashes(prompt, 16)) == {"a:1": 4, "b:1": 2}


def test_a_prompt_is_recorded_when_sent_not_when_picked() -> None:
    pool = fake_pool("colocated", {"a:1": (64, 64), "b:1": (64, 64)})
    pool.policy = "cache_aware"
    prompt = list(range(10, 90))
    picked = pool.pick(prompt=pool.prompt_key(prompt))
    assert picked is not None and len(pool.prefixes) == 0
    pool.sent(picked, pool.prompt_key(prompt))
    assert pool.prefixes.matched_blocks(pool.prefixes.hashes(prompt, 16)) == {
        picked.load.endpoint: 5
    }


def test_a_claimed_worker_looks_busier_to_the_next_pick() -> None:
    # Requests arriving together each pick, then await their decode reservation: the claim
    # made at the pick is what the next request's pick sees.
    pool = fake_pool("prefill", {"a:1": (64, 64), "b:1": (64, 64)})
    pool.policy = "cache_aware"
    first = pool.pick(prompt=pool.prompt_key(list(range(10, 74))))
    assert first is not None
    claimed_at = _claim(first.load, 64)
    second = pool.pick(prompt=pool.prompt_key(list(range(100, 164))))
    assert second is not None and second is not first
    # A reservation that fails gives the claim back, unless a report has replaced it since.
    _unclaim(first.load, 64, claimed_at)
    assert (first.load.pending_tokens, first.load.pending_requests) == (0, 0)
    claimed_at = _claim(second.load, 64)
    second.load.reports += 1
    second.load.pending_tokens = second.load.pending_requests = 0  # what a report does
    _unclaim(second.load, 64, claimed_at)
    assert (second.load.pending_tokens, second.load.pending_requests) == (0, 0)


def test_a_copy_of_a_cached_prompt_claims_only_its_uncached_tail() -> None:
    # n copies of one prompt: the first was sent to a; each further copy finds it cached
    # there and queues only the tail, so all of them stay with a instead of the last ones
    # going to b, which would compute the whole prompt again.
    pool = fake_pool("prefill", {"a:1": (64, 64), "b:1": (64, 64)})
    pool.policy = "cache_aware"
    key = pool.prompt_key(list(range(10, 111)))  # 101 tokens: 6 whole blocks and 5
    a = pool.workers["a:1"]
    pool.sent(a, key)
    assert pool.likely_cached(a, key) == 96 and pool.likely_cached(pool.workers["b:1"], key) == 0
    for _ in range(3):
        copy = pool.pick(prompt=key)
        assert copy is a
        _claim(copy.load, key.tokens - pool.likely_cached(copy, key))
    assert a.load.pending_tokens == 3 * 5


def test_decode_cache_aware_counts_the_blocks_a_worker_holds_as_free() -> None:
    # Decode's cache_aware: the most free blocks once the reservation is made. b holds the
    # prompt's 5 whole blocks (a conversation's earlier turn went there), which it shares
    # instead of allocating: 97 + 5 beats a's 100. Without that history, a.
    pool = fake_pool("decode", {"a:1": (128, 100), "b:1": (128, 97)})
    pool.policy = "cache_aware"
    prompt = list(range(10, 96))  # 86 tokens: 5 whole blocks of 16
    key = pool.prompt_key(prompt)
    assert pool.pick(prompt=key) is pool.workers["a:1"]
    pool.sent(pool.workers["b:1"], key)
    assert pool.pick(prompt=key) is pool.workers["b:1"]
    assert pool.pick(prompt=pool.prompt_key(list(range(500, 586)))) is pool.workers["a:1"]
    # A worker much fuller than the other loses its history's pull.
    pool.workers["b:1"].load.free_blocks = 90
    assert pool.pick(prompt=key) is pool.workers["a:1"]


# ---- decode picking: claims at pick time, load by the scarcer resource ---------------------


def big_decode_pool(**loads: dict[str, int]) -> WorkerPool:
    """Decode workers with a large cache (131072 blocks, as `splitserve up` sizes it on this
    machine) and 128 batch slots; `loads`: endpoint -> WorkerLoad fields to set."""
    pool = fake_pool("decode", {e: (131072, 131072) for e in loads})
    pool.policy = "cache_aware"
    for endpoint, fields in loads.items():
        load = pool.workers[endpoint].load
        load.max_batch_size = 128
        for name, value in fields.items():
            setattr(load, name, value)
    return pool


class _SlowDecode:
    """Accepts every reservation after a moment: requests arriving together all pick before
    the first answer comes back, as they do in a burst."""

    def __init__(self, name: str, reserved: list[str]) -> None:
        self.name, self.reserved = name, reserved

    async def Reserve(self, req: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        await asyncio.sleep(0.05)
        self.reserved.append(self.name)
        return pb.ReserveResponse(accepted=True, free_blocks=131072 - 2 * len(self.reserved))

    async def Abort(self, req: pb.AbortRequest, timeout: float) -> pb.AbortResponse:
        return pb.AbortResponse()


@pytest.mark.parametrize("policy", ["cache_aware", "most_free_blocks"])
async def test_a_decode_burst_spreads_over_the_pool(policy: str) -> None:
    # 16 requests at once: each picks its decode worker and awaits Reserve. Counted only once
    # accepted, every pick saw the same last report and all 16 went to one worker.
    reserved: list[str] = []
    decode = big_decode_pool(**{"a:1": {}, "b:1": {}})
    decode.policy = policy
    for endpoint, worker in decode.workers.items():
        worker.stub = _SlowDecode(endpoint, reserved)
    prefill = fake_pool("prefill", {"p:1": (64, 64)})
    prefill.workers["p:1"].stub = _FakePrefill("p:1", [])

    async def one(i: int) -> None:
        req = FlowRequest(f"r{i}", [5 + i] * 40, pb.SamplingParams(max_tokens=400), 0)
        with pytest.raises(_Stop):
            async for _ in Flow(req, FlowSettings(), prefill=prefill, decode=decode).tokens():
                pass

    await asyncio.gather(*(one(i) for i in range(16)))
    assert sorted(reserved.count(e) for e in ("a:1", "b:1")) == [8, 8], reserved
    # Every claim came off again (each request ended before generating).
    for worker in decode.workers.values():
        assert (worker.load.reserving, worker.load.pending_requests) == (0, 0)
        assert worker.load.pending_blocks == 0


def test_decode_picks_by_batch_slots_when_the_cache_is_not_the_limit() -> None:
    # a runs 24 short sequences (48 blocks), b 2 long ones (1000 blocks): both caches are
    # nearly empty, so b's larger free-block count means nothing; a's batch is 12x fuller.
    pool = big_decode_pool(
        **{
            "a:1": {"running": 24, "free_blocks": 131072 - 48},
            "b:1": {"running": 2, "free_blocks": 131072 - 1000},
        }
    )
    key = pool.prompt_key(list(range(10, 96)))
    assert pool.pick(prompt=key) is pool.workers["b:1"]
    # Waiting sequences and this router's reservations in flight count as well.
    b = pool.workers["b:1"].load
    b.waiting, b.reserving = 10, 13
    assert pool.pick(prompt=key) is pool.workers["a:1"]
    # When the blocks are what runs out, free blocks decide again: b is 95% full.
    b.waiting = b.reserving = 0
    b.free_blocks = 131072 // 20
    assert pool.pick(prompt=key) is pool.workers["a:1"]


def test_decode_history_wins_unless_its_worker_runs_more_sequences() -> None:
    # b holds the conversation's history (5 of its 6 blocks): the next turn goes back there
    # while b runs no more sequences than a, and to a once b runs more.
    pool = big_decode_pool(**{"a:1": {"running": 3}, "b:1": {"running": 3}})
    key = pool.prompt_key(list(range(10, 96)))  # 86 tokens: 5 whole blocks
    pool.sent(pool.workers["b:1"], key)
    assert pool.pick(prompt=key) is pool.workers["b:1"]
    pool.workers["b:1"].load.running = 4
    assert pool.pick(prompt=key) is pool.workers["a:1"]


def test_a_decode_claim_counts_until_the_worker_reports_it() -> None:
    from splitserve_workers.router.picking import DecodeClaim

    load = WorkerLoad("d:1", healthy=True, free_blocks=100, total_blocks=100)
    # Picked: its blocks and its sequence count at once.
    claim = DecodeClaim(load, 3)
    assert (load.effective_free_blocks(), load.reserving, load.sequences()) == (97, 1, 1)
    # Refused: nothing stays counted (twice is harmless).
    claim.release()
    claim.release()
    assert (load.effective_free_blocks(), load.reserving, load.sequences()) == (100, 0, 0)
    # Accepted: the answer's free blocks count it; the sequence counts while its KV travels,
    # through reports (a decode worker's report counts reservations neither running nor
    # waiting).
    claim = DecodeClaim(load, 3)
    other = DecodeClaim(load, 2)  # another request's Reserve, still out
    claim.reserved(97)
    assert (load.effective_free_blocks(), load.reserving) == (95, 2)
    load.reports, load.pending_blocks, load.free_blocks = load.reports + 1, 0, 95  # a poll
    other.reserved(95)  # its blocks were reset by the report: nothing taken off twice
    assert (load.effective_free_blocks(), load.reserving) == (95, 2)
    # Generating: pending until a report counts it running; off when it ends.
    claim.generating()
    assert (load.reserving, load.pending_requests, load.sequences()) == (1, 1, 2)
    claim.release()
    assert (load.reserving, load.pending_requests, load.sequences()) == (1, 0, 1)
    other.generating()
    load.reports, load.pending_requests, load.running = load.reports + 1, 0, 1  # a poll
    other.release()
    assert (load.running, load.reserving, load.sequences()) == (0, 0, 0)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
async def test_a_pool_whose_workers_are_down_names_the_last_failure(role: str) -> None:
    # The pool's one worker refuses connections (killed): a new request waits for it as for an
    # empty pool, and the 503 says what the router last saw go wrong, not only that it waited.
    pool = WorkerPool(role, StaticDiscovery(**{role: ["127.0.0.1:1"]}), "round_robin")
    pools = _with_the_other_pool(role, pool, [])
    try:
        await pool.refresh()  # its Load poll is refused: out of picking
        assert pool.pick() is None
        req = FlowRequest("r", list(range(5, 25)), pb.SamplingParams(max_tokens=4), 0)
        settings = FlowSettings(empty_pool_wait_seconds=0.2)
        with pytest.raises(FlowError) as info:
            async for _ in Flow(req, settings, **pools).tokens():  # type: ignore[arg-type]
                pass
        e = info.value
        assert (e.status, e.code) == (503, "no_capacity"), e.message
        assert e.message.startswith(
            f"no {role} worker became available within 0.2s (last failure: 127.0.0.1:1: "
            "UNAVAILABLE: "
        ), e.message
    finally:
        await pool.close()
