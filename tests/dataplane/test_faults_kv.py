"""A raw KV client against a real decode worker: garbage, truncated, oversized and mismatched
chunks each get the specified gRPC status, Generate for such a request fails promptly with the
reason, stalled transfers lose their lease, and afterwards the free-block count (Load RPC) is
back to its initial value every time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import pytest
import torch
from splitserve_workers.kv_transfer import PUSH_KV_METHOD, REQUEST_ID_METADATA
from splitserve_workers.proto import serving_pb2 as pb

pytestmark = pytest.mark.slow

PROMPT = 40  # tokens per test reservation
# The lease tests' worker: short so they finish quickly, yet long enough that a test client on a
# loaded machine gets its chunks in before it runs out where the test needs them to.
LEASE_S = 2.0
# Every other test's worker: a lease no test step comes near, so a slow step on a busy machine
# cannot turn the failure under test into a lease expiry (and "freed at once" means at once).
LONG_LEASE_S = 600.0
# A bound on waiting for blocks to come back: a leak fails, a busy machine does not.
WAIT_S = 120.0


@pytest.fixture(scope="module")
def decode(launch_module_worker, tiny_model: Path, worker_flags):
    return launch_module_worker(
        "decode",
        worker_flags(tiny_model, "--num-kv-blocks", "64", "--lease-seconds", str(LONG_LEASE_S)),
    )


@pytest.fixture(scope="module")
def leased(launch_module_worker, tiny_model: Path, worker_flags):
    """A decode worker with a short lease, for the tests where the lease must run out."""
    return launch_module_worker(
        "decode",
        worker_flags(tiny_model, "--num-kv-blocks", "64", "--lease-seconds", str(LEASE_S)),
        name="decode-short-lease",
    )


class RawKV:
    """Builds well-formed chunks for a reservation, so each test can break exactly one thing."""

    def __init__(self, spec: pb.ModelSpec, request_id: str, num_tokens: int = PROMPT) -> None:
        self.spec = spec
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.itemsize = 4 if spec.dtype == "float32" else 2

    def chunk(
        self, layer: int, start: int, count: int, *, last: bool = False, **override: object
    ) -> pb.KVChunk:
        n = count * self.spec.num_kv_heads * self.spec.head_dim
        data = torch.randn(n, dtype=torch.float32).numpy().tobytes()[: n * self.itemsize]
        fields: dict[str, object] = dict(
            request_id=self.request_id, layer=layer, token_start=start, token_count=count,
            dtype=self.spec.dtype, key=data, value=data, last=last,
        )  # fmt: skip
        fields.update(override)
        return pb.KVChunk(**fields)

    def full(self, per_chunk: int = 16) -> list[pb.KVChunk]:
        chunks = [
            self.chunk(layer, s, min(per_chunk, self.num_tokens - s))
            for layer in range(self.spec.num_layers)
            for s in range(0, self.num_tokens, per_chunk)
        ]
        chunks[-1].last = True
        return chunks


async def reserve(dataplane, endpoint: str, request_id: str, n: int = PROMPT) -> RawKV:
    spec = (await dataplane.load(endpoint)).model
    res = await dataplane.decode(endpoint).Reserve(
        pb.ReserveRequest(request_id=request_id, model=spec, num_prompt_tokens=n)
    )
    assert res.accepted, res.reason
    return RawKV(spec, request_id, n)


async def push(
    dataplane,
    endpoint: str,
    chunks: Iterable[pb.KVChunk] | AsyncIterator[pb.KVChunk],
    request_id: str | None = None,
) -> pb.PushKVResponse:
    md = ((REQUEST_ID_METADATA, request_id),) if request_id else None
    return await dataplane.decode(endpoint).PushKV(chunks, metadata=md)


async def expect_status(coro, code: grpc.StatusCode, *details: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    assert e.value.code() == code, e.value.details()
    for d in details:
        assert d in e.value.details()
    return e.value.details()


async def generate(dataplane, endpoint: str, request_id: str, n: int = PROMPT) -> list[int]:
    tokens: list[int] = []
    async for ev in dataplane.decode(endpoint).Generate(
        pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=list(range(1, n + 1)), first_token=3,
            sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
        )
    ):  # fmt: skip
        tokens.extend(ev.token_ids)
    return tokens


async def free_blocks(dataplane, endpoint: str) -> int:
    return (await dataplane.load(endpoint)).free_blocks


async def wait_free(dataplane, endpoint: str, expected: int) -> None:
    free = -1
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        free = await free_blocks(dataplane, endpoint)
        if free == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"free blocks {free}, expected {expected}")


async def test_complete_transfer_then_generate(decode, dataplane):
    """The raw client itself is right: a complete transfer is accepted and generates."""
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "ok")
    assert await free_blocks(dataplane, decode.endpoint) < initial
    resp = await push(dataplane, decode.endpoint, kv.full())
    assert resp.chunks == kv.spec.num_layers * 3
    per_token_layer = kv.spec.num_kv_heads * kv.spec.head_dim * kv.itemsize
    assert resp.bytes == 2 * PROMPT * kv.spec.num_layers * per_token_layer
    # max_tokens counts the first token (sampled by prefill), so Generate streams 3 more.
    assert len(await generate(dataplane, decode.endpoint, "ok")) == 3
    await wait_free(dataplane, decode.endpoint, initial)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
# Each case: name -> (chunks to send given a RawKV, expected code, text in the details).
GARBAGE = {
    "wrong_key_size": (lambda kv: [kv.chunk(0, 0, 8, key=b"\0" * 10)], INVALID, "key: 10 bytes"),
    "wrong_value_size": (lambda kv: [kv.chunk(0, 0, 8, value=b"")], INVALID, "value: 0 bytes"),
    "wrong_dtype": (lambda kv: [kv.chunk(0, 0, 8, dtype="float16")], INVALID, "dtype"),
    "layer_too_big": (lambda kv: [kv.chunk(kv.spec.num_layers, 0, 8)], INVALID, "layer"),
    "layer_negative": (lambda kv: [kv.chunk(-1, 0, 8)], INVALID, "layer: -1"),
    "tokens_past_reservation": (lambda kv: [kv.chunk(0, PROMPT - 4, 8)], INVALID, "token_start"),
    "negative_token_start": (lambda kv: [kv.chunk(0, -8, 8)], INVALID, "token_start"),
    "duplicate_chunk": (lambda kv: [kv.chunk(0, 0, 8), kv.chunk(0, 4, 8)], INVALID, "duplicate"),
    "other_request_id": (
        lambda kv: [kv.chunk(0, 0, 8), kv.chunk(1, 0, 8, request_id="other")],
        INVALID,
        "request_id",
    ),
    "truncated_stream": (lambda kv: kv.full()[:-1], PRECONDITION, "without the last chunk"),
    "last_but_incomplete": (lambda kv: [kv.chunk(0, 0, 8, last=True)], PRECONDITION, "last chunk"),
}


@pytest.mark.parametrize("name", list(GARBAGE))
async def test_bad_transfer_is_rejected_and_freed(decode, dataplane, name):
    make, code, detail = GARBAGE[name]
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, f"bad-{name}")
    # A Generate already waiting for the KV must fail as soon as the transfer does.
    waiting = asyncio.ensure_future(generate(dataplane, decode.endpoint, kv.request_id))
    await asyncio.sleep(0.1)
    await expect_status(push(dataplane, decode.endpoint, make(kv)), code, detail)
    got = await expect_status(asyncio.wait_for(waiting, 60), code, "KV transfer failed", detail)
    assert kv.request_id in got or detail in got
    # And a later Generate gets the same reason instead of hanging or "unknown".
    await expect_status(generate(dataplane, decode.endpoint, kv.request_id), code, detail)
    await wait_free(dataplane, decode.endpoint, initial)


async def test_unknown_request_id(decode, dataplane):
    spec = (await dataplane.load(decode.endpoint)).model
    kv = RawKV(spec, "never-reserved")
    await expect_status(
        push(dataplane, decode.endpoint, [kv.chunk(0, 0, 8)]),
        grpc.StatusCode.FAILED_PRECONDITION, "no reservation",
    )  # fmt: skip
    await expect_status(
        generate(dataplane, decode.endpoint, "never-reserved"),
        grpc.StatusCode.FAILED_PRECONDITION, "no reservation",
    )  # fmt: skip


async def test_malformed_bytes(decode, dataplane):
    initial = await free_blocks(dataplane, decode.endpoint)
    await reserve(dataplane, decode.endpoint, "malformed")
    raw = dataplane.channel(decode.endpoint).stream_unary(
        PUSH_KV_METHOD, request_serializer=lambda b: b,
        response_deserializer=pb.PushKVResponse.FromString,
    )  # fmt: skip
    await expect_status(
        raw([b"\x0a\xff\x01garbage"], metadata=((REQUEST_ID_METADATA, "malformed"),)),
        grpc.StatusCode.INVALID_ARGUMENT, "not a KVChunk",
    )  # fmt: skip
    await wait_free(dataplane, decode.endpoint, initial)


async def test_oversized_message(decode, dataplane):
    """A message over the receive limit is refused by gRPC itself (RESOURCE_EXHAUSTED); the
    reservation, known from the stream's metadata, is freed at once (not after the lease)."""
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "huge")
    huge = kv.chunk(0, 0, 8, key=b"\0" * (96 << 20))
    await expect_status(
        push(dataplane, decode.endpoint, [huge], request_id="huge"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    await expect_status(
        generate(dataplane, decode.endpoint, "huge"), PRECONDITION, "without the last chunk"
    )
    await wait_free(dataplane, decode.endpoint, initial)


async def test_second_stream_for_same_request_refused(decode, dataplane):
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "twice")
    gate = asyncio.Event()

    async def slow() -> AsyncIterator[pb.KVChunk]:
        yield kv.chunk(0, 0, 8)
        await gate.wait()
        for c in kv.full()[1:]:
            yield c

    first = asyncio.ensure_future(push(dataplane, decode.endpoint, slow(), request_id="twice"))
    await asyncio.sleep(0.2)
    await expect_status(
        push(dataplane, decode.endpoint, [kv.chunk(1, 0, 8)], request_id="twice"),
        grpc.StatusCode.FAILED_PRECONDITION, "already has an open PushKV stream",
    )  # fmt: skip
    gate.set()
    # the first stream's first chunk covered layer 0 tokens [0, 8); full()[1:] starts at [16..)
    # of layer 0 after the [0,16) chunk is skipped, so tokens 8-15 of layer 0 are missing.
    await expect_status(first, grpc.StatusCode.FAILED_PRECONDITION, "last chunk arrived")
    await wait_free(dataplane, decode.endpoint, initial)


async def test_cancelled_stream_frees_at_once(decode, dataplane):
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "cut")
    sent = asyncio.Event()

    async def half() -> AsyncIterator[pb.KVChunk]:
        for c in kv.full()[:2]:
            yield c
        sent.set()
        await asyncio.Event().wait()  # never finishes: the sender is cut off below

    call = dataplane.decode(decode.endpoint).PushKV(half())
    await sent.wait()
    await asyncio.sleep(0.2)
    call.cancel()
    await expect_status(
        generate(dataplane, decode.endpoint, "cut"), grpc.StatusCode.FAILED_PRECONDITION, "cut"
    )
    await wait_free(dataplane, decode.endpoint, initial)


