"""The built-in autoscaler's decision core (autoscaling.mode Builtin, and `splitserve up
--autoscale`). Pure: measured signals in (prometheus.py reads them from Prometheus, scrape.py
from the pods' /metrics pages), replicas per pool and the reason out; scaling.py applies the
result and writes it to status and Events (local_scaling.py starts and drains processes).

Each pool is sized on its own, from what it measures, never from the replica count it set:
- prefill: engine utilization (busy seconds per second, per replica) against a target, and the
  TTFT percentile against the objective when queueing for prefill is what makes it late;
- decode: the TPOT percentile against the objective, KV cache usage, and sequences waiting for
  a batch slot.
Scale-up acts at once, by at most MAX_SCALE_UP_FACTOR per evaluation. Scale-down goes to the
fewest replicas whose predicted load (today's load spread over fewer replicas) still meets every
target, and only once every recommendation in the stabilization window agrees; the workers drain
what they run on SIGTERM, and the idlest pods go first (pod-deletion-cost, set by handlers.py)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

# A signal must exceed its target by this fraction before it scales up (no flapping on noise).
TOLERANCE = 0.1
# Prefill: busy fraction per replica to size for; the rest absorbs bursts before TTFT suffers.
PREFILL_TARGET_UTILIZATION = 0.7
# Decode: KV cache fraction per replica to size for (sequences grow while they decode).
DECODE_TARGET_KV_USAGE = 0.8
# TTFT over its objective scales prefill only when queueing for prefill is this much of it.
PREFILL_QUEUE_SHARE = 0.2
MAX_SCALE_UP_FACTOR = 2.0
# Decode's TPOT model, TPOT = alpha + beta x batch (sequences per replica), is fitted to the
# (batch, TPOT percentile) pairs of the most recent evaluations once they are this many and
# this far apart; it is used while it explains the TPOT measured now within this fraction
# (otherwise TPOT is taken to grow in proportion to the batch, which overstates it).
TPOT_MODEL_POINTS = 120
TPOT_MODEL_MIN_POINTS = 6
TPOT_MODEL_MIN_SPREAD = 2.0
TPOT_MODEL_MAX_ERROR = 0.25
# ...and only a line that explains most of the variation (R^2): TPOT flat with noise is no line.
TPOT_MODEL_MIN_R2 = 0.6
# "No batch meets the objective" is believed only from small batches actually seen.
TPOT_MODEL_SMALL_BATCH = 4.0
# Signals are rates over this many evaluation intervals (and at least MIN_WINDOW_SECONDS), so
# one quiet or busy scrape does not decide alone.
WINDOW_INTERVALS = 4
MIN_WINDOW_SECONDS = 30.0

# Verdicts, as written to status (autoscaler.<pool>.lastDecision.verdict).
SCALE_UP = "ScaleUp"
SCALE_DOWN = "ScaleDown"
STEADY = "Steady"
STABILIZING = "Stabilizing"
WAITING_FOR_PODS = "WaitingForPods"
# How long a scale-up waits for pods that do not become ready (crash-looping, unschedulable)
# before it adds capacity without them: a Deployment's default progress deadline.
POD_START_DEADLINE_S = 600.0
SETTLING = "Settling"
ROLLING_OUT = "RollingOut"
NO_METRICS = "NoMetrics"
AT_MAX = "AtMaxReplicas"
AT_MIN = "AtMinReplicas"
GPU_BUDGET = "GPUBudget"
RATIO_BOUND = "RatioBound"  # raised (or held up) to keep prefill:decode within bounds
RATIO_LIMITED = "RatioLimited"  # a scale-up trimmed because the other pool cannot follow
LIMITED = frozenset({AT_MAX, GPU_BUDGET, RATIO_LIMITED})

# The autoscaler's own state (status.autoscaler.state, scaling.py), read by the Autoscaling
# condition (status.py).
ACTIVE = "Active"
METRICS_UNAVAILABLE = "MetricsUnavailable"


@dataclass(frozen=True)
class Objectives:
    ttft_seconds: float
    tpot_seconds: float
    percentile: float


@dataclass(frozen=True)
class Targets:
    """The load each replica is sized for (spec.autoscaling.targets; the defaults above)."""

    prefill_utilization: float = PREFILL_TARGET_UTILIZATION
    kv_cache_usage: float = DECODE_TARGET_KV_USAGE
    prefill_queue_share: float = PREFILL_QUEUE_SHARE


@dataclass(frozen=True)
class RatioBounds:
    """Prefill replicas per decode replica (spec.autoscaling.prefillPerDecode): at least `low`,
    at most `high` (None: unbounded)."""

    low: float | None = None
    high: float | None = None


def unreachable_ratio(
    ratio: RatioBounds, prefill: tuple[int, int], decode: tuple[int, int]
) -> str | None:
    """ "max" or "min" when that bound can never hold given each pool's (minReplicas,
    maxReplicas); "both" when each can but no whole replica counts meet both at once (min =
    max = 0.4 with one prefill replica, or only both pools at zero); None when some counts with
    a replica in them do."""
    eps = 1e-9
    if ratio.high is not None and prefill[0] > ratio.high * decode[1] + eps:
        return "max"  # the fewest prefill replicas need more decode replicas than allowed
    if ratio.low is not None and prefill[1] < ratio.low * decode[0] - eps:
        return "min"
    for p in range(prefill[0], prefill[1] + 1):
        d_lo = decode[0] if ratio.high is None else max(decode[0], math.ceil(p / ratio.high - eps))
        d_hi = decode[1] if not ratio.low else min(decode[1], math.floor(p / ratio.low + eps))
        if d_lo <= d_hi and p + d_hi > 0:  # both pools at zero serve nothing
            return None
    return "both"


@dataclass(frozen=True)
class PoolState:
    """What the pool's Deployment and spec say."""

    name: str  # prefill | decode
    replicas: int  # the Deployment's spec.replicas
    ready: int
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int = 0
    max_batch_size: int = 0  # decode: sequences per iteration per replica
    rolling_out: bool = False  # a new pod template is replacing the pods
    # Pods placed but failing to run (crash loop, image pull, ...: status.failing_pods), and
    # why, in pod_trouble's words. Waiting does not make them ready.
    failing: int = 0
    failing_why: str = ""


