"""Reads the autoscaler's signals straight from the processes' /metrics pages, for a deployment
with no Prometheus: local mode's `splitserve up --autoscale` (splitserve_workers/local_scaling.py).

It gives the same Signals as prometheus.py. Each scrape round (every target once) is kept for the
window; a counter's rate and a histogram's quantile come from the first and the last round in the
window that a target answered, the way rate() and histogram_quantile() read a range, and gauges
are read from the last round (running, waiting, KV usage) or averaged over the rounds
(mean running)."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .autoscaler import Signals
from .prometheus import MetricsError

# A /metrics page of one process is tens of KB; anything near this is not one.
MAX_PAGE_BYTES = 4 << 20
ROUTER = "router"

# (sample name, le) -> value, summed over the other labels (a process exports one service).
Page = dict[tuple[str, str], float]


@dataclass(frozen=True)
class Target:
    name: str  # the process (or pod) name, as pod_load() answers
    pool: str  # router | prefill | decode
    url: str  # its /metrics URL


def parse_page(text: str) -> Page:
    """Prometheus text format -> {(sample name, le): value}; ValueError if it is not that."""
    from prometheus_client.parser import text_string_to_metric_families

    page: Page = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("le", ""))
            page[key] = page.get(key, 0.0) + s.value
    return page


def buckets(page: Page, name: str) -> list[tuple[float, float]]:
    """One histogram's cumulative buckets [(le, count)], ascending."""
    wanted = name + "_bucket"
    return sorted((float(le), v) for (sample, le), v in page.items() if sample == wanted)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate from cumulative buckets (linear within the bucket; the +Inf bucket
    answers its lower bound). None without observations."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if le == math.inf:
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 1.0)
        prev_le, prev_count = le, count
    return prev_le


