"""The one thread that calls engine.step(), and the bridge from it to asyncio gRPC handlers.

Handlers `submit` (or `start_decode`) a request and read its tokens from an async stream; the
loop thread runs steps while there is work, delivers each step's outputs to the event loop in one
call_soon_threadsafe, and reports every iteration's stats (worker_http.WorkerMetricsUpdater).
Used by prefill_worker.py, decode_worker.py and colocated_worker.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_workers.engine import IterationStats, LLMEngine, Priority, SamplingParams

log = logging.getLogger(__name__)


class EngineFailure(Exception):
    """engine.step() raised; every request in flight gets this. `status`: the gRPC status a
    handler ends the request's call with."""

    status = grpc.StatusCode.INTERNAL


class StreamCut(EngineFailure):
    """The worker's drain timeout passed with this request still running (cut_all)."""

    status = grpc.StatusCode.UNAVAILABLE


@dataclass
class RequestStream:
    """Outputs of one request, in order, as they come off the engine thread."""

    request_id: str
    queue: asyncio.Queue[list[Any] | BaseException] = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.monotonic)
    produced_at: float = 0.0  # when the engine thread returned this request's latest outputs
    finished: bool = False
    cut_reason: str | None = None  # cut_all: its abort ends the stream with StreamCut

    async def next_batch(self) -> list[Any]:
        """Next non-empty list of TokenOutputs (raises EngineFailure if the engine broke)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_iteration: Callable[[IterationStats], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self.on_iteration = on_iteration
        self.idle_wait_s = idle_wait_s
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        """Start the step thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._work.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    # ---- requests (event-loop thread) ----
    def _register(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            self._streams[request_id] = stream
        return stream

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        prefill_only: bool = False,
        on_kv: Callable[..., None] | None = None,
    ) -> RequestStream:
        """Add a request; raises ValueError (from the engine) for a prompt it cannot take."""
        stream = self._register(request_id)
        try:
            self.engine.add_request(
                request_id,
                prompt_token_ids,
                params,
                priority,
                prefill_only=prefill_only,
                on_kv=on_kv,
            )
        except BaseException:
            self._unregister(request_id)
            raise
        self._work.set()
        return stream

    def start_decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
    ) -> RequestStream:
        stream = self._register(request_id)
        try:
            self.engine.start_decode(request_id, prompt_token_ids, first_token, params, priority)
        except BaseException:
            self._unregister(request_id)
            raise
        self._work.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a request (frees its blocks); its stream ends with finish_reason "abort"."""
        found = self.engine.abort(request_id)
        self._work.set()
        return found

    def cut_all(self, reason: str) -> int:
        """On the event loop, at the drain deadline: every running request is aborted (its
        blocks freed), and when the engine reports the abort its stream ends with
        StreamCut(reason), so its caller hears why rather than a bare cancelled call. Outputs
        the engine produced before the abort are still delivered first, and a request that
        finished on its own meanwhile ends as it did. Returns how many were cut."""
        with self._lock:
            streams = [s for s in self._streams.values() if not s.finished]
        for s in streams:
            s.cut_reason = reason
            self.abort(s.request_id)
        return len(streams)

    def forget(self, request_id: str) -> None:
        """Stop delivering to a stream whose reader went away (after abort)."""
        self._unregister(request_id)

    # ---- the step thread ----
    def wake(self) -> None:
        """Step again now: capacity was freed outside submit/abort (a released reservation)."""
        self._work.set()

    def _run(self) -> None:
        stalled = False
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                # Idle: sleep until a request arrives. One step after a wake-up even if
                # has_unfinished() is still False, in case the engine applies additions there.
                if not self._work.wait(self.idle_wait_s):
                    continue
                self._work.clear()
            elif stalled:
                # Work waits but the last step could schedule none of it (reservations hold the
                # blocks it needs): wait for a change instead of spinning on the engine lock
                # the change itself has to take. Re-checked every idle_wait_s regardless.
                self._work.wait(self.idle_wait_s)
                self._work.clear()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - report to every request, keep serving
                log.exception("engine step failed")
                self._fail_all(EngineFailure(f"engine step failed: {e}"))
                continue
            stalled = not outputs and self.engine.stats().batch_size == 0
            if outputs:
                self._deliver_threadsafe(outputs)
            if self.on_iteration is not None:
                try:
                    self.on_iteration(self.engine.stats())
                except Exception:  # noqa: BLE001 - metrics must never stop the engine
                    log.exception("metrics update failed")

    def _deliver_threadsafe(self, outputs: list[Any]) -> None:
        by_request: dict[str, list[Any]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, by_request, time.monotonic())
        except RuntimeError:
            pass  # event loop closed during shutdown

    def _deliver(self, by_request: dict[str, list[Any]], produced_at: float) -> None:
        for request_id, outs in by_request.items():
            with self._lock:
                stream = self._streams.get(request_id)
                if stream is not None and any(o.finished for o in outs):
                    del self._streams[request_id]
            if stream is None:
                continue
            if any(o.finished for o in outs):
                stream.finished = True
            stream.produced_at = produced_at
            if stream.cut_reason is not None and any(o.finish_reason == "abort" for o in outs):
                tokens = [o for o in outs if o.finish_reason != "abort" and o.token_id is not None]
                if tokens:
                    stream.queue.put_nowait(tokens)
                stream.queue.put_nowait(StreamCut(stream.cut_reason))
                continue
            stream.queue.put_nowait(outs)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            try:
                self.engine.abort(s.request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort after engine failure")
        assert self._loop is not None

        def deliver() -> None:
            for s in streams:
                s.finished = True
                s.queue.put_nowait(error)

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            pass