@dataclass(frozen=True)
class Signals:
    """One pool's measurements over the evaluation window (None: no samples in the window)."""

    reporting: int  # worker pods whose metrics were read (Prometheus or a direct scrape)
    latency: float | None = None  # TTFT (prefill) or TPOT (decode) percentile at the router
    prefill_queue: float | None = None  # TTFT stage percentiles, at the router
    decode_admission: float | None = None
    busy: float = 0.0  # sum over pods of busy seconds per second
    running: float = 0.0  # now
    waiting: float = 0.0  # now
    mean_running: float | None = None  # averaged over the window (None: not asked)
    kv_usage: float | None = None  # mean over pods
    request_rate: float = 0.0  # requests per second finishing at the router
    in_flight: float = 0.0  # requests the router serves now
    busy_series: int | None = None  # pods exporting busy seconds (None: not asked)
    # False: busy seconds are exported but no pod has the two samples in the window a rate
    # needs (a Prometheus that just started, or lost its data), so `busy` is unknown, not 0.
    busy_rated: bool = True


@dataclass(frozen=True)
class TpotModel:
    """TPOT at the objective's percentile = alpha + beta x batch, learned online."""

    alpha: float  # seconds: the part of a decode step no batch size removes
    beta: float  # seconds per sequence in the batch
    points: int
    smallest_batch: float = 1.0  # the smallest batch per replica among the points

    def predict(self, batch: float) -> float:
        return self.alpha + self.beta * max(batch, 1.0)

    def batch_for(self, tpot: float) -> float:
        """The largest batch per replica predicted to meet `tpot` (below 1: none does)."""
        return (tpot - self.alpha) / self.beta

    def explains(self, batch: float, tpot: float) -> bool:
        return abs(self.predict(batch) - tpot) <= TPOT_MODEL_MAX_ERROR * tpot

    def through(self, batch: float, tpot: float) -> TpotModel:
        """The same slope through today's point: predictions start from what is measured."""
        return replace(self, alpha=max(0.0, tpot - self.beta * max(batch, 1.0)))

    def describe(self) -> str:
        return f"{_ms(self.alpha)} + {_ms(self.beta)} x batch, from {self.points} evaluations"


def fit_tpot(points: list[tuple[float, float]]) -> TpotModel | None:
    """Least squares over (batch per replica, TPOT) pairs; None while they are too few or too
    close together, or the line they give is not a cost that grows with the batch, or it
    explains too little of how TPOT varied."""
    if len(points) < TPOT_MODEL_MIN_POINTS:
        return None
    xs = [x for x, _ in points]
    if max(xs) - min(xs) < TPOT_MODEL_MIN_SPREAD:
        return None
    n = len(points)
    mx, my = sum(xs) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in points) / var
    alpha = my - beta * mx
    if beta <= 0 or alpha < 0:
        return None
    total = sum((y - my) ** 2 for _, y in points)
    residual = sum((y - alpha - beta * x) ** 2 for x, y in points)
    if total <= 0 or 1 - residual / total < TPOT_MODEL_MIN_R2:
        return None
    return TpotModel(alpha, beta, n, min(xs))


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    replicas: int
    verdict: str
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        return self.replicas != self.current


def window_seconds(interval: float, scrape_interval: float) -> float:
    """Long enough to hold several evaluations and several scrapes (a rate over a window with
    one sample is no rate)."""
    return max(MIN_WINDOW_SECONDS, WINDOW_INTERVALS * interval, WINDOW_INTERVALS * scrape_interval)


# An HPA takes a scale-down window of at most an hour and a policy period of at most 30 min.
HPA_MAX_STABILIZATION_SECONDS = 3600
HPA_MAX_PERIOD_SECONDS = 1800


