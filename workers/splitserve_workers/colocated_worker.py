"""`splitserve colocated`: one engine does both phases (optionally chunked prefill through
--max-batch-tokens) and ColocatedService.Complete streams the tokens. The baseline every
disaggregation claim is measured against, and a valid small deployment. Plumbing in
worker_runtime.py.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc

from splitserve_workers import worker_runtime as rt
from splitserve_workers.engine_loop import EngineFailure
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pb_grpc


class ColocatedRole:
    def __init__(self, worker: rt.Worker) -> None:
        self.w = worker
        self.loop = worker.loop
        self._active = 0

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_ColocatedServiceServicer_to_server(self, server)

    def busy(self) -> int:
        return self._active

    def cut(self, reason: str) -> None:
        self.loop.cut_all(reason)

    async def close(self) -> None:
        return None

    async def Complete(
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TokenEvent]:
        await self.w.refuse_if_draining(context)
        rid = request.request_id
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        max_len = self.w.engine.model_config.max_model_len
        why = rt.request_problem(rid, len(request.prompt_token_ids), max_len)
        if why is not None:
            await context.abort(invalid, why)
        try:
            params = rt.sampling_from_proto(request.sampling)
            await rt.compile_grammar(self.loop.engine, params)
            stream = self.loop.submit(
                rid,
                list(request.prompt_token_ids),
                params,
                rt.priority_from_proto(request.priority),
            )
        except ValueError as e:
            await context.abort(invalid, str(e))
            return
        self._active += 1
        finished = sent = False
        try:
            while not finished:
                try:
                    outs = await stream.next_batch()
                except EngineFailure as e:
                    finished = True
                    await context.abort(e.status, str(e))
                    return
                if not sent and (why := rt.grammar_failed(outs)) is not None:
                    finished = True
                    await context.abort(invalid, why)
                ev = rt.token_event(outs)
                finished = ev.finished
                sent = sent or bool(ev.token_ids)
                yield ev
        finally:
            self._active -= 1
            if not finished:
                # The client went away: abort frees the request's blocks.
                self.loop.abort(rid)
                self.loop.forget(rid)

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


def run(args: argparse.Namespace) -> int:
    return rt.run_role("colocated", args, ColocatedRole)
