"""`splitserve decode`: the decode worker. Reserve takes KV blocks for a request before its prefill
starts (admission control), PushKV receives the prefill worker's layer-wise KV straight into
those blocks, and Generate continues the sequence with continuous batching and streams tokens.

Leases (reservations.py) free the blocks of any transfer that stalls, breaks or sends garbage;
chunk checks live in kv_transfer.TransferTracker; process plumbing in worker_runtime.py.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc

from splitserve_workers import worker_runtime as rt
from splitserve_workers.engine_loop import EngineFailure
from splitserve_workers.kv_transfer import (
    REQUEST_ID_METADATA,
    KVChunkError,
    KVChunkView,
    TransferTracker,
    check_compatible,
    keep_large_buffers_in_heap,
    parse_kv_chunk,
)
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.reservations import Failure, Reservation, Reservations, State

log = logging.getLogger(__name__)

SERVICE = "splitserve.v1.DecodeService"
# Chunks up to this size are imported on the event loop; larger ones on the import thread.
INLINE_IMPORT_BYTES = 2 << 20
MAX_PENDING_IMPORTS = 2
# After a waiting interactive Reserve (its caller refused everywhere once) is refused for lack of
# blocks, background ones are refused for this long (each such refusal extends it): the blocks
# that free up go to the interactive request, whichever router it waits in. Routers retry a
# refused reservation at least once a second, so a waiting interactive request keeps the window
# open.
INTERACTIVE_HOLD_S = 1.5
# A cut KV stream whose reservation the router's Abort reaches within this long is counted and
# logged as that routine abort, not as a `stream_cut` fault: a request that ends with its first
# token (max_tokens 1, a stop, a client gone) has the router cancel the prefill call and Abort
# here at once, and the prefill worker's cut of the KV stream may arrive first. Its blocks are
# freed at once either way; only the verdict waits.
CUT_GRACE_S = 1.0


class DecodeRole:
    def __init__(self, worker: rt.Worker) -> None:
        self.w = worker
        self.engine = worker.engine
        self.loop = worker.loop
        self.reservations = Reservations(self._release, lease_s=worker.settings.lease_s)
        # Reserve calls still in the engine: request id -> aborted meanwhile (Abort came first).
        self._reserving: dict[str, bool] = {}
        # Cut streams awaiting their verdict (CUT_GRACE_S): id(reservation) -> (timer, it).
        self._cut_verdicts: dict[int, tuple[asyncio.TimerHandle, Reservation]] = {}
        self._active = 0
        # Until then background reservations stand back (see INTERACTIVE_HOLD_S).
        self._interactive_waits_until = 0.0
        # import_kv copies into the cache; one thread keeps the event loop free of it.
        self._imports = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-import")
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        keep_large_buffers_in_heap()  # every received KV message is a fresh multi-MiB buffer

    # ---- wiring ----
    def register(self, server: grpc.aio.Server) -> None:
        def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )

        handlers = {
            "Reserve": unary(self.Reserve, pb.ReserveRequest, pb.ReserveResponse),
            # KV chunks are parsed by hand: key/value stay memoryviews into the received bytes.
            "PushKV": grpc.stream_unary_rpc_method_handler(
                self.PushKV,
                request_deserializer=parse_kv_chunk,
                response_serializer=pb.PushKVResponse.SerializeToString,
            ),
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.TokenEvent.SerializeToString,
            ),
            "Abort": unary(self.Abort, pb.AbortRequest, pb.AbortResponse),
            "Load": unary(self.Load, pb.LoadRequest, pb.LoadReport),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    def busy(self) -> int:
        return self._active + self.reservations.live

    def cut(self, reason: str) -> None:
        # Reservations whose KV is still coming (their Generate waits on them) fail with it
        # too; generating requests end when the engine reports their abort.
        self.reservations.fail_all(
            Failure(grpc.StatusCode.UNAVAILABLE, reason, "shutdown"), time.monotonic()
        )
        self.loop.cut_all(reason)

    async def close(self) -> None:
        self._sweeper.cancel()
        for timer, res in list(self._cut_verdicts.values()):  # no cut goes unreported
            timer.cancel()
            self._report_cut(res)
        self.reservations.fail_all(
            Failure(grpc.StatusCode.UNAVAILABLE, "decode worker shutting down", "shutdown"),
            time.monotonic(),
        )
        self._imports.shutdown(wait=True)

    def _reserve_unwanted(self, request_id: str, call: asyncio.Future[bool]) -> None:
        """A Reserve whose caller went away finished in the engine: free what it took."""
        self._reserving.pop(request_id, None)
        if not call.cancelled() and call.exception() is None and call.result():
            log.info("reserve %s: the caller is gone; its blocks are freed", request_id)
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        try:
            self.engine.release(request_id)
        except Exception:  # noqa: BLE001 - already gone is fine; log anything else
            log.exception("release %s", request_id)
        self.loop.wake()  # its blocks may be what a waiting request needs

    async def _sweep(self) -> None:
        period = min(0.25, self.reservations.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            for res in self.reservations.expire(time.monotonic()):
                log.warning("%s", res.failure.message if res.failure else res.request_id)
                self.w.metrics.rejected("lease_expired")
                task = res.stream_task
                if task is not None and not task.done():
                    task.cancel()  # the PushKV handler answers DEADLINE_EXCEEDED

    # ---- RPCs ----
    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        await self.w.refuse_if_draining(context)
        rid = request.request_id
        why = rt.request_problem(rid)
        if why is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if not request.HasField("model"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "model: the ModelSpec of the prefill side is required (from its Load report)",
            )
        n = request.num_prompt_tokens
        max_len = self.engine.model_config.max_model_len
        if not 1 <= n <= max_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_prompt_tokens: {n} must be in [1, {max_len}] (max_model_len)",
            )
        need, total = -(-(n + 1) // self.engine.block_size), self.engine.num_kv_blocks
        if need > total:
            # Never free, however long the caller waits: refused like a prompt over the limit
            # (the router's 400), not "no_free_blocks" (which it retries until its timeout).
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_prompt_tokens: {n} tokens and the first generated one need {need} KV "
                f"blocks of {self.engine.block_size}; this worker has {total} in all",
            )
        given = len(request.prompt_token_ids)  # the list is built only once its size is right
        if given not in (0, n):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_token_ids: {given} tokens, but num_prompt_tokens is {n}",
            )

        def refuse(reason: str, label: str) -> pb.ReserveResponse:
            self.w.metrics.rejected(label)
            return pb.ReserveResponse(
                accepted=False, reason=reason, free_blocks=self.engine.stats().free_blocks
            )

        why = check_compatible(self.w.spec, request.model)
        if why is not None:
            return refuse(why, "incompatible")
        old = self.reservations.get(rid)
        if old is not None and old.state is State.FAILED and old.released:
            self.reservations.take(old)  # a retry after a failed transfer starts afresh
        if rid in self.reservations or rid in self._reserving:
            return refuse(f"duplicate request_id {rid!r}", "duplicate")
        background = request.priority == pb.PRIORITY_BACKGROUND
        if background and time.monotonic() < self._interactive_waits_until:
            return refuse(
                "behind_interactive: an interactive request waits for this worker's blocks",
                "behind_interactive",
            )
        self._reserving[rid] = False
        prompt = list(request.prompt_token_ids) if given else None
        call = asyncio.get_running_loop().run_in_executor(
            None, self.engine.reserve, rid, n, prompt, rt.priority_from_proto(request.priority)
        )
        try:
            # Shielded: a cancelled RPC (client gone, deadline passed) does not stop the engine
            # call on its thread, and the blocks it takes must not outlive the caller.
            ok = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda _: self._reserve_unwanted(rid, call))
            raise
        except ValueError as e:  # e.g. the id is still generating here
            self._reserving.pop(rid, None)
            return refuse(str(e), "invalid_request")
        except BaseException:
            self._reserving.pop(rid, None)
            raise
        if self._reserving.pop(rid, False):  # the router aborted it while it was allocated
            if ok:
                self._release(rid)
            return refuse("aborted by the router", "aborted")
        if not ok:
            if not background and request.waiting:
                # It fits once enough blocks free up (a prompt the whole cache cannot hold was
                # refused above): keep them from background requests. Not for a request on its
                # first round, which another worker may well admit.
                self._interactive_waits_until = time.monotonic() + INTERACTIVE_HOLD_S
            return refuse("no_free_blocks", "no_free_blocks")
        spec = self.w.spec
        cached = self.engine.reserved_cached_tokens(rid)
        tracker = TransferTracker(
            rid, n, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, cached
        )
        self.reservations.add(rid, tracker, time.monotonic())
        return pb.ReserveResponse(
            accepted=True,
            lease_ms=int(self.reservations.lease_s * 1000),
            free_blocks=self.engine.stats().free_blocks,
            num_cached_tokens=cached,
        )

    def _fail(self, res: Reservation, code: grpc.StatusCode, message: str, reason: str) -> None:
        if self.reservations.fail(res, Failure(code, message, reason), time.monotonic()):
            if reason == "stream_cut":
                # The blocks are free already; only the verdict waits for a racing Abort.
                timer = asyncio.get_running_loop().call_later(CUT_GRACE_S, self._report_cut, res)
                self._cut_verdicts[id(res)] = (timer, res)
            else:
                self._report(res, reason, message)

    def _report(self, res: Reservation, reason: str, message: str) -> None:
        # A router abort (client gone, stop string, max_tokens 1) is routine, not a refused
        # call: it is neither counted as a rejection nor logged as a fault.
        if reason != "aborted":
            self.w.metrics.rejected(reason)
        level = logging.INFO if reason == "aborted" else logging.WARNING
        log.log(level, "transfer %s failed: %s", res.request_id, message)

    def _report_cut(self, res: Reservation) -> None:
        self._cut_verdicts.pop(id(res), None)
        assert res.failure is not None
        if res.aborted:
            self._report(res, "aborted", f"{res.failure.message}, then aborted by the router")
        else:
            self._report(res, "stream_cut", res.failure.message)

    async def _open_stream(self, rid: str, context: grpc.aio.ServicerContext) -> Reservation:
        res = self.reservations.get(rid)
        if res is None and (why := rt.request_problem(rid)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)  # not echoed back
        if res is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request_id: {rid!r} has no reservation on this worker (never reserved, "
                "expired, or already generating)",
            )
            raise AssertionError  # unreachable: abort raises
        if res.state is State.FAILED and res.failure is not None:
            await context.abort(res.failure.code, res.failure.message)
        if res.state is not State.RECEIVING:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"request_id: {rid!r} KV is already complete"
            )
        if res.stream_open:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request_id: {rid!r} already has an open PushKV stream",
            )
        res.stream_open = True
        res.stream_task = asyncio.current_task()
        self.reservations.touch(res, time.monotonic())
        return res

    async def PushKV(
        self, request_iterator: AsyncIterator[KVChunkView], context: grpc.aio.ServicerContext
    ) -> pb.PushKVResponse:
        rid = dict(context.invocation_metadata() or ()).get(REQUEST_ID_METADATA)
        res: Reservation | None = None
        pending: deque[asyncio.Future[str | None]] = deque()
        self._active += 1
        try:
            chunks = request_iterator
            if rid:
                res = await self._open_stream(str(rid), context)
            else:
                chunks = self._first_within_lease(request_iterator, context)
            try:
                async for chunk in chunks:
                    if res is None:
                        if chunk.malformed:
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, chunk.malformed)
                        res = await self._open_stream(chunk.request_id, context)
                    if res.state is State.FAILED and res.failure is not None:
                        await context.abort(res.failure.code, res.failure.message)
                    try:
                        payload = res.tracker.accept(chunk)
                    except KVChunkError as e:
                        self._fail(res, e.code, e.message, "invalid_chunk")
                        await context.abort(e.code, e.message)
                        raise  # unreachable
                    self.reservations.touch(res, time.monotonic())
                    if payload is not None:
                        layer, token_start, k, v = payload
                        await self._import(res, layer, token_start, k, v, pending, context)
                    if chunk.last:
                        await self._settle_imports(res, pending, 0, context)
                        if not res.tracker.complete:
                            msg = (
                                f"last chunk arrived with {res.tracker.progress()} of "
                                f"{res.request_id}'s KV"
                            )
                            self._fail(res, grpc.StatusCode.FAILED_PRECONDITION, msg, "incomplete")
                            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
                        self.reservations.mark_complete(res, time.monotonic())
                        return pb.PushKVResponse(chunks=res.tracker.chunks, bytes=res.tracker.bytes)
            except asyncio.CancelledError:
                # Either the lease sweeper cancelled us (answer its DEADLINE_EXCEEDED) or the
                # sender went away (the stream is cut: free the blocks).
                if res is not None and res.state is State.FAILED and res.failure is not None:
                    await context.abort(res.failure.code, res.failure.message)
                if res is not None:
                    self._fail(
                        res,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"KV stream for {res.request_id} was cut before the last chunk "
                        f"({res.tracker.progress()} received)",
                        "stream_cut",
                    )
                raise
            if res is None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "empty PushKV stream (no request_id)"
                )
                raise AssertionError  # unreachable
            msg = (
                f"KV stream for {res.request_id} ended without the last chunk "
                f"({res.tracker.progress()} received)"
            )
            self._fail(res, grpc.StatusCode.FAILED_PRECONDITION, msg, "stream_cut")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
            raise AssertionError  # unreachable
        finally:
            self._active -= 1
            if res is not None:
                res.stream_open = False
                res.stream_task = None

    async def _first_within_lease(
        self, chunks: AsyncIterator[KVChunkView], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[KVChunkView]:
        """A stream without the request-id metadata has no lease until its first chunk names
        the reservation: that chunk must come within one lease, or the stream is refused with
        DEADLINE_EXCEEDED (an idle stream would otherwise stay open for ever and hold up a
        drain for its whole timeout)."""
        lease = self.w.settings.lease_s
        iterator = aiter(chunks)
        try:
            first = await asyncio.wait_for(anext(iterator), lease)
        except StopAsyncIteration:
            return
        except TimeoutError:
            self.w.metrics.rejected("lease_expired")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"PushKV stream without {REQUEST_ID_METADATA} metadata sent no chunk within "
                f"the reservation lease ({lease:g}s)",
            )
        yield first
        async for chunk in iterator:
            yield chunk

    def _import_kv(self, rid: str, layer: int, start: int, k: Any, v: Any) -> str | None:
        try:
            self.engine.import_kv(rid, layer, start, k, v)
        except ValueError as e:
            return f"import_kv: {e}"
        return None

    async def _import(
        self,
        res: Reservation,
        layer: int,
        token_start: int,
        k: Any,
        v: Any,
        pending: deque[asyncio.Future[str | None]],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Copy one chunk (one layer, or a batch of consecutive layers in one engine call) into
        the reserved blocks. Small chunks are copied inline (a thread hop costs more than the
        copy); large ones go to the import thread while the next chunk is received, at most
        MAX_PENDING_IMPORTS in flight (their bytes stay alive)."""
        rid = res.request_id
        if 2 * k.numel() * k.element_size() <= INLINE_IMPORT_BYTES:
            error = self._import_kv(rid, layer, token_start, k, v)
            if error is not None:
                self._fail(res, grpc.StatusCode.INVALID_ARGUMENT, error, "invalid_chunk")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            return
        res.busy += 1
        fut = asyncio.get_running_loop().run_in_executor(
            self._imports, self._import_kv, rid, layer, token_start, k, v
        )
        fut.add_done_callback(lambda _: self.reservations.import_done(res))
        pending.append(fut)
        await self._settle_imports(res, pending, MAX_PENDING_IMPORTS, context)

    async def _settle_imports(
        self,
        res: Reservation,
        pending: deque[asyncio.Future[str | None]],
        keep: int,
        context: grpc.aio.ServicerContext,
    ) -> None:
        while len(pending) > keep:
            error = await pending.popleft()
            if error is not None:
                self._fail(res, grpc.StatusCode.INVALID_ARGUMENT, error, "invalid_chunk")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenEvent]:
        rid = request.request_id
        res = self.reservations.get(rid)
        if res is None and (why := rt.request_problem(rid)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if res is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request_id: {rid!r} has no reservation on this worker",
            )
            return
        if res.state is State.FAILED and res.failure is not None:
            await context.abort(res.failure.code, f"KV transfer failed: {res.failure.message}")
        try:
            params = rt.sampling_from_proto(request.sampling)
            if len(request.prompt_token_ids) != res.num_prompt_tokens:
                raise ValueError(
                    f"prompt_token_ids: {len(request.prompt_token_ids)} tokens, but "
                    f"{res.num_prompt_tokens} were reserved"
                )
            prompt = list(request.prompt_token_ids)
            await rt.compile_grammar(self.engine, params)
        except ValueError as e:
            self._fail(res, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        res.generate_waiting = True
        self._active += 1
        started = finished = False
        try:
            await res.settled.wait()
            if res.state is State.FAILED and res.failure is not None:
                await context.abort(res.failure.code, f"KV transfer failed: {res.failure.message}")
            self.reservations.take(res)
            try:
                stream = self.loop.start_decode(
                    rid,
                    prompt,
                    request.first_token,
                    params,
                    rt.priority_from_proto(request.priority),
                )
            except ValueError as e:
                self._release(rid)
                finished = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            started = True
            while True:
                try:
                    outs = await stream.next_batch()
                except EngineFailure as e:
                    finished = True
                    await context.abort(e.status, str(e))
                ev = rt.token_event(outs)
                if ev.finished:
                    finished = True
                yield ev
                if finished:
                    return
        finally:
            self._active -= 1
            if not finished:
                # The router went away (or the stream broke): free the blocks.
                if started:
                    self.loop.abort(rid)
                    self.loop.forget(rid)
                else:
                    self._fail(res, grpc.StatusCode.CANCELLED, "Generate cancelled", "cancelled")

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        res = self.reservations.get(request.request_id)
        if res is not None and res.state is not State.FAILED:
            self._fail(res, grpc.StatusCode.CANCELLED, "aborted by the router", "aborted")
            return pb.AbortResponse(found=True)
        if res is not None and request.routine and id(res) in self._cut_verdicts:
            res.aborted = True  # the cut stream this Abort follows was routine (CUT_GRACE_S)
            return pb.AbortResponse(found=True)
        if request.request_id in self._reserving:  # freed as soon as the engine call returns
            self._reserving[request.request_id] = True
            return pb.AbortResponse(found=True)
        return pb.AbortResponse(found=self.loop.abort(request.request_id))

    async def Load(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadReport:
        return self.w.load_report()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rt.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return rt.run_role("decode", args, DecodeRole)