def hpa_behavior(interval: float, stabilization: float) -> dict[str, Any]:
    """These rules as an autoscaling/v2 HPA `behavior` (modes HPA and KEDA): up at once by at
    most MAX_SCALE_UP_FACTOR (or +1) per evaluation interval; down after the stabilization
    window."""
    period = max(1, min(HPA_MAX_PERIOD_SECONDS, round(interval)))
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {
                    "type": "Percent",
                    "value": round((MAX_SCALE_UP_FACTOR - 1) * 100),
                    "periodSeconds": period,
                },
                {"type": "Pods", "value": 1, "periodSeconds": period},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": min(HPA_MAX_STABILIZATION_SECONDS, round(stabilization))
        },
    }


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    ms = seconds * 1000
    if ms >= 10 or ms == 0:
        return f"{ms:.0f}ms"
    # Small objectives: 4.4ms must not read "4ms is above the objective 4ms".
    return f"{ms:.3g}ms" if ms >= 1 else f"{ms:.2g}ms"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _scale_up(current: int, ratio: float) -> int:
    """HPA's proportional step (current x ratio), at least +1, at most MAX_SCALE_UP_FACTOR x."""
    want = math.ceil(current * ratio - 1e-9)
    return max(current + 1, min(want, math.ceil(current * MAX_SCALE_UP_FACTOR)))


def _fewest(current: int, fits: Any) -> int:
    """The fewest replicas in [0, current] for which fits(n) holds (current if none does)."""
    for n in range(0, current + 1):
        if fits(n):
            return n
    return current


def _idle(sig: Signals) -> bool:
    """Nothing in the window and nothing now: the only load that zero replicas carry."""
    return (
        sig.latency is None
        and sig.request_rate == 0
        and sig.in_flight == 0
        and sig.busy == 0
        and sig.running == 0
        and sig.waiting == 0
    )


def _from_zero(state: PoolState, sig: Signals) -> tuple[int, str, str] | None:
    if state.replicas > 0:
        return None
    if sig.request_rate > 0 or sig.in_flight > 0:
        return 1, SCALE_UP, "requests are arriving and the pool has no replicas"
    return 0, STEADY, "no requests and no replicas"


def recommend_prefill(
    state: PoolState, sig: Signals, obj: Objectives, targets: Targets = Targets()
) -> tuple[int, str, str]:
    """(replicas, verdict, reason) of a pool with replicas, before bounds, stabilization and
    the GPU budget."""
    target = targets.prefill_utilization
    share = targets.prefill_queue_share
    n = state.replicas
    per = max(sig.reporting, 1)
    utilization = sig.busy / per
    pct = f"p{obj.percentile:g}"
    up: list[tuple[float, str]] = []
    if utilization > target * (1 + TOLERANCE):
        up.append(
            (
                utilization / target,
                f"utilization {utilization:.0%} is above the target {target:.0%}",
            )
        )
    late = sig.latency is not None and sig.latency > obj.ttft_seconds * (1 + TOLERANCE)
    queue_share = (sig.prefill_queue or 0.0) / sig.latency if sig.latency else 0.0
    if late and queue_share >= share:
        assert sig.latency is not None
        up.append(
            (
                sig.latency / obj.ttft_seconds,
                f"TTFT {pct} {_ms(sig.latency)} is above the objective {_ms(obj.ttft_seconds)} "
                f"and {queue_share:.0%} of it is queueing for prefill",
            )
        )
    if up:
        ratio, why = max(up)
        return _scale_up(n, ratio), SCALE_UP, why
    over = sig.latency is not None and sig.latency > obj.ttft_seconds
    elsewhere = ""
    if over and queue_share < share:
        # Late, but not for lack of prefill: say where the time goes.
        elsewhere = (
            f"; TTFT {pct} {_ms(sig.latency)} is above the objective {_ms(obj.ttft_seconds)}, "
            f"but queueing for prefill is only {queue_share:.0%} of it (decode admission "
            f"{_ms(sig.decode_admission)}): more prefill replicas would not help"
        )

    def fits(m: int) -> bool:
        if m == 0:
            return _idle(sig)
        return sig.busy / m <= target

    need = _fewest(n, fits)
    if need < n and over:
        # Whatever makes TTFT late, fewer prefill replicas would only add queueing to it (and
        # shrinking on utilization here and growing on queueing there would flap). Decode's
        # own signals fix a decode-side cause; prefill shrinks once TTFT is back.
        return (
            n,
            STEADY,
            f"utilization {utilization:.0%}{elsewhere}; not scaling prefill down while TTFT "
            f"{pct} {_ms(sig.latency)} misses its objective {_ms(obj.ttft_seconds)}",
        )
    if need < n:
        after = sig.busy / need if need else 0.0
        return (
            need,
            SCALE_DOWN,
            f"utilization {utilization:.0%} on {n}; {need} would run at {after:.0%} "
            f"(target {target:.0%})",
        )
    if over:
        return n, STEADY, f"utilization {utilization:.0%}{elsewhere}"
    return (
        n,
        STEADY,
        f"utilization {utilization:.0%}, TTFT {pct} {_ms(sig.latency)}: within targets",
    )


