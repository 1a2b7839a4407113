"""Bad input on the workers' gRPC services, beyond KV chunks (test_faults_kv.py): request bytes
that are not the RPC's message, a PushKV stream that never names its reservation, an Abort in
the middle of a prefill, a decode endpoint that is not host:port, a first token the request's
grammar refuses, and a cut KV stream that the router's routine Abort follows. Each gets a
status that says why (never UNKNOWN with a traceback in the worker's log), and the worker's
free-block count comes back."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from splitserve_workers.engine import grammar as G
from splitserve_workers.kv_transfer import PUSH_KV_METHOD, REQUEST_ID_METADATA
from splitserve_workers.proto import serving_pb2 as pb
from test_faults_kv import expect_status, free_blocks, reserve, wait_free

pytestmark = pytest.mark.slow

SERVICES = {
    "prefill": "PrefillService",
    "decode": "DecodeService",
    "colocated": "ColocatedService",
}
# Not any message: field 1 with a length prefix running past the end (protobuf refuses it).
CORRUPT = b"\xff\xff\xff\xff\x0f"
LEASE_S = 2.0


@pytest.fixture(scope="module")
def workers(launch_module_worker, tiny_model: Path, worker_flags):
    flags = worker_flags(tiny_model, "--num-kv-blocks", "128", "--lease-seconds", "600")
    return {role: launch_module_worker(role, flags) for role in SERVICES}


@pytest.fixture(scope="module")
def leased(launch_module_worker, tiny_model: Path, worker_flags):
    flags = worker_flags(tiny_model, "--num-kv-blocks", "64", "--lease-seconds", str(LEASE_S))
    return launch_module_worker("decode", flags, name="decode-short-lease")


@pytest.fixture(scope="module")
def cutter(launch_module_worker, tiny_model: Path, worker_flags):
    """A decode worker for the cut-stream tests alone: their counts of `stream_cut` must not
    see the verdicts on other tests' cuts (the Abort test cuts a KV stream per attempt), which
    come CUT_GRACE_S after them."""
    flags = worker_flags(tiny_model, "--num-kv-blocks", "64", "--lease-seconds", "600")
    return launch_module_worker("decode", flags, name="decode-cuts")


def unary_request_methods() -> list[tuple[str, str, bool]]:
    """(role, method, server-streaming) for every RPC whose request is a single message."""
    out = []
    for role, service in SERVICES.items():
        for m in pb.DESCRIPTOR.services_by_name[service].methods:
            if not m.client_streaming:
                out.append((role, m.name, m.server_streaming))
    return out


def rejected(worker, reason: str) -> float:
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    key = f'reason="{reason}"'
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("splitserve_requests_rejected_total{") and key in line
    )


@pytest.mark.parametrize(("role", "method", "streaming"), unary_request_methods())
async def test_unparseable_request_is_invalid_argument(workers, dataplane, role, method, streaming):
    worker = workers[role]
    path = f"/splitserve.v1.{SERVICES[role]}/{method}"
    channel = dataplane.channel(worker.endpoint)
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    if streaming:

        async def drain() -> None:
            async for _ in channel.unary_stream(path, **identity)(CORRUPT):
                pass

        call = drain()
    else:
        call = channel.unary_unary(path, **identity)(CORRUPT)
    details = await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT, path)
    assert "not a valid protobuf message" in details
    load = await dataplane.load(worker.endpoint, role)  # still serving
    assert load.free_blocks == load.total_blocks
    log = worker.log()
    assert "Traceback" not in log and "DecodeError" not in log, log[-3000:]


async def test_pushkv_without_metadata_must_name_its_reservation_within_a_lease(leased, dataplane):
    raw = dataplane.channel(leased.endpoint).stream_unary(
        PUSH_KV_METHOD, request_serializer=lambda b: b,
        response_deserializer=pb.PushKVResponse.FromString,
    )  # fmt: skip
    before = rejected(leased, "lease_expired")

    async def silent() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()  # opens the stream, never sends a chunk
        yield b""

    # The call's own deadline only bounds a regression (its DEADLINE_EXCEEDED says nothing of
    # a lease); the worker's answer comes one lease after the stream opened.
    await expect_status(
        raw(silent(), timeout=120), grpc.StatusCode.DEADLINE_EXCEEDED, "sent no chunk within",
        f"({LEASE_S:g}s)",
    )  # fmt: skip
    assert rejected(leased, "lease_expired") == before + 1


async def test_abort_during_prefill_ends_it_cancelled(workers, dataplane):
    """PrefillService.Abort of a prefill still computing: its Prefill call ends CANCELLED
    saying so (INTERNAL, which the router reads as a failed worker, it used to be). Abort is
    sent until it finds the request; a prefill that wins the race is tried again."""
    prefill, decode = workers["prefill"], workers["decode"]
    initial = await free_blocks(dataplane, decode.endpoint)
    spec = (await dataplane.load(decode.endpoint)).model
    prompt = [1 + i % 500 for i in range(1000)]  # the tiny model's whole context, nearly
    caught = 0
    for attempt in range(30):
        rid = f"abort-mid-{attempt}"
        await reserve(dataplane, decode.endpoint, rid, len(prompt))
        call = dataplane.prefill(prefill.endpoint).Prefill(
            pb.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=4), decode_endpoint=decode.endpoint,
                decode_model=spec,
            )
        )  # fmt: skip
        events = asyncio.ensure_future(call.read())
        abort = dataplane.prefill(prefill.endpoint).Abort
        found = False
        while not found and not events.done():
            found = (await abort(pb.AbortRequest(request_id=rid))).found
        if found:
            details = await expect_status(events, grpc.StatusCode.CANCELLED, "was aborted")
            assert rid in details
            caught += 1
        else:
            assert (await events).HasField("first_token")  # the prefill won the race
            call.cancel()
        await dataplane.decode(decode.endpoint).Abort(pb.AbortRequest(request_id=rid))
        await wait_free(dataplane, decode.endpoint, initial)
        if caught >= 3:
            break
    assert caught, "no Abort landed while a 1000-token prefill computed in 30 tries"


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("dns:///", "is not host:port"),
        ("\x00:1", "is not host:port"),
        ("decode:0", "port must be 1-65535"),
        ("a" * 5000 + ":80", "5003 characters"),
    ],
)
async def test_prefill_refuses_a_decode_endpoint_that_is_not_host_port(
    workers, dataplane, endpoint, why
):
    prefill, decode = workers["prefill"], workers["decode"]
    spec = (await dataplane.load(decode.endpoint)).model

    async def run() -> None:
        async for _ in dataplane.prefill(prefill.endpoint).Prefill(
            pb.PrefillRequest(
                request_id="bad-endpoint", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=2), decode_endpoint=endpoint,
                decode_model=spec,
            )
        ):  # fmt: skip
            pass

    details = await expect_status(run(), grpc.StatusCode.INVALID_ARGUMENT, "decode_endpoint: ", why)
    assert len(details) < 200 and endpoint not in details  # not echoed back
    assert (await dataplane.load(prefill.endpoint, "prefill")).running == 0


async def test_decode_refuses_a_first_token_its_grammar_refuses(workers, dataplane):
    decode = workers["decode"]
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "bad-first", 20)
    await dataplane.decode(decode.endpoint).PushKV(kv.full())
    stub = dataplane.decode(decode.endpoint)

    async def generate() -> None:
        async for _ in stub.Generate(
            pb.GenerateRequest(
                request_id="bad-first", prompt_token_ids=list(range(1, 21)), first_token=5,
                sampling=pb.SamplingParams(max_tokens=4, grammar=G.lark('start: "zzzz"')),
            )
        ):  # fmt: skip
            pass

    await expect_status(
        generate(), grpc.StatusCode.INVALID_ARGUMENT, "first_token: 5 is not allowed by"
    )
    await wait_free(dataplane, decode.endpoint, initial)
    assert "breaks its grammar" not in decode.log()  # the caller's error, not logged as ours


async def cut_stream(dataplane, decode, rid: str) -> None:
    """Reserves `rid`, sends one chunk and cancels the stream; returns once the blocks are
    back (the cut was handled)."""
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, rid)
    sent = asyncio.Event()

    async def half() -> AsyncIterator[pb.KVChunk]:
        yield kv.chunk(0, 0, 8)
        sent.set()
        await asyncio.Event().wait()

    call = dataplane.decode(decode.endpoint).PushKV(half(), metadata=((REQUEST_ID_METADATA, rid),))
    await sent.wait()
    await asyncio.sleep(0.2)
    call.cancel()
    await wait_free(dataplane, decode.endpoint, initial)  # freed at once, verdict or not


async def verdict(decode, rid: str) -> str:
    """The log line that judged `rid`'s failed transfer (it comes CUT_GRACE_S after a cut)."""
    line = f"transfer {rid} failed"
    for _ in range(1200):  # a bound on waiting, not a timing
        found = [x for x in decode.log().splitlines() if line in x]
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no verdict on {rid}")


