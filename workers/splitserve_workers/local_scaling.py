"""Local mode's autoscaler, `splitserve up --autoscale`: the operator's decision core
(splitserve_operator/autoscaler.py) sizing the local prefill and decode pools, with signals
scraped from the processes' own /metrics pages (splitserve_operator/scrape.py) instead of
Prometheus, and processes instead of Deployment replicas.

The router learns the pools from a workers file (router/discovery.py FileDiscovery) that this
rewrites. Scale-up starts workers and publishes each once it is ready. Scale-down picks the
idlest workers, removes them from the file, then sends them SIGTERM: they refuse new work,
finish what they run and exit 0, and the router keeps their channels until their streams end.
Every decision that changes a pool's verdict or size is printed with its reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve_operator.autoscaler import (
    Decision,
    History,
    Objectives,
    PoolState,
    RatioBounds,
    Targets,
    decide,
    hold,
)
from splitserve_operator.prometheus import MetricsError
from splitserve_operator.scrape import ROUTER, DirectScraper, Target

from splitserve_workers.local import Child, LocalStack

POOLS = ("prefill", "decode")
# Between removing a worker from the workers file and its SIGTERM: the router re-reads the file
# on its next Load poll (0.5 s by default), so it stops picking the worker before it refuses.
UNPUBLISH_GRACE_S = 1.5


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int


@dataclass
class LocalPool:
    name: str
    bounds: Bounds
    serving: list[Child] = field(default_factory=list)
    starting: int = 0
    retiring: list[Child] = field(default_factory=list)
    failed_at: float | None = None  # when a scale-up's worker last failed to start

    @property
    def replicas(self) -> int:
        return len(self.serving) + self.starting


def signal_window(interval: float) -> float:
    """Rates and percentiles are read over this many seconds: several scrape rounds."""
    return max(4 * interval, 2.0)


class LocalAutoscaler:
    def __init__(
        self,
        stack: LocalStack,
        worker_args: list[str],
        workers_file: Path,
        bounds: dict[str, Bounds],
        objectives: Objectives,
        interval: float,
        stabilization: float,
        ratio: RatioBounds | None = None,
        targets: Targets | None = None,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.worker_args = worker_args
        self.workers_file = workers_file
        self.pools = {name: LocalPool(name, bounds[name]) for name in POOLS}
        self.objectives = objectives
        self.interval = interval
        self.stabilization = stabilization
        self.ratio = ratio or RatioBounds()
        self.load_targets = targets or Targets()
        self.window = signal_window(interval)
        self.scraper = DirectScraper(keep=self.window)
        self.histories: dict[str, History] = {}
        self.router_metrics_url = ""
        self.say = say
        self.clock = clock
        self._said: dict[str, tuple[str, int]] = {}
        self._serial = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- membership ------------------------------------------------------------------------

    def adopt(self, pool: str, children: list[Child]) -> None:
        """Workers `up` started before the autoscaler runs."""
        self.pools[pool].serving.extend(children)
        self._serial = max(self._serial, len(self.stack.children))

    def publish(self) -> None:
        """Write the serving workers to the workers file (atomically: a reader sees the old
        list or the new one)."""
        data = {
            name: [f"127.0.0.1:{c.port}" for c in pool.serving] for name, pool in self.pools.items()
        }
        tmp = self.workers_file.with_name(self.workers_file.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.workers_file)

    def describe(self) -> str:
        pools = ", ".join(
            f"{name} {p.bounds.min_replicas}..{p.bounds.max_replicas}"
            for name, p in self.pools.items()
        )
        o = self.objectives
        return (
            f"{pools}; TTFT p{o.percentile:g} <= {o.ttft_seconds * 1000:g}ms, TPOT "
            f"p{o.percentile:g} <= {o.tpot_seconds * 1000:g}ms; every {self.interval:g}s, "
            f"scale-down after {self.stabilization:g}s"
            + "".join(
                f", prefill per decode {word} {value:g}"
                for word, value in ((">=", self.ratio.low), ("<=", self.ratio.high))
                if value is not None
            )
        )

    def sizes(self) -> str:
        return ", ".join(f"{name} {pool.replicas}" for name, pool in self.pools.items())

    def targets(self) -> list[Target]:
        out = [Target("router", ROUTER, self.router_metrics_url)]
        for name, pool in self.pools.items():
            out += [
                Target(c.name, name, f"http://127.0.0.1:{c.metrics_port}/metrics")
                for c in pool.serving
            ]
        return out

    # ---- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
                if stop.is_set():
                    return
                try:
                    await self.evaluate()
                except Exception as e:  # one bad evaluation must not end autoscaling
                    self.say(f"autoscaler: evaluation failed: {e!r}; trying again next interval")
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def evaluate(self) -> dict[str, Decision] | None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.scraper.scrape, self.targets(), self.clock())
        states = {
            name: PoolState(
                name,
                replicas=pool.replicas,
                ready=len(pool.serving),
                min_replicas=pool.bounds.min_replicas,
                max_replicas=pool.bounds.max_replicas,
                max_batch_size=self.scraper.limit(name, "splitserve_max_batch_size")
                if name == "decode"
                else 0,
            )
            for name, pool in self.pools.items()
        }
        try:
            signals = self.scraper.read(self.objectives.percentile, self.window)
        except MetricsError as e:
            self._say_once("autoscaler", ("unavailable", 0), f"autoscaler: no metrics ({e})")
            # Unmeasured is not idle: the sizes held count as recommendations (as the
            # operator's), so a scale-down once metrics are back waits a whole window past them.
            hold(states, self.histories, self.clock(), self.stabilization, str(e), self.window)
            return None
        if self._said.pop("autoscaler", None):
            self.say("autoscaler: metrics are back")
        # What decide() records of a scale-up, to forget one that is held back (below).
        remembered = {
            name: (h.last_scale_up, h.settle_from, h.last_change, h.waiting_since)
            for name, h in self.histories.items()
        }
        decisions = decide(
            states,
            signals,
            self.objectives,
            self.histories,
            self.clock(),
            self.stabilization,
            settle=self.window,
            source="the autoscaler",
            ratio=self.ratio,
            targets=self.load_targets,
        )
        for name, decision in decisions.items():
            if decision.changes and self._backing_off(name, decision):
                h = self.histories[name]
                none = (None, None, None, None)
                h.last_scale_up, h.settle_from, h.last_change, h.waiting_since = remembered.get(
                    name, none
                )
                continue
            if decision.changes:
                self.say(
                    f"[{time.strftime('%H:%M:%S')}] autoscale {name} {decision.current} -> "
                    f"{decision.replicas}: {decision.reason}"
                )
                self._said[name] = (decision.verdict, decision.replicas)
                self.act(name, decision)
            else:
                self._say_once(
                    name,
                    (decision.verdict, decision.replicas),
                    f"[{time.strftime('%H:%M:%S')}] autoscale {name} {decision.verdict} at "
                    f"{decision.replicas}: {decision.reason}",
                )
        return decisions

    def _say_once(self, key: str, what: tuple[str, int], line: str) -> None:
        if self._said.get(key) != what:
            self._said[key] = what
            self.say(line)

    # ---- acting ----------------------------------------------------------------------------

    def _backing_off(self, name: str, decision: Decision) -> bool:
        """A scale-up within a window of a worker that failed to start is not carried out
        (said once per failure, with what it would have done)."""
        failed_at = self.pools[name].failed_at
        if decision.replicas <= decision.current or failed_at is None:
            return False
        if self.clock() - failed_at >= self.window:
            return False
        self._say_once(
            f"{name}:backoff",
            ("backoff", round(failed_at)),
            f"[{time.strftime('%H:%M:%S')}] autoscale {name} {decision.current} -> "
            f"{decision.replicas} held: a worker failed to start; not starting another for "
            f"{self.window:g}s ({decision.reason})",
        )
        return True

    def act(self, name: str, decision: Decision) -> None:
        pool = self.pools[name]
        if decision.replicas > decision.current:
            for _ in range(decision.replicas - decision.current):
                self._spawn(self._start(pool))
        elif decision.replicas < decision.current:
            load = self.scraper.pod_load(name)
            idlest = sorted(pool.serving, key=lambda c: load.get(c.name, 0.0))
            leaving = idlest[: min(decision.current - decision.replicas, len(pool.serving))]
            for child in leaving:
                pool.serving.remove(child)
                pool.retiring.append(child)
            self.publish()
            for child in leaving:
                self._spawn(self._retire(pool, child))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, pool: LocalPool) -> None:
        self._serial += 1
        name = f"{pool.name}-{self._serial}"
        pool.starting += 1
        try:
            child = await self.stack.start(name, [pool.name, *self.worker_args])
        except RuntimeError as e:
            pool.failed_at = self.clock()
            self.say(f"autoscale {pool.name}: {e}")
            return
        finally:
            pool.starting -= 1
        pool.serving.append(child)
        self.publish()
        self.say(f"[{time.strftime('%H:%M:%S')}] {name} is serving ({self.sizes()})")

    async def _retire(self, pool: LocalPool, child: Child) -> None:
        child.retiring = True
        await asyncio.sleep(UNPUBLISH_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGTERM)
        code = await child.proc.wait()
        pool.retiring.remove(child)
        self.say(
            f"[{time.strftime('%H:%M:%S')}] {child.name} drained and exited with {code} "
            f"({self.sizes()})"
        )