def usable_tpot(model: TpotModel | None, sig: Signals) -> TpotModel | None:
    """The learned line, moved through today's (batch, TPOT), if it explains today's TPOT
    within TPOT_MODEL_MAX_ERROR; None otherwise (the workload changed: longer contexts, another
    model). The batch is what the points are: running sequences per replica."""
    if model is None or sig.latency is None or not sig.reporting:
        return None
    batch = max(sig.running, sig.mean_running or 0.0) / sig.reporting
    if not model.explains(batch, sig.latency):
        return None
    return model.through(batch, sig.latency)


def recommend_decode(
    state: PoolState,
    sig: Signals,
    obj: Objectives,
    targets: Targets = Targets(),
    model: TpotModel | None = None,
) -> tuple[int, str, str]:
    n = state.replicas
    kv_target = targets.kv_cache_usage
    per = max(sig.reporting, 1)
    pct = f"p{obj.percentile:g}"
    kv = sig.kv_usage or 0.0
    # The sequences to place: the larger of now and the window's mean, so one quiet scrape
    # does not stand for the window whose TPOT was measured.
    load = max(sig.running, sig.mean_running or 0.0) + sig.waiting
    # model: usable_tpot's line (None: TPOT is taken to grow in proportion to the batch).
    up: list[tuple[float, str]] = []
    hopeless = ""
    if sig.latency is not None and sig.latency > obj.tpot_seconds * (1 + TOLERANCE):
        late = f"TPOT {pct} {_ms(sig.latency)} is above the objective {_ms(obj.tpot_seconds)}"
        if model is None:
            up.append((sig.latency / obj.tpot_seconds, late))
        elif (batch := model.batch_for(obj.tpot_seconds)) < 1 and (
            load / per <= TPOT_MODEL_SMALL_BATCH
        ):
            # Measured at a small batch already, not extrapolated to one.
            hopeless = (
                f"; {late} and one sequence per replica is predicted at "
                f"{_ms(model.predict(1))} (TPOT = {model.describe()}): more decode replicas "
                "would not help"
            )
        elif batch < 1:  # an extrapolation to batches not running now: do not trust it
            up.append((sig.latency / obj.tpot_seconds, late))
        else:
            up.append(
                (
                    load / batch / n if n else 1.0,
                    f"{late}; {batch:.1f} sequences per replica meet it (TPOT = "
                    f"{model.describe()})",
                )
            )
    if kv > kv_target * (1 + TOLERANCE):
        up.append((kv / kv_target, f"KV cache usage {kv:.0%} is above the target {kv_target:.0%}"))
    slots = per * state.max_batch_size
    if sig.waiting > 0 and slots and sig.running >= slots:
        up.append(
            (
                (sig.running + sig.waiting) / slots,
                f"{sig.waiting:g} sequences wait for a batch slot ({sig.running:g} running, "
                f"{state.max_batch_size} per replica)",
            )
        )
    if up:
        ratio, why = max(up)
        return _scale_up(n, ratio), SCALE_UP, why

    def tpot_on(m: int) -> float | None:
        # Today's sequences spread over m replicas: on the learned line, or else TPOT taken to
        # grow in proportion to the batch above one sequence, which overstates it (a decode
        # step has a fixed part), so that errs toward more replicas.
        if sig.latency is None:
            return None
        if model is not None:
            return model.predict(load / max(m, 1))
        now, after = max(load / per, 1.0), max(load / max(m, 1), 1.0)
        return sig.latency * after / now

    how = f"learned TPOT = {model.describe()}" if model else "TPOT taken proportional to batch"

    # Past the objective whatever the batch: fewer replicas are fine while they are predicted
    # no slower than today (the fixed step time must not keep a pool large).
    ceiling = obj.tpot_seconds
    if hopeless and model is not None:
        ceiling = max(ceiling, model.predict(load / max(n, 1)))

    def fits(m: int) -> bool:
        if m == 0:
            return _idle(sig)
        scale = per / m
        predicted = tpot_on(m)
        if predicted is not None and predicted > ceiling + 1e-12:
            return False
        if kv * scale > kv_target:
            return False
        return not (state.max_batch_size and load / m > state.max_batch_size)

    need = _fewest(n, fits)
    if need < n:
        return (
            need,
            SCALE_DOWN,
            f"{need} replicas would carry today's load: predicted TPOT {pct} "
            f"{_ms(tpot_on(need))} "
            f"(objective {_ms(obj.tpot_seconds)}; {how}), KV usage "
            f"{kv * per / max(need, 1):.0%}",
        )
    if hopeless:
        return n, STEADY, f"KV usage {kv:.0%}, {sig.running:g} running{hopeless}"
    return (
        n,
        STEADY,
        f"TPOT {pct} {_ms(sig.latency)}, KV usage {kv:.0%}, {sig.running:g} running: "
        "within targets",
    )