async def test_a_cut_stream_the_routers_routine_abort_follows_is_no_fault(cutter, dataplane):
    """A request that ends with its first token has the router cancel the prefill call and
    Abort the reservation (routine=True) at once; the prefill worker's cut of the KV stream
    can reach decode first. Such an Abort, arriving while the cut awaits its verdict, finds
    it (found=True) and the cut is counted as that routine abort, logged at INFO. An Abort
    that came too late finds nothing (the verdict was given): the attempt is made again."""
    decode = cutter
    cuts = rejected(decode, "stream_cut")
    judged = 0
    for attempt in range(10):
        rid = f"cut-routine-{attempt}"
        await cut_stream(dataplane, decode, rid)
        abort = pb.AbortRequest(request_id=rid, routine=True)
        if (await dataplane.decode(decode.endpoint).Abort(abort)).found:
            line = await verdict(decode, rid)
            assert "then aborted by the router" in line and " INFO " in line, line
            judged += 1
            break
        cuts += 1  # judged a stream_cut before the Abort came
    assert judged, "no routine Abort reached a cut within its grace in 10 tries"
    assert rejected(decode, "stream_cut") == cuts


@pytest.mark.parametrize("abort", [False, None])
async def test_a_cut_stream_is_a_fault_unless_a_routine_abort_follows(cutter, dataplane, abort):
    """Alone, or followed by the Abort the router sends after a failed attempt (routine=False:
    a prefill worker that died mid-transfer, say), a cut KV stream is a `stream_cut` fault."""
    decode = cutter
    rid = f"cut-fault-{abort}"
    cuts = rejected(decode, "stream_cut")
    await cut_stream(dataplane, decode, rid)
    if abort is not None:
        stub = dataplane.decode(decode.endpoint)
        assert not (await stub.Abort(pb.AbortRequest(request_id=rid, routine=abort))).found
    line = await verdict(decode, rid)
    # (a cancelled stream ends, to the grpc.aio handler, like one closed early)
    assert "without the last chunk" in line and " WARNING " in line, line
    assert rejected(decode, "stream_cut") == cuts + 1
