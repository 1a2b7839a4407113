"""_Answer's choices (n > 1, prompt batches) end together: whatever ends one choice's
generation (an error, or a gRPC call cancelled under it) ends the request, never leaves the
other choices' consumer waiting.

The choices here are scripted, not real workers: the fault (grpc.aio raising CancelledError
from a call whose channel the router closed) needs a worker to leave discovery and its
channel's 120 s grace (RETIRED_CHANNEL_GRACE_S) to run out under a live stream, which a test
cannot wait for. Real processes cover the rest: test_openai_client.py (n choices, hang-ups,
blocks freed) and test_router_failures.py (workers dying mid-stream)."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace
from typing import Any

import pytest
from splitserve_workers.router.app import _Answer
from splitserve_workers.router.flow import FlowError


class FakeRun:
    """A choice whose chunks are `items`, then `end` raised (None: it finishes)."""

    def __init__(self, index: int, items: list[Any], end: BaseException | None = None) -> None:
        self.index = index
        self.items = items
        self.end = end
        self.closed = False
        self.num_tokens = 0
        self.delivered = 0
        self.counts: collections.deque[int] = collections.deque()

    async def chunks(self) -> Any:
        try:
            for item in self.items:
                self.num_tokens += 1
                self.counts.append(self.num_tokens)
                yield item
                await asyncio.sleep(0)
            if self.end is not None:
                raise self.end
            await asyncio.sleep(3600)  # a choice still generating
        finally:
            self.closed = True


def answer(runs: list[FakeRun], n: int) -> _Answer:
    router = SimpleNamespace(options=SimpleNamespace(model_name="m"))
    req = SimpleNamespace(n=n)
    return _Answer(router, req, "cmpl-x", runs)  # type: ignore[arg-type]


async def drain(a: _Answer) -> list[Any]:
    return [item async for item in a._chunks()]


@pytest.mark.parametrize(
    "end",
    [
        # grpc.aio raises CancelledError from a call cancelled locally, e.g. when the router
        # closes the channel of a worker that left discovery (RETIRED_CHANNEL_GRACE_S).
        asyncio.CancelledError(),
        FlowError(502, "decode worker failed mid-stream"),
    ],
    ids=["call-cancelled", "flow-error"],
)
async def test_a_choice_ended_under_the_request_ends_it(end: BaseException) -> None:
    chunk = ("a", None, [])
    runs = [FakeRun(0, [chunk], end), FakeRun(1, [chunk]), FakeRun(2, [chunk])]
    with pytest.raises(FlowError):
        await asyncio.wait_for(drain(answer(runs, 3)), timeout=5)
    await asyncio.sleep(0)
    assert all(run.closed for run in runs)  # every choice aborted on the workers


async def test_a_choice_blocked_on_a_slow_consumer_is_closed_when_the_request_ends() -> None:
    """A choice whose pump waits on the full queue when the request ends still has its
    generation closed (its flow's aborts sent) at once, not when garbage collected."""
    chunk = ("a", None, [])
    runs = [FakeRun(0, [chunk] * 50), FakeRun(1, [chunk] * 50)]
    a = answer(runs, 2)
    gen = a._chunks()
    await anext(gen)
    await asyncio.sleep(0.05)  # both pumps fill the queue and wait on it
    await gen.aclose()
    assert all(run.closed for run in runs)


async def test_a_single_choice_whose_call_is_cancelled_under_it_is_an_error() -> None:
    # n=1 takes the direct path: the same fault is a 502 (an error event once streaming), not
    # a CancelledError that drops the client's connection as if it had hung up.
    runs = [FakeRun(0, [("a", None, [])], asyncio.CancelledError())]
    with pytest.raises(FlowError, match="cancelled"):
        await asyncio.wait_for(drain(answer(runs, 1)), timeout=5)
    assert runs[0].closed