def fetch(url: str, timeout: float) -> Page:
    """One /metrics page, parsed; MetricsError says why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            raw = resp.read(MAX_PAGE_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise MetricsError(f"{url}: HTTP {e.code} {e.reason}") from e
    except Exception as e:  # refused, timed out, a broken HTTP answer: all "did not answer"
        raise MetricsError(f"{url}: {getattr(e, 'reason', None) or e!r}") from e
    if len(raw) > MAX_PAGE_BYTES:
        raise MetricsError(f"{url}: over {MAX_PAGE_BYTES} bytes")
    try:
        return parse_page(raw.decode())
    except ValueError as e:
        raise MetricsError(f"{url}: not Prometheus text: {e}") from e


@dataclass
class Round:
    time: float
    pages: dict[Target, Page]  # targets that answered
    failed: frozenset[Target] = frozenset()  # targets asked that did not


class DirectScraper:
    """Scrape rounds kept for `keep` seconds; read() turns the ones in a window into Signals."""

    def __init__(self, keep: float, timeout: float = 5.0) -> None:
        self.keep = keep
        self.timeout = timeout
        self.rounds: deque[Round] = deque()
        self.errors: dict[Target, str] = {}  # the last round's failures

    def scrape(self, targets: Iterable[Target], now: float) -> Round:
        """Fetch every target once (in parallel) and keep the round."""
        targets = list(targets)
        self.errors = {}
        pages: dict[Target, Page] = {}
        if targets:
            with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
                futures = {t: pool.submit(fetch, t.url, self.timeout) for t in targets}
                for target, future in futures.items():
                    try:
                        pages[target] = future.result()
                    except MetricsError as e:
                        self.errors[target] = str(e)
        return self.add(Round(now, pages, frozenset(self.errors)))

    def add(self, round_: Round) -> Round:
        self.rounds.append(round_)
        while self.rounds and self.rounds[0].time < round_.time - self.keep:
            self.rounds.popleft()
        return round_

    # ---- reading ---------------------------------------------------------------------------

    def _window(self, seconds: float) -> list[Round]:
        if not self.rounds:
            return []
        end = self.rounds[-1].time
        return [r for r in self.rounds if r.time >= end - seconds]

    def _answered(self, rounds: list[Round], pool: str) -> dict[Target, list[Round]]:
        """Each target of the pool: the rounds in the window it answered, oldest first."""
        seen: dict[Target, list[Round]] = {}
        for r in rounds:
            for target in r.pages:
                if target.pool == pool:
                    seen.setdefault(target, []).append(r)
        return seen

    def _rate(self, rounds: list[Round], pool: str, sample: str) -> float:
        """Sum over the pool's targets of the counter's per-second increase in the window,
        added up round to round so a restart anywhere in it counts from zero (a target seen
        once has no rate yet)."""
        key = (sample, "")
        total = 0.0
        for target, seen in self._answered(rounds, pool).items():
            if len(seen) < 2:
                continue
            increase = 0.0
            for a, b in zip(seen, seen[1:], strict=False):
                x, y = a.pages[target].get(key, 0.0), b.pages[target].get(key, 0.0)
                increase += y - x if y >= x else y
            total += increase / (seen[-1].time - seen[0].time)
        return total

    def _quantile(self, rounds: list[Round], q: float, name: str) -> float | None:
        """The histogram's quantile over the observations made in the window, all routers.
        Increases are added round to round; a round whose total count fell is a restart, and
        all its buckets count from zero (so the sum stays cumulative)."""
        merged: dict[float, float] = {}
        for target, seen in self._answered(rounds, ROUTER).items():
            for a, b in zip(seen, seen[1:], strict=False):
                before = dict(buckets(a.pages[target], name))
                after = buckets(b.pages[target], name)
                restarted = bool(after) and after[-1][1] < before.get(math.inf, 0.0)
                for le, count in after:
                    grew = count if restarted else max(0.0, count - before.get(le, 0.0))
                    merged[le] = merged.get(le, 0.0) + grew
        return histogram_quantile(q, sorted(merged.items()))

    def _mean_sum(self, rounds: list[Round], pool: str, sample: str) -> float:
        """The pool's sum of a gauge, averaged over the window's rounds. A target that was asked
        but did not answer keeps its last value (it did not drop to zero); one no longer asked
        (a removed pod) stops counting, as a stale series does in Prometheus."""
        key = (sample, "")
        last: dict[Target, float] = {}
        sums = []
        for r in rounds:
            now = {t: page[key] for t, page in r.pages.items() if t.pool == pool and key in page}
            last = {t: v for t, v in last.items() if t in r.failed} | now
            sums.append(sum(last.values()))
        return sum(sums) / len(sums) if sums else 0.0

    def _last_pages(self, pool: str) -> dict[Target, Page]:
        """The pool's targets asked in the last round, each with its last page: a target that
        did not answer this round keeps the last page it answered with (one slow scrape is
        not a pod gone, and its rates still count it), as in _mean_sum."""
        if not self.rounds:
            return {}
        last = self.rounds[-1]
        out = {t: page for t, page in last.pages.items() if t.pool == pool}
        for target in last.failed:
            if target.pool != pool:
                continue
            for r in reversed(self.rounds):
                if target in r.pages:
                    out[target] = r.pages[target]
                    break
        return out

    def _latest(self, pool: str, sample: str) -> list[float]:
        """The sample's value on each of the pool's targets, from their last pages."""
        return [
            page[(sample, "")] for page in self._last_pages(pool).values() if (sample, "") in page
        ]

    def read(self, percentile: float, window_seconds: float) -> dict[str, Signals]:
        """Signals of the prefill and decode pools over the last window. MetricsError when no
        router answered the last round: its histograms are the latency signals."""
        if not self.rounds:
            raise MetricsError("nothing scraped yet")
        if not any(t.pool == ROUTER for t in self.rounds[-1].pages):
            failed = [e for t, e in self.errors.items() if t.pool == ROUTER]
            raise MetricsError(f"the router's /metrics did not answer: {'; '.join(failed)}")
        q = percentile / 100.0
        rounds = self._window(window_seconds)
        request_rate = self._rate(rounds, ROUTER, "splitserve_requests_total")
        in_flight = sum(self._latest(ROUTER, "splitserve_router_requests_in_flight"))
        admission = self._quantile(rounds, q, "splitserve_decode_admission_seconds")
        signals: dict[str, Signals] = {}
        for pool in ("prefill", "decode"):
            common: dict[str, Any] = dict(
                reporting=len(self._latest(pool, "splitserve_requests_running")),
                busy_series=len(self._latest(pool, "splitserve_busy_seconds_total")),
                busy=self._rate(rounds, pool, "splitserve_busy_seconds_total"),
                running=sum(self._latest(pool, "splitserve_requests_running")),
                mean_running=self._mean_sum(rounds, pool, "splitserve_requests_running"),
                waiting=sum(self._latest(pool, "splitserve_requests_waiting")),
                request_rate=request_rate,
                in_flight=in_flight,
                decode_admission=admission,
            )
            if pool == "prefill":
                signals[pool] = Signals(
                    latency=self._quantile(rounds, q, "splitserve_time_to_first_token_seconds"),
                    prefill_queue=self._quantile(rounds, q, "splitserve_prefill_queue_seconds"),
                    **common,
                )
            else:
                usage = self._latest(pool, "splitserve_kv_cache_usage_ratio")
                signals[pool] = Signals(
                    latency=self._quantile(rounds, q, "splitserve_time_per_output_token_seconds"),
                    kv_usage=sum(usage) / len(usage) if usage else None,
                    **common,
                )
        return signals

    def pod_load(self, pool: str) -> dict[str, float]:
        """Sequences each target of a pool holds now (running + waiting), by name."""
        return {
            t.name: page.get(("splitserve_requests_running", ""), 0.0)
            + page.get(("splitserve_requests_waiting", ""), 0.0)
            for t, page in self._last_pages(pool).items()
        }

    def limit(self, pool: str, sample: str) -> int:
        """A configured-limit gauge the pool's workers export (the largest; 0 if none)."""
        return int(max(self._latest(pool, sample), default=0.0))
