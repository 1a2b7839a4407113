"""A decode worker ranks Reserve calls by priority on its own, so the rule holds across several
routers: once a waiting interactive reservation (refused everywhere before) has been refused
for lack of blocks, background ones are refused (`behind_interactive`) until interactive
requests stop asking, and the blocks that free up meanwhile go to the interactive request. A
real decode worker process, real gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from splitserve_workers.proto import serving_pb2 as pb

BACKGROUND = pb.PRIORITY_BACKGROUND
INTERACTIVE = pb.PRIORITY_INTERACTIVE


@pytest.fixture
def decode(launch_worker, worker_flags, tiny_model):
    return launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "12"))


async def test_background_reservations_stand_back_for_a_refused_interactive_one(
    decode, dataplane
) -> None:
    load = await dataplane.load(decode.endpoint)
    spec, total = load.model, load.total_blocks
    block = spec.block_size
    stub = dataplane.decode(decode.endpoint)

    async def reserve(
        rid: str, blocks: int, priority: int, waiting: bool = False
    ) -> pb.ReserveResponse:
        return await stub.Reserve(
            pb.ReserveRequest(
                request_id=rid,
                model=spec,
                num_prompt_tokens=blocks * block - 1,  # + the first token: exactly `blocks`
                priority=priority,
                waiting=waiting,
            )
        )

    async def abort(rid: str) -> None:
        await stub.Abort(pb.AbortRequest(request_id=rid))

    # Nothing waits: a background request is served like any other.
    first = await reserve("bg-early", 1, BACKGROUND)
    assert first.accepted, first.reason
    await abort("bg-early")

    held = await reserve("holder", total - 2, BACKGROUND)
    assert held.accepted, held.reason
    # Its first round: another worker may admit it, so nothing is held back yet.
    first_try = await reserve("interactive-big", 3, INTERACTIVE)  # 2 free, 3 needed
    assert not first_try.accepted and first_try.reason == "no_free_blocks"
    passing = await reserve("bg-meanwhile", 1, BACKGROUND)
    assert passing.accepted, passing.reason
    await abort("bg-meanwhile")
    # Refused everywhere, it waits: its next refusal here holds background requests back.
    refused = await reserve("interactive-big", 3, INTERACTIVE, waiting=True)
    assert not refused.accepted and refused.reason == "no_free_blocks"

    # Two blocks are free and a background request needs one, but the interactive request
    # asked first: the background one is turned away, an interactive one is not.
    behind = await reserve("bg-late", 1, BACKGROUND)
    assert not behind.accepted
    assert behind.reason.startswith("behind_interactive"), behind.reason
    assert behind.free_blocks == 2
    small = await reserve("interactive-small", 1, INTERACTIVE)
    assert small.accepted, small.reason
    await abort("interactive-small")

    # The holder ends: the interactive request's retry gets the blocks.
    await abort("holder")
    got = await reserve("interactive-big", 3, INTERACTIVE, waiting=True)
    assert got.accepted, got.reason

    # No interactive request is refused any more: background ones are admitted again once the
    # window lapses (polled, not timed: the worker says when).
    for attempt in range(200):
        again = await reserve(f"bg-retry-{attempt}", 1, BACKGROUND)
        if again.accepted:
            break
        assert again.reason.startswith("behind_interactive"), again.reason
        await asyncio.sleep(0.05)
    assert again.accepted, again.reason
    await abort(f"bg-retry-{attempt}")
    await abort("interactive-big")

    # A request too big for the whole cache is refused outright (the router's 400) and holds
    # nothing back: it can never be served here.
    with pytest.raises(grpc.aio.AioRpcError) as huge:
        await reserve("interactive-huge", total + 1, INTERACTIVE)
    assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = await reserve("bg-after-huge", 1, BACKGROUND)
    assert after.accepted, after.reason
    await abort("bg-after-huge")

    assert (await dataplane.load(decode.endpoint)).free_blocks == total
