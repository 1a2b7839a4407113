"""Decode-side reservations and their leases: the blocks a Reserve call took for a request whose KV
is still on its way. decode_worker.py drives it; kv_transfer.TransferTracker checks the chunks.

A reservation is RECEIVING until every token-layer arrived (COMPLETE), then STARTED once Generate
hands it to the engine (it leaves this table). It FAILS when its stream breaks or sends garbage,
or when its lease runs out: no chunk for `lease_s`, not complete `deadline_s` after Reserve, or
complete but no Generate within `lease_s`. A failed reservation's blocks are released exactly
once (`release` callback), after any import in flight; its failure is kept for a while so a late
Generate gets the reason instead of "unknown request".
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve_workers.kv_transfer import TransferTracker


class State(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str
    reason: str  # short label for metrics: lease_expired, invalid_chunk, stream_cut, ...


@dataclass
class Reservation:
    request_id: str
    num_prompt_tokens: int
    tracker: TransferTracker
    created: float
    last_activity: float
    deadline: float
    state: State = State.RECEIVING
    failure: Failure | None = None
    failed_at: float = 0.0
    completed_at: float = 0.0
    stream_open: bool = False  # one PushKV stream per request
    generate_waiting: bool = False  # a Generate call is waiting for the KV
    busy: int = 0  # imports in flight; blocks are released only when none are
    released: bool = False
    stream_task: asyncio.Task[Any] | None = None  # the PushKV handler, cancelled on expiry
    aborted: bool = False  # the router's Abort came after the reservation had failed
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # COMPLETE or FAILED


class Reservations:
    """The table of live (and recently failed) reservations. Time is passed in, so the lease
    logic is testable without sleeping."""

    def __init__(
        self,
        release: Callable[[str], None],
        lease_s: float,
        deadline_s: float | None = None,
        tombstone_s: float = 120.0,
    ) -> None:
        self._release = release
        self.lease_s = lease_s
        self.deadline_s = deadline_s if deadline_s is not None else 4 * lease_s
        self.tombstone_s = tombstone_s
        self._table: dict[str, Reservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._table

    def get(self, request_id: str) -> Reservation | None:
        return self._table.get(request_id)

    @property
    def live(self) -> int:
        """Reservations still holding blocks (for draining and the Load report)."""
        return sum(1 for r in self._table.values() if r.state is not State.FAILED)

    def add(self, request_id: str, tracker: TransferTracker, now: float) -> Reservation:
        res = Reservation(
            request_id=request_id,
            num_prompt_tokens=tracker.num_tokens,
            tracker=tracker,
            created=now,
            last_activity=now,
            deadline=now + self.deadline_s,
        )
        self._table[request_id] = res
        return res

    def touch(self, res: Reservation, now: float) -> None:
        res.last_activity = now

    def mark_complete(self, res: Reservation, now: float) -> None:
        res.state = State.COMPLETE
        res.completed_at = now
        res.last_activity = now
        res.settled.set()

    def fail(self, res: Reservation, failure: Failure, now: float) -> bool:
        """Fail a reservation (once) and release its blocks unless an import is in flight.
        Returns False if it had already failed or started."""
        if res.state is State.FAILED or res.request_id not in self._table:
            return False
        res.state = State.FAILED
        res.failure = failure
        res.failed_at = now
        # Kept as a tombstone for tombstone_s: only the failure, not the layers x tokens
        # coverage map (at 80 layers and an 8k prompt, 640 KB per aborted request).
        res.tracker.discard()
        res.settled.set()
        self._maybe_release(res)
        return True

    def import_done(self, res: Reservation) -> None:
        res.busy -= 1
        self._maybe_release(res)

    def _maybe_release(self, res: Reservation) -> None:
        if res.state is State.FAILED and res.busy == 0 and not res.released:
            res.released = True
            self._release(res.request_id)

    def take(self, res: Reservation) -> None:
        """The engine now owns the request's blocks (start_decode); forget the reservation."""
        self._table.pop(res.request_id, None)

    def expire(self, now: float) -> list[Reservation]:
        """Fail every reservation whose lease ran out; drop old failures. Returns those failed."""
        expired: list[Reservation] = []
        for res in list(self._table.values()):
            if res.state is State.FAILED:
                if now - res.failed_at > self.tombstone_s and res.released:
                    del self._table[res.request_id]
                continue
            failure: Failure | None = None
            if res.state is State.RECEIVING:
                if now > res.deadline:
                    failure = Failure(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"KV transfer for {res.request_id} not complete within the "
                        f"{self.deadline_s:g} s deadline ({res.tracker.progress()} received)",
                        "lease_expired",
                    )
                elif now - res.last_activity > self.lease_s:
                    failure = Failure(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"KV transfer for {res.request_id} stalled: no chunk within the "
                        f"{self.lease_s:g} s lease ({res.tracker.progress()} received)",
                        "lease_expired",
                    )
            elif (
                res.state is State.COMPLETE
                and not res.generate_waiting
                and now - res.completed_at > self.lease_s
            ):
                failure = Failure(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"KV for {res.request_id} arrived but no Generate came within the "
                    f"{self.lease_s:g} s lease",
                    "lease_expired",
                )
            if failure is not None and self.fail(res, failure, now):
                expired.append(res)
        return expired

    def fail_all(self, failure: Failure, now: float) -> None:
        for res in list(self._table.values()):
            self.fail(res, failure, now)
