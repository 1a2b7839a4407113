"""`splitserve prefill`: the prefill worker. Prefill checks that the reserved decode worker can take
this model's KV, runs the prompt through the engine (prefill_only), streams every layer's KV to
that worker as soon as the layer is computed (kv_transfer.KVSender over DecodeService.PushKV),
and answers the router with FirstToken (as soon as sampled) and then TransferDone.

Layer-wise streaming means most of the transfer overlaps the remaining layers' compute;
TransferDone.exposed_seconds is the part that did not (ack time minus compute end).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from splitserve_workers import worker_runtime as rt
from splitserve_workers.engine_loop import EngineFailure
from splitserve_workers.kv_transfer import (
    ChannelPool,
    KVSender,
    check_compatible,
    keep_large_buffers_in_heap,
)
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc
from splitserve_workers.protocol import endpoint_problem, kv_transfer_failed

log = logging.getLogger(__name__)


def _rpc_error_status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, grpc.RpcError):
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        return code or grpc.StatusCode.UNKNOWN, details or ""
    return grpc.StatusCode.UNAVAILABLE, str(e) or type(e).__name__


class PrefillRole:
    def __init__(self, worker: rt.Worker) -> None:
        self.w = worker
        self.loop = worker.loop
        self.pool = ChannelPool()
        keep_large_buffers_in_heap()  # every KV message is a fresh multi-MiB buffer
        self._active = 0
        self.send_after_prefill = worker.settings.kv_send_after_prefill

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(self, server)

    def busy(self) -> int:
        return self._active

    def cut(self, reason: str) -> None:
        self.loop.cut_all(reason)

    async def close(self) -> None:
        self.pool.close()

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        arrival = time.monotonic()
        await self.w.refuse_if_draining(context)
        rid = request.request_id
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        max_len = self.w.engine.model_config.max_model_len
        why = rt.request_problem(rid, len(request.prompt_token_ids), max_len)
        if why is not None:
            await context.abort(invalid, why)
        prompt = list(request.prompt_token_ids)
        if not request.decode_endpoint:
            await context.abort(invalid, "decode_endpoint: required (host:port of the reservation)")
        if (why := endpoint_problem(request.decode_endpoint)) is not None:
            # Not echoed back: it may be long or hold control characters.
            await context.abort(invalid, f"decode_endpoint: {why}")
        if not request.HasField("decode_model"):
            await context.abort(invalid, "decode_model: required (the decode worker's ModelSpec)")
        if not 0 <= request.decode_cached_tokens < len(prompt):
            await context.abort(
                invalid,
                f"decode_cached_tokens: {request.decode_cached_tokens} must be in "
                f"[0, {len(prompt)}) (the prompt's last token is always sent)",
            )
        # Before any compute or bytes: can that decode worker import our KV at all?
        why = check_compatible(self.w.spec, request.decode_model)
        if why is not None:
            self.w.metrics.rejected("incompatible")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        try:
            params = rt.sampling_from_proto(request.sampling)
            await rt.compile_grammar(self.loop.engine, params)
        except ValueError as e:
            await context.abort(invalid, str(e))
            return

        spec = self.w.spec
        sender = KVSender(
            self.pool,
            request.decode_endpoint,
            rid,
            len(prompt),
            spec.num_layers,
            spec.dtype,
            hold_until_done=self.send_after_prefill,
            skip_tokens=request.decode_cached_tokens,
        )
        sender.start()
        transfer = asyncio.wrap_future(sender.future)
        # Paths that end the call early never await `transfer`; mark its outcome as seen so a
        # cancelled or failed stream is not reported as "Future exception was never retrieved".
        transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            stream = self.loop.submit(
                rid,
                prompt,
                params,
                rt.priority_from_proto(request.priority),
                prefill_only=True,
                on_kv=sender.on_kv,
            )
        except ValueError as e:
            sender.cancel()
            await context.abort(invalid, str(e))
            return

        self._active += 1
        finished = aborted = False
        try:
            first: pb.FirstToken | None = None
            compute_end = 0.0
            while first is None:
                try:
                    outs = await stream.next_batch()
                except EngineFailure as e:
                    finished = True
                    await context.abort(e.status, str(e))
                    return
                if (why := rt.grammar_failed(outs)) is not None:
                    finished = True
                    await context.abort(invalid, why)
                for o in outs:
                    if o.token_id is not None and first is None:
                        # When the engine thread had the token, not when we woke up.
                        compute_end = stream.produced_at or time.monotonic()
                        started = sender.first_kv_at or compute_end
                        first = pb.FirstToken(
                            token_id=o.token_id,
                            logprob=o.logprob or 0.0,
                            # Queue time ends when the first layer's KV appears (its compute is
                            # counted as queueing: the engine does not report the start).
                            queue_seconds=max(0.0, started - arrival),
                            compute_seconds=max(0.0, compute_end - started),
                            num_cached_tokens=o.num_cached_tokens,
                        )
                        if o.top_logprobs is not None:
                            first.top_logprobs.CopyFrom(rt.top_logprobs(o.top_logprobs))
                        if o.prompt_logprobs is not None:
                            first.prompt_logprobs.CopyFrom(rt.prompt_logprobs(o.prompt_logprobs))
                    if o.finished:
                        finished = True
                        aborted = o.finish_reason == "abort"
                if first is None and finished:
                    if aborted:  # PrefillService.Abort (the router's client went away)
                        await context.abort(
                            grpc.StatusCode.CANCELLED, f"prefill of {rid} was aborted (Abort)"
                        )
                    await context.abort(
                        grpc.StatusCode.INTERNAL, f"prefill of {rid} ended without a token"
                    )
            sender.release_held()
            sender.finish_incomplete()
            if transfer.done() and transfer.exception() is not None:
                code, details = _rpc_error_status(transfer.exception())  # type: ignore[arg-type]
                await context.abort(code, kv_transfer_failed(request.decode_endpoint, details))
            yield pb.PrefillEvent(first_token=first)
            try:
                result = await transfer
            except Exception as e:  # noqa: BLE001 - grpc.RpcError or a cancelled call
                code, details = _rpc_error_status(e)
                finished = True
                await context.abort(code, kv_transfer_failed(request.decode_endpoint, details))
                return
            finished = True
            yield pb.PrefillEvent(
                transfer_done=pb.TransferDone(
                    transfer_seconds=max(0.0, result.acked - result.first_send),
                    exposed_seconds=max(0.0, result.acked - compute_end),
                    bytes=result.bytes,
                )
            )
        finally:
            self._active -= 1
            if not finished:
                # The router cancelled (or we are failing): stop compute and the transfer; the
                # decode side frees its reservation when the KV stream is cut.
                self.loop.abort(rid)
                self.loop.forget(rid)
            # Always: when the router cancels during `await transfer`, asyncio has already
            # cancelled `sender.future` (so it reads done) while the PushKV call is still open.
            # Cutting that stream is what frees the decode side's reservation at once; on a
            # finished call cancel() does nothing.
            sender.cancel()

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.loop.abort(request.request_id))

    async def Load(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadReport:
        return self.w.load_report()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rt.add_arguments(parser)
    parser.add_argument(
        "--kv-send-after-prefill",
        action="store_true",
        help="ablation for benchmarks: send the KV only after prefill ends (no layer-wise overlap)",
    )


def run(args: argparse.Namespace) -> int:
    return rt.run_role("prefill", args, PrefillRole)