async def test_lease_expiry_without_any_chunk(leased, dataplane):
    load = await dataplane.load(leased.endpoint)
    initial = load.free_blocks
    res = await dataplane.decode(leased.endpoint).Reserve(
        pb.ReserveRequest(request_id="silent", model=load.model, num_prompt_tokens=PROMPT)
    )
    # The count in the answer is taken with the reservation, so a slow client cannot see it
    # after the lease already gave the blocks back.
    assert res.accepted and res.free_blocks < initial
    await wait_free(dataplane, leased.endpoint, initial)  # the lease ran out
    await expect_status(
        generate(dataplane, leased.endpoint, "silent"), grpc.StatusCode.DEADLINE_EXCEEDED, "lease"
    )


async def test_lease_expiry_of_stalled_stream(leased, dataplane):
    decode = leased
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "stalled")

    async def stall() -> AsyncIterator[pb.KVChunk]:
        yield kv.chunk(0, 0, 8)
        await asyncio.sleep(30 * LEASE_S)  # far past the lease

    await expect_status(
        asyncio.wait_for(push(dataplane, decode.endpoint, stall()), 60),
        grpc.StatusCode.DEADLINE_EXCEEDED, "stalled",
    )  # fmt: skip
    await wait_free(dataplane, decode.endpoint, initial)


