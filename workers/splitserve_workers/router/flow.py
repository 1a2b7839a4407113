"""Drives one request through the workers and yields its tokens: pick a prefill worker, reserve
KV blocks for its KV on a decode worker, prefill (the prefill worker streams the KV straight to
that decode worker), then stream the decode worker's tokens. Retries a prefill that fails before
the transfer is done on another worker, turns a dead decode stream into an error at once, and
aborts on both pools when the caller stops early (client gone, stop string). A colocated pool is
one Complete call."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_workers.proto import serving_pb2
from splitserve_workers.protocol import kv_transfer_failed_to
from splitserve_workers.router.picking import (
    DecodeClaim,
    PromptKey,
    Worker,
    WorkerLoad,
    WorkerPool,
)

log = logging.getLogger("splitserve.router")


def _grammar_refused(e: BaseException, param: str | None) -> FlowError | None:
    """A worker refusing the request's grammar (INVALID_ARGUMENT "grammar: ..."): a limit of
    the grammar engine the router's check does not reach (a schema of a thousand optional
    properties, say). Every worker would refuse it, so it is the client's 400, not a retry,
    naming `param`, the request field the grammar came from."""
    if not (isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT):
        return None
    details = e.details() or ""
    if not details.startswith(("grammar:", "sampling.grammar:")):
        return None
    why = details.split(":", 1)[1].strip()
    what = f"'{param}'" if param else "the output constraint"
    return FlowError(400, f"{what} cannot be used: {why}", code="invalid_value", param=param)


def _refused(e: BaseException) -> bool:
    """A worker refusing the request itself (INVALID_ARGUMENT: a prompt over its context limit
    or its whole KV cache, say): asking it again gives the same answer, and it is no sign of a
    broken worker."""
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT


class FlowError(Exception):
    """The request cannot be served; `status` is the HTTP status the edge answers with."""

    def __init__(
        self, status: int, message: str, code: str = "upstream_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param  # the request field to change, when one is to blame


@dataclass
class TokenChunk:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # When the request asked for them, one entry per token id: its logprob, and the most
    # likely (token id, logprob) pairs at that step.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # On the first chunk when the prompt's logprobs were asked: per prompt token after the
    # first, its logprob and the most likely alternatives.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class FlowStats:
    """Where the time to first token went (the stage split no single engine can see)."""

    decode_admission_seconds: float | None = None
    prefill_queue_seconds: float | None = None
    prefill_compute_seconds: float | None = None
    kv_transfer_seconds: float | None = None
    kv_transfer_exposed_seconds: float | None = None
    kv_transfer_bytes: int = 0
    num_cached_tokens: int = 0
    # Prompt tokens whose KV the decode worker held already (its prefix cache): not transferred.
    decode_cached_tokens: int = 0
    prefill_attempts: int = 0
    prefill_endpoint: str = ""
    decode_endpoint: str = ""


@dataclass
class FlowSettings:
    max_prefill_attempts: int = 3
    admission_timeout_seconds: float = 30.0  # waiting for a decode worker with free blocks
    # Waiting for any worker of a pool that has none (one at zero replicas waking up, or every
    # worker restarting); None: the admission timeout.
    empty_pool_wait_seconds: float | None = None
    # Reserve sends the prompt, so the decode worker skips the KV its prefix cache holds.
    decode_kv_reuse: bool = True

    @property
    def empty_pool_wait(self) -> float:
        if self.empty_pool_wait_seconds is None:
            return self.admission_timeout_seconds
        return self.empty_pool_wait_seconds

    rpc_timeout_seconds: float = 5.0  # Reserve / Abort
    abort_timeout_seconds: float = 2.0


@dataclass
class FlowRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: serving_pb2.SamplingParams
    priority: serving_pb2.Priority
    eos_token_ids: list[int] = field(default_factory=list)
    # False when the client left max_tokens out and it runs to the context limit: a worker
    # whose cache is smaller than that limit then ends it with finish_reason "length".
    max_tokens_explicit: bool = True
    max_tokens_param: str = "max_tokens"  # or max_completion_tokens: the field errors name
    grammar_param: str | None = None  # the request field sampling.grammar came from

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    def kv_tokens_needed(self) -> int:
        """KV slots the request occupies on one worker at its longest: the prompt plus every
        generated token but the last (whose KV is never computed); at least prompt + 1, which
        admission needs anyway. Only an explicit max_tokens counts."""
        generated = max(self.max_tokens - 1, 1) if self.max_tokens_explicit else 1
        return len(self.prompt_token_ids) + generated

    def too_big_for(self, worker: Worker) -> tuple[str, str | None] | None:
        """(why, request field to lower) when `worker`'s whole KV cache can never hold this
        request, from its last Load report; None when it can (or no report has arrived)."""
        block = worker.model.block_size or 0
        total = worker.load.total_blocks
        if not block or not total:
            return None
        need = math.ceil(self.kv_tokens_needed() / block)
        if need <= total:
            return None
        prompt = len(self.prompt_token_ids)
        blame_max_tokens = self.max_tokens_explicit and math.ceil((prompt + 1) / block) <= total
        what = f"the prompt ({prompt} tokens)"
        if blame_max_tokens:
            what += f" plus {self.max_tokens_param} ({self.max_tokens})"
        why = (
            f"{what} needs {need} KV blocks of {block} tokens; {worker.load.endpoint} has "
            f"{total} in all"
        )
        return why, self.max_tokens_param if blame_max_tokens else None


_background: set[asyncio.Task[Any]] = set()


def _prefilled(
    load: WorkerLoad, sent_at_report: int, claimed: int, uncached: int, requests: int = 0
) -> None:
    """A prompt this router sent to the worker has been computed: it is no longer queued there,
    whether it was still a router-side delta (`claimed` tokens) or a report taken since counted
    it. (Left counted until the next poll, a worker that just served a burst looked busy for up
    to a poll interval after, and cache_aware routing sent a conversation's next turn away from
    the worker that caches it.) A report counts an admitted prompt without its cached prefix
    (num_tokens - num_computed_tokens): only that `uncached` part comes off it, or the tokens of
    requests queued behind this one would vanish too."""
    if load.reports == sent_at_report:
        load.pending_tokens = max(0, load.pending_tokens - claimed)
        load.pending_requests = max(0, load.pending_requests - requests)
    else:
        load.queued_tokens = max(0, load.queued_tokens - max(0, uncached))


def _claim(load: WorkerLoad, tokens: int) -> int:
    """Counts a prompt's tokens to compute (those the worker likely does not cache) as queued
    on the worker until its report does; returns the report count it was claimed at. (Counting
    the whole prompt, n copies of one prompt started together looked like n whole prompts
    queued where the first is cached, and the last copies went to another worker.)"""
    load.pending_tokens += tokens
    load.pending_requests += 1
    return load.reports


def _unclaim(load: WorkerLoad, tokens: int, claimed_at: int) -> None:
    """A claimed prompt will not be sent there after all (a report since then reset it)."""
    if load.reports == claimed_at:
        load.pending_tokens = max(0, load.pending_tokens - tokens)
        load.pending_requests = max(0, load.pending_requests - 1)


def _spawn(coro: Any) -> None:
    """Fire-and-forget that survives the caller's cancellation (aborts must still be sent)."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