@dataclass
class History:
    """Recent recommendations of one pool (time, replicas), for the stabilization window. It
    lives in the operator's memory: after a restart, scale-down waits for a full window."""

    samples: deque[tuple[float, int]] = field(default_factory=deque)
    since: float | None = None
    last_scale_up: float | None = None
    # The signals describe the pool the last scale-up made only from here: the later of that
    # scale-up and the last evaluation that was still waiting for the pods it added.
    settle_from: float | None = None
    last_change: float | None = None  # any change of replicas, up or down
    waiting_since: float | None = None  # since when some pods are not ready (None: all are)
    # When a scale-up last went around pods that fail to run, and how many: more of them within
    # a start deadline are waited for like starting pods, so failures the new pods share (a
    # registry outage old nodes escape by a cached image) grow the pool by one step per
    # deadline, as before, not by one per settle window.
    went_around_at: float | None = None
    gone_around: int = 0
    # decode: (sequences per replica, TPOT percentile) of recent evaluations, for fit_tpot
    tpot_points: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=TPOT_MODEL_POINTS)
    )
    tpot_percentile: float | None = None  # the objectives' percentile the points measure

    def resume(self, now: float, gap: float) -> None:
        """Called before an evaluation adds its recommendation: after none for longer than `gap`
        (metrics were down, the operator stalled), the time between went unwatched, and a window
        holding one fresh sample is no agreement: scale-down waits a whole window again."""
        if self.samples and now - self.samples[-1][0] > gap:
            self.samples.clear()
            self.since = now

    def add(self, now: float, replicas: int, window: float) -> None:
        if self.since is None:
            self.since = now
        self.samples.append((now, replicas))
        while self.samples and self.samples[0][0] < now - window:
            self.samples.popleft()

    def highest(self) -> int:
        return max(r for _, r in self.samples)


def stabilize(
    current: int, want: int, verdict: str, reason: str, history: History, now: float,
    window: float, cap: int,
) -> tuple[int, str, str]:  # fmt: skip
    """Scale-down only to the highest recommendation of the last `window` seconds, and only
    once this operator has watched a whole window. Recommendations are remembered capped at
    maxReplicas (`cap`): wanting more than the bound allows must not block a scale-down."""
    history.add(now, min(want, cap), window)
    if want >= current:
        return want, verdict, reason
    assert history.since is not None
    watched = now - history.since
    floor = history.highest()
    if watched < window:
        return (
            current,
            STABILIZING,
            f"{reason}; scale-down to {want} waits for {window:.0f}s of lower recommendations "
            f"({watched:.0f}s so far)",
        )
    if floor >= current:
        return (
            current,
            STABILIZING,
            f"{reason}; scale-down waits: {floor} replicas were needed within the last "
            f"{window:.0f}s",
        )
    if floor > want:
        reason = f"{reason}; to {floor} first, the most recommended within the last {window:.0f}s"
    elif floor < want:
        reason = f"{reason}; to {floor}, its maxReplicas"
    return floor, verdict, reason


def bound(state: PoolState, want: int, verdict: str, reason: str) -> tuple[int, str, str]:
    """Clamp to [minReplicas, maxReplicas]; the verdict says when a bound decided."""
    low, high = state.min_replicas, state.max_replicas
    if want > high:
        if verdict == SCALE_UP and state.replicas <= high:
            return high, AT_MAX, f"{reason}; limited by maxReplicas {high}"
        want = high
    want = max(want, low)
    if want < state.replicas and verdict != SCALE_DOWN:
        return want, SCALE_DOWN, f"above maxReplicas {high}"
    if want > state.replicas and verdict != SCALE_UP:
        return want, SCALE_UP, f"below minReplicas {low}"
    if want == state.replicas and verdict == SCALE_DOWN:
        return want, AT_MIN, f"{reason}; held at minReplicas {low}"
    return want, verdict, reason


