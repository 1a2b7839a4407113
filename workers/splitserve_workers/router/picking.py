"""Which worker gets the next request. A pure core (`choose`) ranks workers from their last Load
report plus what this router has sent them since; a thin shell (`WorkerPool`) keeps one gRPC
channel per endpoint from discovery.py and polls Load. Prefill goes to the worker that leaves
the pool the least prompt work, counting the prefix each worker likely still caches
(`cache_aware`, from the prompts this router sent it: `PrefixIndex`), so a conversation's next
turn or a shared system prompt lands where its KV already is; decode goes to the most free KV
blocks (admission is block-bound), counting the prompt's blocks a worker holds as free (they are
shared, not allocated, and not transferred again), and to the fewest sequences for the batch
slots when the blocks are not what runs out (`decode_load`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_workers.proto import serving_pb2, serving_pb2_grpc
from splitserve_workers.router.discovery import Discovery

log = logging.getLogger("splitserve.router")

PREFILL_POLICIES = ("cache_aware", "least_queued_tokens", "round_robin", "random")
DECODE_POLICIES = ("cache_aware", "most_free_blocks", "round_robin", "random")
COLOCATED_POLICIES = ("least_loaded", "cache_aware", "most_free_blocks", "round_robin", "random")

# PrefixIndex: block hashes remembered (LRU), an OrderedDict slot plus a small dict each: about
# 300 bytes, 77 MiB at the bound (measured), which covers 4 M prompt tokens at 16-token blocks.
PREFIX_INDEX_ENTRIES = 1 << 18
# Only a prompt's first blocks are hashed (on the event loop): 64 K tokens at 16-token blocks.
PREFIX_INDEX_MAX_BLOCKS = 4096
DEFAULT_BLOCK_SIZE = 16  # until a worker's Load report gives the engine's

# Small messages on router channels: the router never carries KV. Keepalive so a peer that
# vanishes without a TCP reset (node loss) is noticed in seconds, not minutes.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # This gRPC core enforces only the ping timeout (default 1 minute), not keepalive_timeout:
    # without it a frozen worker's stream stalls for 70 s instead of about 15.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# A worker that refuses connections is gone at once; one whose Load answer comes late is busy (a
# long prefill, a loaded node), so only this many late answers in a row take it out of picking.
MAX_LATE_POLLS = 3
# A worker that leaves discovery keeps its channel open this long for the requests that picked
# it before: past the workers' default drain timeout (60 s), which cuts them on its side anyway.
RETIRED_CHANNEL_GRACE_S = 120.0


@dataclass
class WorkerLoad:
    """What the router believes about one worker: its last report adjusted by what this router
    sent it since (so a burst between two polls does not all land on one worker)."""

    endpoint: str
    healthy: bool = False
    draining: bool = False
    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    max_batch_size: int = 0  # sequences per iteration (0: not reported yet)
    # Router-side deltas since the last report.
    pending_tokens: int = 0
    pending_requests: int = 0
    pending_blocks: int = 0
    reports: int = 0  # Load reports taken so far (which report a delta was counted against)
    # Decode: this router's requests that picked the worker and have not started generating
    # there (Reserve in flight, or KV in transfer). A decode worker's report counts them
    # neither running nor waiting, so a report does not reset this (DecodeClaim).
    reserving: int = 0

    def effective_queued_tokens(self) -> int:
        return self.queued_tokens + self.pending_tokens

    def effective_free_blocks(self) -> int:
        return self.free_blocks - self.pending_blocks

    def sequences(self) -> int:
        """Sequences the worker runs, queues or is about to get, as far as this router knows."""
        return self.running + self.waiting + self.reserving + self.pending_requests


def decode_load(w: WorkerLoad, need_blocks: int = 0, held_blocks: int = 0) -> float:
    """The share of a decode (or colocated) worker's scarcer resource in use once this request
    is placed there: its batch slots (sequences over max_batch_size) or its KV blocks (the
    prompt's blocks it holds need none). With a large cache the blocks are never what runs out,
    and ranking by free blocks alone put a whole burst on one worker (24 sequences used 2% of a
    131072-block cache: as free as an idle one); with a small cache, or long sequences, the
    blocks are and it is `most_free_blocks`. The prompt's blocks the worker holds take up to
    one sequence off its count, so a conversation's next turn goes back to the worker holding
    its history unless that worker runs more sequences than another (or has fewer blocks by
    more than the history, when blocks are the constraint). A resource not reported counts 0."""
    held = min(held_blocks, need_blocks) if need_blocks else held_blocks
    share = 0.0
    if w.max_batch_size > 0:
        reuse = held / need_blocks if need_blocks else (1.0 if held else 0.0)
        share = (w.sequences() + 1 - reuse) / w.max_batch_size
    if w.total_blocks > 0:
        used = w.total_blocks - w.effective_free_blocks() + max(need_blocks - held, 0)
        share = max(share, used / w.total_blocks)
    return share


class DecodeClaim:
    """One request's place on the decode worker it picked, counted from the pick on: requests
    arriving together all pick before any reservation returns, and counted only once accepted
    they all saw the same last report and picked the same worker. Blocks (what a reservation
    takes, less what the worker holds of the prompt) count until the worker's Reserve answer
    or next report does; the sequence counts as `reserving` until it starts generating, then
    as pending until a report counts it running, and it comes off when the request ends."""

    def __init__(self, load: WorkerLoad, blocks: int) -> None:
        self.load = load
        self.blocks = max(blocks, 0)
        self.blocks_at = load.reports
        self.generating_at = -1
        self.state = "reserving"  # then "generating"; "released" at the end
        load.pending_blocks += self.blocks
        load.reserving += 1

    def _drop_blocks(self) -> None:
        if self.blocks and self.load.reports == self.blocks_at:  # else a report reset them
            self.load.pending_blocks = max(0, self.load.pending_blocks - self.blocks)
        self.blocks = 0

    def reserved(self, free_blocks: int) -> None:
        """Accepted: the answer's free blocks count this reservation (and those before it)."""
        self._drop_blocks()
        self.load.free_blocks = free_blocks

    def generating(self) -> None:
        """Generate was called: from the worker's next report on it counts as running."""
        if self.state != "reserving":
            return
        self._drop_blocks()
        self.load.reserving = max(0, self.load.reserving - 1)
        self.load.pending_requests += 1
        self.generating_at = self.load.reports
        self.state = "generating"

    def release(self) -> None:
        """Refused, failed, aborted or finished: the request no longer counts there. Safe to
        call more than once."""
        load = self.load
        if self.state == "reserving":
            self._drop_blocks()
            load.reserving = max(0, load.reserving - 1)
        elif self.state == "generating":
            if load.reports == self.generating_at:
                load.pending_requests = max(0, load.pending_requests - 1)
            elif load.running:  # a report since counted it (running, or still waiting)
                load.running -= 1
            else:
                load.waiting = max(0, load.waiting - 1)
        self.state = "released"


@dataclass(frozen=True)
class PromptKey:
    """A prompt as WorkerPool.pick sees it (WorkerPool.prompt_key)."""

    tokens: int
    hashes: list[int] = field(default_factory=list)
    block_size: int = 0  # the block size the hashes are in


class PrefixIndex:
    """Which workers this router sent which prompt prefixes to: chained hashes of a prompt's
    full blocks, each with the endpoints that got a prompt starting with it, least recently
    used forgotten first. A guess about the workers' prefix caches (they evict on their own,
    a restarted worker has none, other routers send them prompts too), so it only ranks
    workers; it never decides correctness."""

    def __init__(
        self, max_entries: int = PREFIX_INDEX_ENTRIES, max_blocks: int = PREFIX_INDEX_MAX_BLOCKS
    ) -> None:
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        # hash -> {endpoint: the endpoint's generation when it was sent the prefix}
        self._holders: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._generation: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def hashes(self, tokens: Sequence[int], block_size: int) -> list[int]:
        """Chained hashes of the leading full blocks (block i's covers blocks 0..i)."""
        out: list[int] = []
        h = 0
        n = min(len(tokens) // block_size, self.max_blocks)
        for i in range(n):
            h = hash((h, *tokens[i * block_size : (i + 1) * block_size]))
            out.append(h)
        return out

    def forget(self, endpoint: str) -> None:
        """The endpoint's cache is gone or unknown (it failed, restarted or left discovery):
        what it was sent before no longer matches (lazily: its entries age out of the LRU)."""
        self._generation[endpoint] = self._generation.get(endpoint, 0) + 1

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """endpoint -> how many leading blocks of this prompt it was sent before."""
        matched: dict[str, int] = {}
        alive: set[str] = set()
        gen = self._generation
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            left = set(holders) if i == 0 else alive.intersection(holders)
            if gen:  # some endpoint was forgotten: its older entries do not count
                left = {e for e in left if holders[e] == gen.get(e, 0)}
            if i:
                # Only the endpoints that drop out are written, not every holder per block.
                for endpoint in alive - left:
                    matched[endpoint] = i
            alive = left
            if not alive:
                return matched
        for endpoint in alive:
            matched[endpoint] = i + 1 if holders else i
        return matched

    def record(self, hashes: Sequence[int], endpoint: str) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            else:
                self._holders.move_to_end(h)
            holders[endpoint] = self._generation.get(endpoint, 0)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)


def choose(
    workers: list[WorkerLoad],
    policy: str,
    exclude: set[str] | frozenset[str] = frozenset(),
    counter: int = 0,
    rng: random.Random | None = None,
    prompt_tokens: int = 0,
    cached_tokens: dict[str, int] | None = None,
    need_blocks: int = 0,
) -> WorkerLoad | None:
    """The worker to use, or None when no healthy, non-draining worker is left. Ties break by
    endpoint name so picking is deterministic. `cache_aware` needs the prompt's length and,
    per endpoint, how many of its tokens that worker likely has cached; the block policies
    take `need_blocks`, the blocks a reservation of the prompt takes (0: unknown), and for
    `most_free_blocks_after_reuse` `cached_tokens` in blocks held."""
    candidates = [w for w in workers if w.healthy and not w.draining and w.endpoint not in exclude]
    if not candidates:
        return None
    candidates.sort(key=lambda w: w.endpoint)
    if policy == "cache_aware":
        cached = cached_tokens or {}
        best = max((cached.get(w.endpoint, 0) for w in candidates), default=0)
        # The pool's work this choice leaves: the queue this prompt waits behind, its uncached
        # part, and what a worker without the cached prefix recomputes for everyone queued
        # after it (best - cached). Counting only this request's wait (no third term) sent a
        # conversation away whenever its worker was briefly busier: the pool recomputed the
        # history and every later request waited for that. Without cache hits it ranks by
        # queued tokens; ties (every queue empty: most picks at light load) go to the worker
        # with the fewest sequences, then the most free blocks, like least_loaded, not to the
        # first endpoint by name (a colocated pool ran every conversation on one worker).
        return min(
            candidates,
            key=lambda w: (
                w.effective_queued_tokens()
                + prompt_tokens
                - cached.get(w.endpoint, 0)
                + best
                - cached.get(w.endpoint, 0),
                w.running + w.waiting + w.pending_requests,
                -w.effective_free_blocks(),
            ),
        )
    if policy == "least_queued_tokens":
        return min(candidates, key=lambda w: (w.effective_queued_tokens(), w.pending_requests))
    if policy in ("most_free_blocks", "most_free_blocks_after_reuse"):
        # The least loaded by its scarcer resource, batch slots or KV blocks (decode_load),
        # then the most free blocks, then the fewest sequences. `_after_reuse` is decode's
        # cache_aware (WorkerPool.pick): the blocks of the prompt a worker holds need no new
        # ones (and their KV no transfer). Without hits, most_free_blocks.
        held = (cached_tokens or {}) if policy == "most_free_blocks_after_reuse" else {}
        return min(
            candidates,
            key=lambda w: (
                decode_load(w, need_blocks, held.get(w.endpoint, 0)),
                -(w.effective_free_blocks() + held.get(w.endpoint, 0)),
                w.sequences(),
            ),
        )
    if policy == "least_loaded":
        return min(
            candidates,
            key=lambda w: (
                w.effective_queued_tokens(),
                w.running + w.waiting + w.pending_requests,
                -w.effective_free_blocks(),
            ),
        )
    if policy == "round_robin":
        return candidates[counter % len(candidates)]
    if policy == "random":
        return (rng or random).choice(candidates)
    raise ValueError(f"unknown picking policy {policy!r}")


@dataclass
class Worker:
    load: WorkerLoad
    channel: grpc.aio.Channel
    stub: Any  # the role's service stub
    model: serving_pb2.ModelSpec = field(default_factory=serving_pb2.ModelSpec)
    last_report: float = 0.0
    late_polls: int = 0  # Load polls in a row that ran past their deadline
    # Why it is out of picking (its last failed Load poll or call), until a poll succeeds.
    last_error: str = ""
    last_error_at: float = 0.0


_STUBS = {
    "prefill": serving_pb2_grpc.PrefillServiceStub,
    "decode": serving_pb2_grpc.DecodeServiceStub,
    "colocated": serving_pb2_grpc.ColocatedServiceStub,
}


class WorkerPool:
    """One role's workers: discovery refresh, Load polling, picking."""

    def __init__(
        self,
        role: str,
        discovery: Discovery,
        policy: str,
        poll_interval: float = 0.5,
        load_timeout: float = 2.0,
    ) -> None:
        allowed = {
            "prefill": PREFILL_POLICIES,
            "decode": DECODE_POLICIES,
            "colocated": COLOCATED_POLICIES,
        }[role]
        if policy not in allowed:
            raise ValueError(f"{role} policy {policy!r} is not one of {', '.join(allowed)}")
        self.role = role
        self.policy = policy
        self._discovery = discovery
        self._poll_interval = poll_interval
        self._load_timeout = load_timeout
        self.workers: dict[str, Worker] = {}
        self._counter = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self.prefixes = PrefixIndex()
        # Interactive requests this router has found the (decode) pool full for and that are
        # still looking: background ones leave the blocks that free up to them (flow.py).
        self.interactive_waiting = 0

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll_loop(), name=f"poll-{self.role}")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for worker in self.workers.values():
            await worker.channel.close()
        self.workers.clear()
        for task, channel in list(self._retiring.items()):
            task.cancel()
            await channel.close()  # no grace left: the router is stopping

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            try:
                await self.refresh()
            except Exception:  # never let one bad poll stop picking
                log.exception("polling %s workers failed", self.role)

    async def refresh(self) -> None:
        endpoints = set(await self._discovery.endpoints(self.role))
        for gone in set(self.workers) - endpoints:
            # Gone from discovery is not dead: a draining worker leaves DNS (or the workers
            # file) while it finishes its streams, and a request that picked it just before
            # may not have called it yet. Closing the channel (even with a grace) would fail
            # both, so it stays open, out of picking, for the grace, and closes after.
            worker = self.workers.pop(gone)
            self.prefixes.forget(gone)  # back later (a restart) with an empty cache
            worker.load.draining = True  # a request holding it swaps it where it can
            task = asyncio.create_task(self._close_later(worker.channel))
            self._retiring[task] = worker.channel
            task.add_done_callback(lambda t: self._retiring.pop(t, None))
        for endpoint in endpoints - set(self.workers):
            channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            self.workers[endpoint] = Worker(
                WorkerLoad(endpoint), channel, _STUBS[self.role](channel)
            )
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))
        self._changed.set()
        self._changed = asyncio.Event()

    @staticmethod
    async def _close_later(channel: grpc.aio.Channel) -> None:
        await asyncio.sleep(RETIRED_CHANNEL_GRACE_S)
        await channel.close()

    async def _poll(self, worker: Worker) -> None:
        try:
            report = await worker.stub.Load(serving_pb2.LoadRequest(), timeout=self._load_timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                worker.late_polls += 1
                if worker.late_polls < MAX_LATE_POLLS:
                    return  # busy, not dead: keep the last report until it answers again
            if worker.load.healthy:
                self.prefixes.forget(worker.load.endpoint)  # may come back restarted
            worker.load.healthy = False
            worker.last_error = f"{e.code().name}: {e.details() or ''}".strip()
            worker.last_error_at = time.monotonic()
            return
        worker.late_polls = 0
        worker.last_error = ""
        load = worker.load
        load.healthy = True
        load.draining = report.draining
        load.queued_tokens = report.queued_tokens
        load.running = report.running
        load.waiting = report.waiting
        load.free_blocks = report.free_blocks
        load.total_blocks = report.total_blocks
        load.max_batch_size = report.max_batch_size
        # The report now includes what this router sent before the poll started (but for
        # `reserving`: reservations are in no report's running or waiting).
        load.pending_tokens = load.pending_requests = load.pending_blocks = 0
        load.reports += 1
        worker.model = report.model
        worker.last_report = time.monotonic()

    def prompt_key(self, prompt: Sequence[int], known: PromptKey | None = None) -> PromptKey:
        """What cache_aware picks by: the prompt's length and its block hashes (none for the
        other policies). Hashed once per request, not at every pick and again when sent;
        `known`, the same prompt's key from another pool, is reused when hashed in this pool's
        block size (prefill and decode workers usually share it)."""
        if self.policy != "cache_aware" or not prompt:
            return PromptKey(len(prompt))
        block = self.block_size()
        if known is not None and known.hashes and known.block_size == block:
            return known
        return PromptKey(len(prompt), self.prefixes.hashes(prompt, block), block)

    def pick(
        self, exclude: set[str] | frozenset[str] = frozenset(), prompt: PromptKey | None = None
    ) -> Worker | None:
        """The worker for a request; with `cache_aware`, `prompt` (prompt_key) ranks workers by
        what they likely cache. Nothing is recorded until `sent`."""
        return self.pick_cached(exclude, prompt)[0]

    def pick_cached(
        self, exclude: set[str] | frozenset[str] = frozenset(), prompt: PromptKey | None = None
    ) -> tuple[Worker | None, int]:
        """`pick`, and how many of the prompt's tokens the picked worker likely caches (0
        unless `cache_aware`): what it will not compute, so what the pick queues there is the
        rest. One walk of the prefix index for both."""
        self._counter += 1
        loads = [w.load for w in self.workers.values()]
        block = self.block_size()
        # What a reservation of the prompt takes: its tokens and the first generated one.
        need = -(-(prompt.tokens + 1) // block) if prompt is not None and prompt.tokens else 0
        if self.policy != "cache_aware" or prompt is None:
            load = choose(loads, self.policy, exclude, self._counter, need_blocks=need)
            return (None if load is None else self.workers[load.endpoint]), 0
        matched = self.prefixes.matched_blocks(prompt.hashes)
        if self.role == "decode":
            load = choose(
                loads,
                "most_free_blocks_after_reuse",
                exclude,
                self._counter,
                None,
                0,
                matched,
                need_blocks=need,
            )
        else:
            cached = {e: n * block for e, n in matched.items()}
            load = choose(loads, self.policy, exclude, self._counter, None, prompt.tokens, cached)
        if load is None:
            return None, 0
        return self.workers[load.endpoint], matched.get(load.endpoint, 0) * block

    def likely_cached(self, worker: Worker, prompt: PromptKey) -> int:
        """Tokens of the prompt that `worker` likely holds in its prefix cache (0 unless
        `cache_aware`)."""
        if not prompt.hashes:
            return 0
        blocks = self.prefixes.matched_blocks(prompt.hashes).get(worker.load.endpoint, 0)
        return min(blocks * self.block_size(), prompt.tokens)

    def sent(self, worker: Worker, prompt: PromptKey) -> None:
        """The prompt was sent to `worker` (what `cache_aware` routes the next ones by)."""
        if prompt.hashes:
            self.prefixes.record(prompt.hashes, worker.load.endpoint)

    def block_size(self) -> int:
        """The workers' KV block size (their engines hash prompts in such blocks)."""
        for worker in self.workers.values():
            if worker.model.block_size:
                return int(worker.model.block_size)
        return DEFAULT_BLOCK_SIZE

    def mark_failed(self, endpoint: str, reason: str = "") -> None:
        """A call to this worker failed: stop picking it until a Load poll succeeds again."""
        worker = self.workers.get(endpoint)
        if worker is not None:
            worker.load.healthy = False
            self.prefixes.forget(endpoint)
            if reason:
                worker.last_error, worker.last_error_at = reason, time.monotonic()

    def last_failure(self) -> str:
        """The most recent failure of a worker still out of picking, as "endpoint: why" (its
        Load poll refused, say), or "" when none is known: what a request that finds no worker
        to pick tells its client."""
        failed = [w for w in self.workers.values() if not w.load.healthy and w.last_error]
        if not failed:
            return ""
        worker = max(failed, key=lambda w: w.last_error_at)
        return f"{worker.load.endpoint}: {worker.last_error}"

    async def wait_for_change(self, timeout: float) -> None:
        """Sleeps until the next poll lands (or `timeout`), for callers waiting for capacity."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def ready(self) -> bool:
        return any(w.load.healthy and not w.load.draining for w in self.workers.values())

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "endpoint": w.load.endpoint,
                "healthy": w.load.healthy,
                "draining": w.load.draining,
                "queued_tokens": w.load.effective_queued_tokens(),
                "free_blocks": w.load.effective_free_blocks(),
                "total_blocks": w.load.total_blocks,
                "running": w.load.running,
                "waiting": w.load.waiting,
                "pending_requests": w.load.pending_requests,
                "reserving": w.load.reserving,
                "max_batch_size": w.load.max_batch_size,
            }
            for w in sorted(self.workers.values(), key=lambda w: w.load.endpoint)
        ]