async def test_lease_expiry_complete_but_no_generate(leased, dataplane):
    decode = leased
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "orphan")
    await push(dataplane, decode.endpoint, kv.full())
    await wait_free(dataplane, decode.endpoint, initial)
    await expect_status(
        generate(dataplane, decode.endpoint, "orphan"),
        grpc.StatusCode.DEADLINE_EXCEEDED, "no Generate",
    )  # fmt: skip


async def test_abort_frees_reservation(decode, dataplane):
    initial = await free_blocks(dataplane, decode.endpoint)
    await reserve(dataplane, decode.endpoint, "aborted")
    found = await dataplane.decode(decode.endpoint).Abort(pb.AbortRequest(request_id="aborted"))
    assert found.found
    assert await free_blocks(dataplane, decode.endpoint) == initial
    await expect_status(
        generate(dataplane, decode.endpoint, "aborted"), grpc.StatusCode.CANCELLED, "aborted"
    )


async def test_retry_after_failed_transfer_reuses_the_id(decode, dataplane):
    initial = await free_blocks(dataplane, decode.endpoint)
    kv = await reserve(dataplane, decode.endpoint, "retry")
    await expect_status(
        push(dataplane, decode.endpoint, [kv.chunk(0, 0, 8, dtype="float16")]), INVALID, "dtype"
    )
    kv = await reserve(dataplane, decode.endpoint, "retry")  # accepted again
    await push(dataplane, decode.endpoint, kv.full())
    assert len(await generate(dataplane, decode.endpoint, "retry")) == 3
    await wait_free(dataplane, decode.endpoint, initial)