def decide(
    states: dict[str, PoolState],
    signals: dict[str, Signals],
    objectives: Objectives,
    histories: dict[str, History],
    now: float,
    window: float,
    gpu_budget: int | None = None,
    settle: float = 0.0,
    source: str = "Prometheus",
    ratio: RatioBounds | None = None,
    targets: Targets = Targets(),
) -> dict[str, Decision]:
    """One evaluation for both pools: replicas, verdict and reason each. window: the
    scale-down stabilization; settle: how long after a scale-up the signals still describe
    the pool before it (their rate window), during which it does not scale up again. source:
    who reads the pods' metrics (Prometheus, or the operator scraping them), for the reasons.
    ratio: bounds on prefill replicas per decode replica, applied after the GPU budget.
    targets: the per-replica load to size for."""
    decisions: dict[str, Decision] = {}
    urgency: dict[str, float] = {}
    for pool, state in states.items():
        sig = signals[pool]
        inputs = signal_inputs(state, sig)
        history = histories.setdefault(pool, History())
        # Evaluations come every interval, and the signals' window spans several: only a
        # longer pause than both (and than the stabilization window) is a gap in the watch.
        history.resume(now, max(window, settle))
        missing = _unmeasured(pool, state, sig, source)
        if missing is not None:
            held = bound(state, state.replicas, NO_METRICS, missing)
            # Unmeasured is not idle: the replicas it holds count as recommended, so a
            # scale-down once the series are back waits a whole window past them.
            history.add(now, held[0], window)
            decisions[pool] = Decision(pool, state.replicas, *held, inputs)
            continue
        scraped = sig.reporting
        if 0 < scraped < state.ready:
            # Pods not scraped yet carry load too: assume the scraped average.
            f = state.ready / scraped
            sig = replace(
                sig, reporting=state.ready, busy=sig.busy * f, running=sig.running * f,
                waiting=sig.waiting * f,
                mean_running=None if sig.mean_running is None else sig.mean_running * f,
            )  # fmt: skip
        if pool == "prefill":
            recommended = recommend_prefill(state, sig, objectives, targets)
        else:
            # A new pod template (another image, batch limit or cache) or another percentile
            # makes another line: learn it afresh.
            if state.rolling_out or history.tpot_percentile != objectives.percentile:
                history.tpot_points.clear()
                history.tpot_percentile = objectives.percentile
            # Fitted to earlier evaluations, then this one joins them.
            model = usable_tpot(fit_tpot(list(history.tpot_points)), sig)
            recommended = recommend_decode(state, sig, objectives, targets, model)
            if model is not None:
                inputs["tpotModel"] = {
                    "alphaSeconds": _round(model.alpha),
                    "betaSecondsPerSequence": round(model.beta, 6),
                    "evaluations": model.points,
                }
            steady = (
                not state.rolling_out
                and state.replicas == state.ready == scraped
                and (history.last_change is None or now - history.last_change >= settle)
            )
            if steady and sig.latency is not None and sig.mean_running is not None:
                # A point is one window of one pool size: the window's batch and its TPOT.
                batch = sig.mean_running / max(scraped, 1)
                if batch >= 1:
                    history.tpot_points.append((batch, sig.latency))
        want, verdict, reason = _from_zero(state, sig) or recommended
        urgency[pool] = want / max(state.replicas, 1)
        if want < state.min_replicas < state.replicas and verdict == SCALE_DOWN:
            reason = f"{reason}; to {state.min_replicas}, its minReplicas"
        want = max(want, state.min_replicas)  # no stabilizing toward what minReplicas forbids
        not_ready = state.replicas - state.ready
        # Pods that fail to run (a crash loop, an image that does not pull) are not waited for
        # when pods of the same template serve: the template works, the failure is where the
        # pod landed (a bad node), so waiting would only hold the SLO breach. Not during a
        # rollout (the new template may be what fails) nor with no pod serving.
        failing = 0
        recently = (
            history.went_around_at is not None
            and now - history.went_around_at < POD_START_DEADLINE_S
        )
        if state.failing > 0 and state.ready > 0 and not state.rolling_out:
            failing = min(state.failing, max(not_ready, 0))
            if recently:
                failing = min(failing, history.gone_around)
        starting = not_ready - failing  # pods that may still become ready
        unscraped = state.ready - scraped
        if starting <= 0:
            history.waiting_since = None
        elif history.waiting_since is None:
            history.waiting_since = now
        # Pods not ready past the deadline (a crash loop, no node for them) are not waited
        # for: the pool would otherwise never grow while its SLO is missed.
        not_ready_for = 0.0 if history.waiting_since is None else now - history.waiting_since
        stuck = starting > 0 and not_ready_for >= POD_START_DEADLINE_S
        if stuck and verdict == SCALE_UP:
            reason = (
                f"{reason}; {starting} pods have not become ready in {not_ready_for:.0f}s "
                f"(the start deadline is {POD_START_DEADLINE_S:.0f}s): adding capacity "
                "without them"
            )
        if (
            (starting > 0 and not stuck or unscraped > 0)
            and history.settle_from is not None
            and now - history.settle_from < settle
        ):
            # The pods the last scale-up added are not measured yet: its window starts later.
            history.settle_from = now
        if (
            verdict == SCALE_UP
            and state.replicas < state.max_replicas
            and (starting > 0 and not stuck or unscraped > 0)
        ):
            # Pods added earlier are not measured yet: one breach must not be answered twice.
            history.add(now, min(want, state.max_replicas), window)
            waiting_for = (
                f"{starting} pods to become ready"
                if starting > 0
                else f"{source} to scrape {unscraped} new pods"
            )
            want, verdict, reason = (
                state.replicas,
                WAITING_FOR_PODS,
                f"{reason}; waiting for {waiting_for} before adding more",
            )
        elif (
            verdict == SCALE_UP
            and state.replicas < state.max_replicas
            and history.last_scale_up is not None
            and history.settle_from is not None
            and now - history.settle_from < settle
        ):
            history.add(now, min(want, state.max_replicas), window)
            ago = now - history.last_scale_up
            measured = now - history.settle_from
            why = (
                f"the last scale-up {ago:.0f}s ago is not in the {settle:.0f}s of metrics yet"
                if measured >= ago
                else f"the pods the last scale-up added ({ago:.0f}s ago) are in {measured:.0f}s "
                f"of the {settle:.0f}s of metrics so far"
            )
            want, verdict, reason = (
                state.replicas,
                SETTLING,
                f"{reason}; {why}: not adding more before it is",
            )
        else:
            want, verdict, reason = stabilize(
                state.replicas, want, verdict, reason, history, now, window, state.max_replicas
            )
        if failing and verdict == SCALE_UP and (starting <= 0 or stuck):
            if not recently:
                history.went_around_at, history.gone_around = now, failing
            why = f" ({state.failing_why})" if state.failing_why else ""
            reason = (
                f"{reason}; {failing} pods fail to run{why} where pods of the same template "
                "serve: adding capacity without them"
            )
        if verdict == SCALE_DOWN and state.rolling_out:
            # Restarting pods skew every signal, and the ReplicaSets are busy: shrink after.
            want, verdict, reason = (
                state.replicas,
                ROLLING_OUT,
                f"{reason}; not scaling down while a rollout replaces the pods",
            )
        want, verdict, reason = bound(state, want, verdict, reason)
        decisions[pool] = Decision(pool, state.replicas, want, verdict, reason, inputs)
    if gpu_budget is not None:
        decisions = _within_budget(states, decisions, urgency, gpu_budget)
    if ratio is not None and {"prefill", "decode"} <= decisions.keys():
        decisions = _within_ratio(states, decisions, ratio, gpu_budget)
    _remember_changes(histories, decisions, now)
    return decisions


