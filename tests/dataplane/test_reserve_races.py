"""A Reserve that loses its caller while the engine allocates: the decode worker's real
DecodeRole on a real gRPC server with a real engine, and every block comes back.

The race itself (the RPC cancelled, or an Abort arriving, in the microseconds engine.reserve
runs on its thread) cannot be hit on purpose between processes, so this is the one place the
engine is wrapped: its reserve waits on a gate until the test has cancelled or aborted. The
allocation itself is the engine's own."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from splitserve_workers.decode_worker import DecodeRole
from splitserve_workers.engine import EngineConfig, LLMEngine
from splitserve_workers.kv_transfer import model_spec
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc

WAIT_S = 60.0  # a bound on waiting for the blocks: a leak fails, a busy machine does not


class GatedServer:
    def __init__(self, model: Path) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=64))
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.returned = threading.Event()
        self.rejected: list[str] = []
        real_reserve = self.engine.reserve

        def gated_reserve(request_id: str, n: int, *args: Any) -> bool:
            self.entered.set()
            self.gate.wait(WAIT_S)
            try:
                return real_reserve(request_id, n, *args)
            finally:
                self.returned.set()

        self.engine.reserve = gated_reserve  # type: ignore[method-assign]

    async def start(self) -> pb_grpc.DecodeServiceStub:
        engine = self.engine

        async def not_draining(context: Any) -> None:
            return None

        worker = SimpleNamespace(
            engine=engine,
            loop=SimpleNamespace(wake=lambda: None, abort=engine.abort),
            settings=SimpleNamespace(lease_s=600.0),  # no lease runs out in these tests
            metrics=SimpleNamespace(rejected=self.rejected.append),
            spec=model_spec(engine, "tiny", engine.block_size),
            refuse_if_draining=not_draining,
        )
        self.role = DecodeRole(worker)  # type: ignore[arg-type]
        self.handler_cancelled = asyncio.Event()
        reserve = self.role.Reserve

        async def watched(request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
            try:
                return await reserve(request, context)
            except asyncio.CancelledError:
                self.handler_cancelled.set()
                raise

        self.role.Reserve = watched  # type: ignore[method-assign]
        self.server = grpc.aio.server()
        self.role.register(self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return pb_grpc.DecodeServiceStub(self.channel)

    def request(self, request_id: str) -> pb.ReserveRequest:
        return pb.ReserveRequest(
            request_id=request_id, model=self.role.w.spec, num_prompt_tokens=40
        )

    async def entered_reserve(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, WAIT_S)
        assert self.entered.is_set()

    async def wait_free(self, expected: int) -> None:
        """After the engine's reserve has returned: its blocks come back."""
        await asyncio.get_running_loop().run_in_executor(None, self.returned.wait, WAIT_S)
        assert self.returned.is_set()
        deadline = time.monotonic() + WAIT_S
        while self.engine.stats().free_blocks != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert self.engine.stats().free_blocks == expected

    async def stop(self) -> None:
        self.gate.set()
        await self.channel.close()
        await self.role.close()
        await self.server.stop(None)


@pytest.fixture
async def gated(tiny_model: Path):
    server = GatedServer(tiny_model)
    yield server
    await server.stop()


async def test_a_cancelled_reserve_frees_what_the_engine_allocated(gated: GatedServer) -> None:
    stub = await gated.start()
    initial = gated.engine.stats().free_blocks
    call = stub.Reserve(gated.request("gone"))
    await gated.entered_reserve()
    call.cancel()  # the router's client left (or its deadline passed) mid-allocation
    await asyncio.wait_for(gated.handler_cancelled.wait(), WAIT_S)
    gated.gate.set()  # now the engine allocates, for a caller that is gone
    await gated.wait_free(initial)
    assert "gone" not in gated.role.reservations and not gated.role._reserving
    assert gated.engine.stats().free_blocks == initial
    # The id is usable again, and a normal Reserve is unaffected.
    resp = await stub.Reserve(gated.request("gone"))
    assert resp.accepted and gated.engine.stats().free_blocks < initial


async def test_an_abort_during_the_allocation_wins(gated: GatedServer) -> None:
    stub = await gated.start()
    initial = gated.engine.stats().free_blocks
    call = stub.Reserve(gated.request("aborted"))
    await gated.entered_reserve()
    found = await stub.Abort(pb.AbortRequest(request_id="aborted"))
    assert found.found  # the worker knows the id, though the engine has not allocated yet
    gated.gate.set()
    resp = await call
    assert not resp.accepted and "aborted" in resp.reason
    assert gated.rejected == ["aborted"]
    assert gated.engine.stats().free_blocks == initial
    assert "aborted" not in gated.role.reservations and not gated.role._reserving


async def test_an_abort_of_an_accepted_reservation_is_not_a_rejection(gated: GatedServer) -> None:
    # The router aborts a reservation whenever the first token is the last (max_tokens 1, a
    # stop string or EOS at once) or the client leaves before decoding starts: routine, not a
    # call the worker refused, so requests_rejected_total does not count it.
    stub = await gated.start()
    initial = gated.engine.stats().free_blocks
    gated.gate.set()
    resp = await stub.Reserve(gated.request("done-at-once"))
    assert resp.accepted
    found = await stub.Abort(pb.AbortRequest(request_id="done-at-once"))
    assert found.found
    assert gated.engine.stats().free_blocks == initial
    assert gated.rejected == []