# An Abort that times out is sent again until the worker answers or refuses, for up to the
# workers' default reservation lease: a worker that froze (a long GC or swap pause, a stopped
# process) while a request's KV was on its way may still complete that reservation when it
# resumes, and without the Abort it then holds those blocks until the lease ends (measured: 111
# blocks for 30 s after a 16 s freeze). A dead worker's restart holds nothing: no retry then.
ABORT_RETRY_WINDOW_S = 30.0
ABORT_RETRY_PAUSE_S = 1.0
_aborts_closing = False


async def finish_aborts() -> None:
    """Waits for the aborts sent so far (each bounded by its own timeout; no more retries)."""
    global _aborts_closing
    _aborts_closing = True
    try:
        if _background:
            await asyncio.wait(list(_background))
    finally:
        _aborts_closing = False  # a router started later in this process retries again


async def _abort(worker: Worker, request_id: str, timeout: float, routine: bool = False) -> None:
    give_up = time.monotonic() + ABORT_RETRY_WINDOW_S
    while True:
        try:
            await worker.stub.Abort(
                serving_pb2.AbortRequest(request_id=request_id, routine=routine), timeout=timeout
            )
            return
        except grpc.aio.AioRpcError as e:
            log.debug("abort %s on %s: %s", request_id, worker.load.endpoint, e.code())
            if (
                e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                or _aborts_closing
                or time.monotonic() + ABORT_RETRY_PAUSE_S >= give_up
            ):
                return
        except grpc.aio.UsageError:
            # The worker's channel closed meanwhile (it left discovery and its grace ran out, or
            # the router is stopping): its calls ended with it. Unhandled, each of a request's
            # choices logged "Task exception was never retrieved" with a traceback.
            log.debug("abort %s on %s: channel closed", request_id, worker.load.endpoint)
            return
        await asyncio.sleep(ABORT_RETRY_PAUSE_S)