def hold(
    states: dict[str, PoolState],
    histories: dict[str, History],
    now: float,
    window: float,
    reason: str,
    settle: float = 0.0,
) -> dict[str, Decision]:
    """An evaluation without signals (the metrics source is unavailable): each pool stays
    where it is, within its [minReplicas, maxReplicas] (a bound changed meanwhile still
    applies), and that counts as its recommendation, as in decide's NoMetrics."""
    decisions: dict[str, Decision] = {}
    for pool, state in states.items():
        history = histories.setdefault(pool, History())
        history.resume(now, max(window, settle))
        held = bound(state, state.replicas, NO_METRICS, reason)
        history.add(now, held[0], window)
        inputs = {"replicas": state.replicas, "readyReplicas": state.ready}
        decisions[pool] = Decision(pool, state.replicas, *held, inputs)
    _remember_changes(histories, decisions, now)
    return decisions


def _unmeasured(pool: str, state: PoolState, sig: Signals, source: str) -> str | None:
    """Why the pool's signals cannot be trusted this evaluation (None: they can)."""
    if state.ready > 0 and sig.reporting == 0:
        hint = (
            "is it scraping them?" if source == "Prometheus" else "can it reach their metrics port?"
        )
        return (
            f"{state.ready} pods are ready but {source} has no "
            f"splitserve_requests_running series for the {pool} pool: {hint}"
        )
    if pool != "prefill":
        return None
    if sig.busy_series is not None and sig.busy_series < sig.reporting:
        return (
            f"{sig.reporting - sig.busy_series} of {sig.reporting} prefill pods export no "
            "splitserve_busy_seconds_total (workers older than this operator?): "
            "utilization cannot be measured"
        )
    if sig.busy_series and not sig.busy_rated:
        return (
            f"{source} holds fewer than two samples of splitserve_busy_seconds_total in the "
            "window for every prefill pod (did it just start?): utilization cannot be "
            "measured yet"
        )
    return None


def _remember_changes(
    histories: dict[str, History], decisions: dict[str, Decision], now: float
) -> None:
    for pool, d in decisions.items():
        if d.replicas > d.current:
            histories.setdefault(pool, History()).last_scale_up = now
            histories[pool].settle_from = now
            histories[pool].waiting_since = None  # the pods it adds get a deadline of their own
        if d.replicas != d.current:
            histories.setdefault(pool, History()).last_change = now


def _within_budget(
    states: dict[str, PoolState],
    decisions: dict[str, Decision],
    urgency: dict[str, float],
    budget: int,
) -> dict[str, Decision]:
    """Trim scale-ups, least urgent pool first, until prefill + decode GPUs fit the budget.
    It never scales a pool down to make room: that is the scale-down rules' call."""

    out = dict(decisions)
    growing = sorted(
        (p for p, d in out.items() if d.replicas > d.current and states[p].gpus_per_replica),
        key=lambda p: urgency.get(p, 0.0),
    )
    for pool in growing:
        d = out[pool]
        gpus = states[pool].gpus_per_replica
        floor = max(d.current, states[pool].min_replicas)
        while d.replicas > floor and used_with(out, states, pool, d.replicas) > budget:
            d = replace(d, replicas=d.replicas - 1)
        if d.replicas != out[pool].replicas:
            d = replace(
                d,
                verdict=GPU_BUDGET,
                reason=f"{d.reason}; limited by gpuBudget {budget} ({gpus} GPUs per replica)",
            )
        out[pool] = d
    return out


