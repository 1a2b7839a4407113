"""An abort sent over a channel that has closed meanwhile is dropped quietly."""

from __future__ import annotations

import grpc
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc
from splitserve_workers.router.flow import _abort
from splitserve_workers.router.picking import Worker, WorkerLoad


async def test_an_abort_on_a_closed_channel_is_dropped() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    worker = Worker(WorkerLoad("127.0.0.1:1"), channel, pb_grpc.DecodeServiceStub(channel))
    await channel.close()
    await _abort(worker, "cmpl-x-3", timeout=1.0)  # raised grpc.aio.UsageError