def _rpc_reason(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name}: {e.details() or ''}".strip()


class Flow:
    """One request's path through the pools. Iterate `tokens()`; close it early to abort."""

    def __init__(
        self,
        req: FlowRequest,
        settings: FlowSettings,
        *,
        prefill: WorkerPool | None = None,
        decode: WorkerPool | None = None,
        colocated: WorkerPool | None = None,
    ) -> None:
        self.req = req
        self.settings = settings
        self.prefill = prefill
        self.decode = decode
        self.colocated = colocated
        self.stats = FlowStats()
        self._sent = 0  # tokens yielded
        self._decode_claim: DecodeClaim | None = None  # the reservation's place on its worker
        self._counted_waiting = False  # in self.decode.interactive_waiting

    def tokens(self) -> AsyncIterator[TokenChunk]:
        if self.colocated is not None:
            return self._colocated()
        return self._disaggregated()

    # ---- stop conditions the router enforces itself --------------------------------------

    def _finish_reason_at(self, token_id: int) -> str | None:
        sampling = self.req.sampling
        if not sampling.ignore_eos and token_id in self.req.eos_token_ids:
            return "stop"
        if token_id in sampling.stop_token_ids:
            return "stop"
        if self._sent >= self.req.max_tokens:
            return "length"
        return None

    def _chunk(self, event: serving_pb2.TokenEvent) -> TokenChunk:
        """Clips a worker's event to max_tokens / stop ids, so a worker that over-generates
        cannot make the router over-answer."""
        chunk = TokenChunk([])
        if event.HasField("prompt_logprobs"):
            p = event.prompt_logprobs
            tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in p.top_logprobs]
            chunk.prompt_logprobs = [
                (value, tops[i] if i < len(tops) else []) for i, value in enumerate(p.logprobs)
            ]
        for i, token_id in enumerate(event.token_ids):
            chunk.token_ids.append(token_id)
            if i < len(event.logprobs):
                chunk.logprobs.append(event.logprobs[i])
            if i < len(event.top_logprobs):
                top = event.top_logprobs[i]
                chunk.top_logprobs.append(list(zip(top.token_ids, top.logprobs, strict=True)))
            self._sent += 1
            reason = self._finish_reason_at(token_id)
            if (
                reason == "length"
                and event.finished
                and event.finish_reason == "stop"
                and i == len(event.token_ids) - 1
            ):
                reason = "stop"  # the worker stopped on this very token (a grammar completed)
            if reason is not None:
                chunk.finished, chunk.finish_reason = True, reason
                return chunk
        if event.finished:
            reason = event.finish_reason or "stop"
            if reason in ("error", "abort"):
                raise FlowError(502, f"worker ended the request with {reason!r}")
            chunk.finished, chunk.finish_reason = True, reason
        return chunk

    def _first_event(self, first: serving_pb2.FirstToken) -> serving_pb2.TokenEvent:
        """The prefill worker's first token as a token event (with its logprobs if asked)."""
        event = serving_pb2.TokenEvent(token_ids=[first.token_id])
        if self.req.sampling.logprobs or self.req.sampling.top_logprobs:
            event.logprobs.append(first.logprob)
        if self.req.sampling.top_logprobs:
            event.top_logprobs.append(first.top_logprobs)
        if first.HasField("prompt_logprobs"):
            event.prompt_logprobs.CopyFrom(first.prompt_logprobs)
        return event

    # ---- disaggregated -----------------------------------------------------------------

    def _too_large(
        self,
        kind: str,
        pool: WorkerPool,
        too_small: dict[str, tuple[str, str | None]],
        asked: set[str],
        fallback: str,
    ) -> FlowError | None:
        """The 400 for a request no worker of `pool` can ever hold. It quotes the largest
        worker in `too_small` (endpoint -> (why, field to lower)): with workers of several
        sizes, what it names must fit the one that comes closest. None when a worker not asked
        this round (unhealthy or draining just now) reported a cache that could hold it: a
        restart or rollout may bring it back, so the answer is "busy" (wait, then 503)."""
        if any(
            endpoint not in asked and w.load.total_blocks and self.req.too_big_for(w) is None
            for endpoint, w in pool.workers.items()
        ):
            return None
        why, param = fallback, None
        if too_small:
            largest = max(
                too_small, key=lambda e: w.load.total_blocks if (w := pool.workers.get(e)) else 0
            )
            why, param = too_small[largest]
        return FlowError(
            400,
            f"no {kind} worker can hold this request ({why})",
            code="request_too_large_for_workers",
            param=param,
        )

    async def _wait_for_workers(
        self, pool: WorkerPool, role: str, until: float | None, last_error: str = ""
    ) -> float:
        """A pool with no worker to pick: wait for its next change. `until`: this wait's
        deadline (None: the first time, which starts it); returns it. The 503 at the deadline
        names `last_error`, this request's last failure, or else the last one the pool knows
        of a worker still out (a refused Load poll: a new request behind a dead worker)."""
        now = time.monotonic()
        if until is None:
            until = now + self.settings.empty_pool_wait
        if until - now <= 0:
            last_error = last_error or pool.last_failure()
            why = f" (last failure: {last_error})" if last_error else ""
            raise FlowError(
                503,
                f"no {role} worker became available within {self.settings.empty_pool_wait:g}s{why}",
                code="no_capacity",
            )
        await pool.wait_for_change(min(until - now, 1.0))
        return until

    async def _reserve(
        self,
        worker_rid: str,
        source: serving_pb2.ModelSpec,
        key: PromptKey,
        before_first_token: bool = True,
    ) -> Worker:
        """_reserve_rounds, and this request no longer counted among the interactive ones
        waiting for decode blocks once it has its reservation or fails."""
        try:
            return await self._reserve_rounds(worker_rid, source, key, before_first_token)
        finally:
            if self._counted_waiting:
                self.decode.interactive_waiting -= 1  # type: ignore[union-attr]
                self._counted_waiting = False

    async def _reserve_rounds(
        self,
        worker_rid: str,
        source: serving_pb2.ModelSpec,
        key: PromptKey,
        before_first_token: bool,
    ) -> Worker:
        """A decode worker holding blocks for the prompt; `source` is the ModelSpec of the
        prefill worker whose KV it will receive (the decode side checks compatibility).
        `before_first_token`: the wait is part of the time to first token (the stage split's
        decode admission); a retry's after the first token went out is not."""
        assert self.decode is not None
        start = time.monotonic()
        deadline = start + self.settings.admission_timeout_seconds
        empty_until: float | None = None
        last_reason = "no decode workers"
        background = self.req.priority == serving_pb2.PRIORITY_BACKGROUND
        while True:
            if background and self.decode.interactive_waiting > 0:
                # An interactive request waits for blocks: those that free up go to it
                # first. (The decode workers that refused it refuse background Reserves too,
                # for every router; not asking saves the calls.)
                why = "a background request, behind interactive ones waiting for blocks"
                remaining = self._admission_left(deadline, why)
                await self.decode.wait_for_change(min(remaining, 1.0))
                continue
            tried: set[str] = set()
            # Refusals that waiting cannot fix: a model mismatch, or a request this worker can
            # never hold (too long for its cache or its context limit).
            incompatible = too_big = 0
            too_small: dict[str, tuple[str, str | None]] = {}  # endpoint -> (why, field)
            while True:
                worker, held = self.decode.pick_cached(tried, key)
                if worker is None:
                    break
                tried.add(worker.load.endpoint)
                if (refusal := self.req.too_big_for(worker)) is not None:
                    too_small[worker.load.endpoint] = refusal
                    last_reason = refusal[0]
                    too_big += 1
                    continue
                # Claimed now, before the reservation's await, as the prefill pick is: the
                # requests of a burst all pick before any Reserve returns, and unclaimed they
                # all went to one decode worker.
                block = self.decode.block_size()  # the one `held` is counted in
                need = -(-(len(self.req.prompt_token_ids) + 1) // block)
                claim = DecodeClaim(worker.load, need - min(held // block, need - 1))
                try:
                    resp = await worker.stub.Reserve(
                        serving_pb2.ReserveRequest(
                            request_id=worker_rid,
                            model=source,
                            num_prompt_tokens=len(self.req.prompt_token_ids),
                            max_tokens=self.req.max_tokens,
                            priority=self.req.priority,
                            waiting=self._counted_waiting,
                            # The worker looks the prompt up in its prefix cache: what it
                            # holds (earlier turns it generated) need not travel.
                            prompt_token_ids=(
                                self.req.prompt_token_ids if self.settings.decode_kv_reuse else ()
                            ),
                        ),
                        timeout=self.settings.rpc_timeout_seconds,
                    )
                except asyncio.CancelledError:
                    # The client left while the call was out: it may have reserved anyway.
                    claim.release()
                    _spawn(_abort(worker, worker_rid, self.settings.abort_timeout_seconds))
                    raise
                except grpc.aio.AioRpcError as e:
                    claim.release()
                    last_reason = f"{worker.load.endpoint}: {_rpc_reason(e)}"
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        too_big += 1
                    elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        # Busy, not dead (Load polls judge health), and the reservation may
                        # have landed after all: give its blocks back now, not at lease end.
                        _spawn(_abort(worker, worker_rid, self.settings.abort_timeout_seconds))
                    else:
                        self.decode.mark_failed(worker.load.endpoint, _rpc_reason(e))
                    continue
                except BaseException:
                    claim.release()
                    raise
                if resp.accepted:
                    claim.reserved(resp.free_blocks)
                    self._decode_claim = claim
                    if before_first_token:
                        # Every reservation the first token waited for counts (a retry's too).
                        waited = time.monotonic() - start
                        self.stats.decode_admission_seconds = (
                            self.stats.decode_admission_seconds or 0.0
                        ) + waited
                    self.stats.decode_endpoint = worker.load.endpoint
                    self.stats.decode_cached_tokens = resp.num_cached_tokens
                    self.decode.sent(worker, key)  # it holds the prompt's blocks from now on
                    return worker
                claim.release()
                last_reason = f"{worker.load.endpoint}: {resp.reason}"
                worker.load.free_blocks = resp.free_blocks
                if resp.reason == "draining":
                    worker.load.draining = True
                elif resp.reason.startswith("incompatible"):
                    incompatible += 1
            if tried and too_big and incompatible + too_big == len(tried):
                error = self._too_large("decode", self.decode, too_small, tried, last_reason)
                if error is not None:
                    raise error
            if tried and incompatible == len(tried):
                raise FlowError(
                    502,
                    f"no decode worker can take this prefill worker's KV ({last_reason})",
                    code="incompatible_workers",
                )
            if not tried:  # no decode worker at all (the pool at zero, or all restarting)
                waited = await self._wait_for_workers(self.decode, "decode", empty_until)
                empty_until = waited
                continue
            remaining = self._admission_left(deadline, last_reason)
            if not background and not self._counted_waiting:
                # Refused everywhere: background requests wait behind this one from now.
                self.decode.interactive_waiting += 1
                self._counted_waiting = True
            # Full everywhere: wait for the next Load poll (blocks free up as requests end).
            await self.decode.wait_for_change(min(remaining, 1.0))

    def _admission_left(self, deadline: float, why: str) -> float:
        """Seconds left to find a decode worker; a 503 saying why once there are none."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FlowError(
                503,
                f"no decode worker admitted the request within "
                f"{self.settings.admission_timeout_seconds:g}s ({why})",
                code="no_capacity",
            )
        return remaining

    def _release_decode(self) -> None:
        """The reservation's request no longer counts on its decode worker."""
        if self._decode_claim is not None:
            self._decode_claim.release()
            self._decode_claim = None

    async def _disaggregated(self) -> AsyncIterator[TokenChunk]:
        assert self.prefill is not None and self.decode is not None
        req = self.req
        first: serving_pb2.FirstToken | None = None
        decode: Worker | None = None
        decode_done = False
        prefill: Worker | None = None
        prefill_call: Any = None
        prefill_done = False
        generate_call: Any = None
        worker_rid = req.request_id
        failed_prefill: set[str] = set()
        # Prefill workers that refused this request (INVALID_ARGUMENT: a prompt longer than
        # their context limit or their whole KV cache): asking again cannot change the answer.
        # endpoint -> (why, field to lower)
        refused_prefill: dict[str, tuple[str, str | None]] = {}
        key = self.prefill.prompt_key(req.prompt_token_ids)
        # Decode's cache_aware picks by what its workers hold, hashed in their block size.
        decode_key = self.decode.prompt_key(req.prompt_token_ids, known=key)
        try:
            # ---- reserve + prefill, retried on another prefill worker ----
            last_error = ""
            wait_until: float | None = None  # set when the pool is first found empty
            while True:
                attempt = self.stats.prefill_attempts
                if attempt >= self.settings.max_prefill_attempts:
                    raise FlowError(502, f"prefill failed on {attempt} worker(s): {last_error}")
                # Each attempt gets its own id: leftovers of a failed one never collide.
                worker_rid = req.request_id if attempt == 0 else f"{req.request_id}.r{attempt}"
                # Recorded in the prefix index only when sent (below): the reservation may
                # fail, or another worker take this one's place.
                prefill, cached = self.prefill.pick_cached(
                    failed_prefill | refused_prefill.keys(), key
                )
                if prefill is None and failed_prefill:
                    # Every worker failed once: try again anyway (not one that refused it).
                    prefill, cached = self.prefill.pick_cached(set(refused_prefill), key)
                if prefill is None and refused_prefill:
                    error = self._too_large(
                        "prefill", self.prefill, refused_prefill, set(refused_prefill), last_error
                    )
                    if error is not None:
                        raise error
                if prefill is None:
                    # None now (a pool at zero waking up, or every worker restarting): wait.
                    wait_until = await self._wait_for_workers(
                        self.prefill, "prefill", wait_until, last_error
                    )
                    continue
                # Claimed now, before the reservation's await: requests arriving together all
                # pick before any reservation returns, and unclaimed they all picked the same
                # idle worker (a burst of new conversations then shared one prefill worker).
                claimed = key.tokens - cached
                claimed_at = _claim(prefill.load, claimed)
                try:
                    decode = await self._reserve(
                        worker_rid, prefill.model, decode_key, before_first_token=first is None
                    )
                except BaseException:
                    _unclaim(prefill.load, claimed, claimed_at)
                    raise
                if not prefill.load.healthy or prefill.load.draining:
                    # Waiting for decode blocks can take up to the admission timeout; the
                    # worker picked before it may have died or started draining meanwhile.
                    # Another with the same ModelSpec (the one the reservation was checked
                    # against) takes its place instead of wasting an attempt.
                    other, cached = self.prefill.pick_cached(
                        failed_prefill | refused_prefill.keys(), key
                    )
                    if other is not None and other.model == prefill.model:
                        _unclaim(prefill.load, claimed, claimed_at)
                        prefill = other
                        claimed = key.tokens - cached
                        claimed_at = _claim(prefill.load, claimed)
                if prefill.load.reports != claimed_at:
                    # A Load report landed while the reservation waited: it was taken before
                    # this prompt was sent and reset the router's deltas, so count it again.
                    claimed_at = _claim(prefill.load, claimed)
                self.stats.prefill_attempts += 1
                self.stats.prefill_endpoint = prefill.load.endpoint
                sent_at_report = claimed_at
                self.prefill.sent(prefill, key)
                prefill_done = False
                prefill_call = prefill.stub.Prefill(
                    serving_pb2.PrefillRequest(
                        request_id=worker_rid,
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                        priority=req.priority,
                        decode_endpoint=decode.load.endpoint,
                        decode_model=decode.model,
                        decode_cached_tokens=self.stats.decode_cached_tokens,
                    )
                )
                try:
                    async for event in prefill_call:
                        kind = event.WhichOneof("event")
                        if kind == "first_token" and first is None:
                            first = event.first_token
                            _prefilled(
                                prefill.load,
                                sent_at_report,
                                claimed,
                                len(req.prompt_token_ids) - first.num_cached_tokens,
                                1,
                            )
                            self.stats.prefill_queue_seconds = first.queue_seconds
                            self.stats.prefill_compute_seconds = first.compute_seconds
                            self.stats.num_cached_tokens = first.num_cached_tokens
                            chunk = self._chunk(self._first_event(first))
                            yield chunk
                            if chunk.finished:
                                return  # finally aborts the reservation and the transfer
                        elif kind == "transfer_done":
                            done = event.transfer_done
                            self.stats.kv_transfer_seconds = done.transfer_seconds
                            self.stats.kv_transfer_exposed_seconds = done.exposed_seconds
                            self.stats.kv_transfer_bytes = done.bytes
                            prefill_done = True
                    if first is None or not prefill_done:
                        raise FlowError(502, "prefill stream ended before the KV transfer was done")
                    break
                except (grpc.aio.AioRpcError, FlowError) as e:
                    if (refused := _grammar_refused(e, req.grammar_param)) is not None:
                        raise refused from e
                    last_error = (
                        f"{prefill.load.endpoint}: "
                        f"{_rpc_reason(e) if isinstance(e, grpc.aio.AioRpcError) else e}"
                    )
                    log.warning("prefill attempt %d failed: %s", attempt + 1, last_error)
                    lost = isinstance(e, grpc.aio.AioRpcError) and e.code() in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN,
                    )
                    # The prefill worker relays a failed KV stream with the decode side's
                    # status (protocol.kv_transfer_failed): the decode worker died or froze
                    # mid-transfer. Taking the prefill worker out of picking (and forgetting
                    # its prefix cache) for that left a pool whose every worker had pushed KV
                    # to the failed decode worker with none to retry on.
                    kv_side = (
                        isinstance(e, grpc.aio.AioRpcError)
                        and decode is not None
                        and kv_transfer_failed_to(e.details() or "", decode.load.endpoint)
                    )
                    if kv_side:
                        assert decode is not None
                        if lost:
                            self.decode.mark_failed(decode.load.endpoint, _rpc_reason(e))
                    elif _refused(e):
                        refused_prefill[prefill.load.endpoint] = (last_error, None)
                    else:
                        failed_prefill.add(prefill.load.endpoint)
                        if lost:
                            self.prefill.mark_failed(prefill.load.endpoint, _rpc_reason(e))
                    _spawn(_abort(prefill, worker_rid, self.settings.abort_timeout_seconds))
                    _spawn(_abort(decode, worker_rid, self.settings.abort_timeout_seconds))
                    prefill_done = True  # nothing left to abort for this attempt
                    self._release_decode()
                    decode = None
            # ---- decode ----
            assert first is not None and decode is not None
            if self._decode_claim is not None:
                self._decode_claim.generating()
            generate_call = decode.stub.Generate(
                serving_pb2.GenerateRequest(
                    request_id=worker_rid,
                    prompt_token_ids=req.prompt_token_ids,
                    first_token=first.token_id,
                    sampling=req.sampling,
                    priority=req.priority,
                    first_token_logprob=first.logprob,
                )
            )
            try:
                async for event in generate_call:
                    chunk = self._chunk(event)
                    if chunk.finished:
                        decode_done = event.finished
                    if chunk.token_ids or chunk.finished:
                        yield chunk
                    if chunk.finished:
                        return
            except grpc.aio.AioRpcError as e:
                if (refused := _grammar_refused(e, req.grammar_param)) is not None:
                    raise refused from e  # the grammar fails on the first token (a limit)
                what = "refused the request" if _refused(e) else "failed mid-stream"
                if not _refused(e):  # a refusal of this request is no sign of a broken worker
                    self.decode.mark_failed(decode.load.endpoint, _rpc_reason(e))
                raise FlowError(
                    502, f"decode worker {decode.load.endpoint} {what}: {_rpc_reason(e)}"
                ) from e
            raise FlowError(
                502,
                f"decode worker {decode.load.endpoint} ended the stream "
                "without finishing the request",
            )
        finally:
            timeout = self.settings.abort_timeout_seconds
            if prefill_call is not None and not prefill_done:
                prefill_call.cancel()
                if prefill is not None:
                    _spawn(_abort(prefill, worker_rid, timeout))
            if generate_call is not None and not decode_done:
                generate_call.cancel()
            self._release_decode()
            if decode is not None:
                if not decode_done:
                    # The request ended here (a failed attempt aborted its own reservation
                    # above): its prefill's KV stream, cut just now, is no fault of anyone's.
                    _spawn(_abort(decode, worker_rid, timeout, routine=True))

    # ---- colocated ---------------------------------------------------------------------

    async def _colocated(self) -> AsyncIterator[TokenChunk]:
        assert self.colocated is not None
        req = self.req
        failed: set[str] = set()
        # endpoint -> (why its whole cache cannot hold this request, field to lower)
        too_small: dict[str, tuple[str, str | None]] = {}
        worker: Worker | None = None
        call: Any = None
        done = False
        last_error = ""
        wait_until: float | None = None
        key = self.colocated.prompt_key(req.prompt_token_ids)
        try:
            while True:
                if len(failed) >= self.settings.max_prefill_attempts:
                    raise FlowError(502, f"failed on {len(failed)} worker(s): {last_error}")
                worker, cached = self.colocated.pick_cached(failed | too_small.keys(), key)
                if worker is None:
                    if failed:
                        raise FlowError(502, f"every colocated worker failed: {last_error}")
                    if too_small and (
                        error := self._too_large(
                            "colocated", self.colocated, too_small, set(too_small), last_error
                        )
                    ):
                        raise error
                    wait_until = await self._wait_for_workers(
                        self.colocated, "colocated", wait_until
                    )
                    continue
                if (refusal := req.too_big_for(worker)) is not None:
                    too_small[worker.load.endpoint] = refusal
                    continue
                claimed = key.tokens - cached
                sent_at_report = _claim(worker.load, claimed)
                self.colocated.sent(worker, key)
                self.stats.prefill_endpoint = self.stats.decode_endpoint = worker.load.endpoint
                done = False
                call = worker.stub.Complete(
                    serving_pb2.CompleteRequest(
                        request_id=req.request_id,
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                        priority=req.priority,
                    )
                )
                got_token = False
                try:
                    async for event in call:
                        if not got_token and event.token_ids:
                            got_token = True
                            _prefilled(
                                worker.load,
                                sent_at_report,
                                claimed,
                                len(req.prompt_token_ids) - event.num_cached_tokens,
                            )
                            # No stage split here: the worker reports no queue or compute
                            # time, and the call's wait for its first token holds both.
                            self.stats.num_cached_tokens = event.num_cached_tokens
                        chunk = self._chunk(event)
                        if chunk.finished:
                            done = event.finished
                        if chunk.token_ids or chunk.finished:
                            yield chunk
                        if chunk.finished:
                            return
                    raise FlowError(
                        502,
                        f"colocated worker {worker.load.endpoint} ended the "
                        "stream without finishing the request",
                    )
                except grpc.aio.AioRpcError as e:
                    refused = None if got_token else _grammar_refused(e, req.grammar_param)
                    if refused is not None:
                        done = True
                        raise refused from e
                    last_error = f"{worker.load.endpoint}: {_rpc_reason(e)}"
                    if not got_token and _refused(e):
                        # This request is what it refuses (longer than its context limit or
                        # its whole cache), not a broken worker: others may take it.
                        too_small[worker.load.endpoint] = (last_error, None)
                        done = True
                        continue
                    self.colocated.mark_failed(worker.load.endpoint, _rpc_reason(e))
                    if got_token:
                        raise FlowError(
                            502, f"colocated worker failed mid-stream: {last_error}"
                        ) from e
                    failed.add(worker.load.endpoint)
                    done = True  # the failed call has nothing left to abort
        finally:
            if worker is not None:
                worker.load.pending_requests = max(0, worker.load.pending_requests - 1)
            if call is not None and not done:
                call.cancel()
                if worker is not None:
                    _spawn(_abort(worker, req.request_id, self.settings.abort_timeout_seconds))