def _within_ratio(
    states: dict[str, PoolState],
    decisions: dict[str, Decision],
    ratio: RatioBounds,
    budget: int | None,
) -> dict[str, Decision]:
    """Keep prefill replicas per decode replica within [ratio.low, ratio.high] (both pools at
    zero always are). Of the pairs that hold it, within each pool's [minReplicas, maxReplicas]
    and the GPU budget, it takes the one that trims the pools' own decisions least, then adds
    the fewest GPUs (replicas, without GPUs): the pool that lags is raised (or kept from
    shrinking) and a scale-up is trimmed only when the other pool cannot follow. Like the
    budget, it never takes a pool below its current replicas (or its own lower decision): a
    bound that cannot hold then is said in the reason and closes as the pools' decisions move."""
    p_dec, d_dec = decisions["prefill"], decisions["decode"]
    p0, d0 = p_dec.replicas, d_dec.replicas
    low, high = ratio.low, ratio.high
    eps = 1e-9

    def holds(p: int, d: int) -> bool:
        if p == 0 and d == 0:
            return True
        return (low is None or p >= low * d - eps) and (high is None or p <= high * d + eps)

    if holds(p0, d0):
        return decisions
    sp, sd = states["prefill"], states["decode"]
    gp, gd = sp.gpus_per_replica, sd.gpus_per_replica
    # The GPUs the pair may use: the budget, or what the decisions already hold if more (the
    # budget trims scale-ups, it never forces a scale-down).
    gpu_cap = None if budget is None or not (gp or gd) else max(budget, p0 * gp + d0 * gd)

    def floor_of(dec: Decision, state: PoolState) -> int:
        return max(min(dec.current, dec.replicas), state.min_replicas)

    best: tuple[tuple[int, int, int], int, int] | None = None
    waking = p0 + d0 > 0  # then (0, 0) is no answer: it would put both pools to sleep
    for p in range(floor_of(p_dec, sp), max(sp.max_replicas, p0) + 1):
        d_lo, d_hi = floor_of(d_dec, sd), max(sd.max_replicas, d0)
        if high is not None:
            d_lo = max(d_lo, math.ceil(p / high - eps))
        if low:
            d_hi = min(d_hi, math.floor(p / low + eps))
        if gpu_cap is not None and gd:
            d_hi = min(d_hi, (gpu_cap - p * gp) // gd)
        elif gpu_cap is not None and p * gp > gpu_cap:
            continue
        if d_lo > d_hi:
            continue
        d = min(max(d0, d_lo), d_hi)  # as close to decode's own decision as the bounds allow
        if not holds(p, d) or (waking and p + d == 0):
            continue
        trimmed = max(p0 - p, 0) + max(d0 - d, 0)
        added = max(p - p0, 0) * max(gp, 1) + max(d - d0, 0) * max(gd, 1)
        key = (trimmed, added, abs(p - p0))
        if best is None or key < best[0]:
            best = (key, p, d)

    out = dict(decisions)
    what = " and ".join(
        f"prefillPerDecode.{name} {value:g}"
        for name, value in (("min", low), ("max", high))
        if value is not None
    )
    if best is None:
        note = (
            f"; {what} cannot hold ({p0} prefill, {d0} decode) within maxReplicas"
            + (f" and gpuBudget {budget}" if gpu_cap is not None else "")
            + " without scaling a pool below its current replicas"
        )
        out["prefill"] = replace(p_dec, reason=p_dec.reason + note)
        return out
    _, p, d = best
    for pool, dec, n, other, other_n in (
        ("prefill", p_dec, p, "decode", d),
        ("decode", d_dec, d, "prefill", p),
    ):
        if n > dec.replicas:
            out[pool] = replace(
                dec,
                replicas=n,
                verdict=RATIO_BOUND,
                reason=f"{dec.reason}; {n} to keep {what} with {other_n} {other} replicas",
            )
        elif n < dec.replicas:
            other_state = states[other]
            if other_n >= other_state.max_replicas:
                why = f"{other} can only reach {other_n}, its maxReplicas"
            elif gpu_cap is not None:
                why = f"{other} can only reach {other_n}, all the gpuBudget {budget} allows"
            else:
                why = f"no whole counts above it meet the bounds with {other} at {other_n}"
            out[pool] = replace(
                dec,
                replicas=n,
                verdict=RATIO_LIMITED,
                reason=f"{dec.reason}; limited to {n} by {what}: {why}",
            )
    return out


def used_with(
    decisions: dict[str, Decision], states: dict[str, PoolState], pool: str, replicas: int
) -> int:
    return sum(
        (replicas if p == pool else d.replicas) * states[p].gpus_per_replica
        for p, d in decisions.items()
    )


def signal_inputs(state: PoolState, sig: Signals) -> dict[str, Any]:
    """The measurements behind a decision, as written to status (seconds, fractions, counts;
    latencies at spec.slo.percentile)."""
    inputs: dict[str, Any] = {
        "replicas": state.replicas,
        "readyReplicas": state.ready,
        "reportingPods": sig.reporting,
        "requestsPerSecond": _round(sig.request_rate),
        "running": _round(sig.running),
        "waiting": _round(sig.waiting),
    }
    if state.name == "prefill":
        inputs["ttftSeconds"] = _round(sig.latency)
        inputs["prefillQueueSeconds"] = _round(sig.prefill_queue)
        inputs["utilization"] = _round(sig.busy / max(sig.reporting, 1))
    else:
        inputs["tpotSeconds"] = _round(sig.latency)
        inputs["decodeAdmissionSeconds"] = _round(sig.decode_admission)
        inputs["kvCacheUsage"] = _round(sig.kv_usage)
    return inputs  # None: no samples in the window (JSON null, which a merge patch removes)
