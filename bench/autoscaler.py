"""Autoscaler benchmark: what the decode pool costs and how often it misses the TPOT objective
when the built-in autoscaler's decision core (operator/splitserve_operator/autoscaler.py, the
code the operator and `splitserve up --autoscale` run) sizes it through a day-shaped load, with
the learned TPOT model against the proportional rule it replaces, and against an oracle that
always runs the fewest replicas meeting the objective.

The decode pool is simulated (no cluster, no model: this measures decisions, not speed): a
replica's TPOT is alpha + beta x its batch (plus noise), new replicas are ready `--startup`
seconds after they are asked for, and every `--interval` seconds the core sees what Prometheus
would report: the TPOT percentile, running sequences, KV usage, ready replicas.

    python bench/autoscaler.py [--hours 6] [--seed 0]

Prints a table and writes bench/results/autoscaler.json. Deterministic for a seed; not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from splitserve_operator import autoscaler as core  # noqa: E402
from splitserve_operator.autoscaler import (  # noqa: E402
    History,
    Objectives,
    PoolState,
    Signals,
    decide,
)


@dataclass(frozen=True)
class Workload:
    alpha: float = 0.015  # seconds per decode step, whatever the batch
    beta: float = 0.0012  # seconds per sequence in the batch
    noise: float = 0.03  # relative, on each measured TPOT percentile
    peak: float = 320.0  # sequences decoding at the busiest time of day
    trough: float = 24.0
    kv_per_sequence: float = 0.006  # of one replica's KV cache
    max_batch: int = 64

    def load(self, t: float, day: float) -> float:
        """Sequences decoding at time t: a day compressed into `day` seconds, with bursts."""
        phase = 0.5 - 0.5 * math.cos(2 * math.pi * t / day)
        burst = 1.0 + 0.25 * math.sin(2 * math.pi * t / (day / 9)) ** 8
        return self.trough + (self.peak - self.trough) * phase * burst

    def tpot(self, batch: float) -> float:
        return self.alpha + self.beta * max(batch, 1.0)


def simulate(
    work: Workload, objective: float, hours: float, interval: float, startup: float, seed: int,
    learned: bool,
) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    saved = core.TPOT_MODEL_MIN_POINTS
    if not learned:
        core.TPOT_MODEL_MIN_POINTS = 10**9  # the proportional rule only
    try:
        duration = hours * 3600
        obj = Objectives(ttft_seconds=1.0, tpot_seconds=objective, percentile=95)
        histories: dict[str, History] = {}
        replicas, ready_at = 2, [0.0, 0.0]  # when each asked-for replica is (was) ready
        cost = over = over_tolerance = 0.0
        worst = 0.0
        scale_events = 0
        t = 0.0
        while t < duration:
            ready = sum(1 for r in ready_at if r <= t)
            load = work.load(t, duration)
            batch = load / max(ready, 1)
            tpot = work.tpot(batch) * (1 + work.noise * rng.uniform(-1, 1))
            cost += replicas * interval  # asked-for replicas hold their GPUs while starting
            if tpot > objective:
                over += interval
            if tpot > objective * (1 + core.TOLERANCE):
                over_tolerance += interval
            worst = max(worst, tpot / objective)
            states = {
                "prefill": PoolState("prefill", 1, 1, 1, 1),
                "decode": PoolState(
                    "decode", replicas, ready, 1, 64, max_batch_size=work.max_batch
                ),
            }
            signals = {
                "prefill": Signals(reporting=1, latency=0.2, busy=0.3, request_rate=1.0),
                "decode": Signals(
                    reporting=ready,
                    latency=tpot,
                    running=min(load, ready * work.max_batch),
                    waiting=max(0.0, load - ready * work.max_batch),
                    mean_running=min(load, ready * work.max_batch),
                    kv_usage=min(1.0, batch * work.kv_per_sequence),
                    request_rate=load / 10,
                    in_flight=load,
                ),
            }
            d = decide(states, signals, obj, histories, t, 300.0, settle=60.0)["decode"]
            if d.replicas > replicas:
                ready_at += [t + startup] * (d.replicas - replicas)
                scale_events += 1
            elif d.replicas < replicas:
                # The idlest (and the not-yet-ready first) go.
                ready_at = sorted(ready_at)[: d.replicas]
                scale_events += 1
            replicas = d.replicas
            t += interval
        return {
            "replica_hours": cost / 3600,
            "fraction_over_objective": over / duration,
            # the core scales up only past the objective plus its tolerance (no flapping)
            "fraction_over_tolerance": over_tolerance / duration,
            "worst_tpot_over_objective": worst,
            "scale_events": scale_events,
        }
    finally:
        core.TPOT_MODEL_MIN_POINTS = saved


def oracle(work: Workload, objective: float, hours: float, interval: float) -> dict[str, Any]:
    """The fewest replicas meeting the objective at every instant, ready at once, within the
    batch limit and the KV usage target the core also sizes for."""
    batch = min(
        (objective - work.alpha) / work.beta,
        work.max_batch,
        core.DECODE_TARGET_KV_USAGE / work.kv_per_sequence,
    )
    duration = hours * 3600
    cost = 0.0
    t = 0.0
    while t < duration:
        cost += max(1, math.ceil(work.load(t, duration) / batch)) * interval
        t += interval
    return {
        "replica_hours": cost / 3600,
        "fraction_over_objective": 0.0,
        "fraction_over_tolerance": 0.0,
        "worst_tpot_over_objective": 1.0,
    }


# Two decode cost shapes: the step's fixed part small (a CPU-like engine, cost mostly per
# sequence) or dominant (a GPU reading its weights once per step, sequences nearly free).
WORKLOADS = {
    "per-sequence": Workload(alpha=0.015, beta=0.0012),
    "fixed-step": Workload(alpha=0.020, beta=0.00025, kv_per_sequence=0.005, max_batch=128),
}


def run_workload(work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    objective = args.objective_ms / 1000
    runs = {
        "oracle": oracle(work, objective, args.hours, args.interval),
        "proportional": simulate(
            work, objective, args.hours, args.interval, args.startup, args.seed, learned=False
        ),
        "learned": simulate(
            work, objective, args.hours, args.interval, args.startup, args.seed, learned=True
        ),
    }
    base = runs["oracle"]["replica_hours"]
    print(
        f"\ndecode pool, TPOT = {work.alpha * 1000:g}ms + {work.beta * 1000:g}ms x batch, "
        f"objective {args.objective_ms:g}ms, load {work.trough:g}-{work.peak:g} sequences, "
        f"{args.hours:g} h, evaluations every {args.interval:g}s, start-up {args.startup:g}s"
    )
    tol = f"> +{core.TOLERANCE:.0%}"
    print(
        f"{'policy':<14}{'replica-h':>10}{'vs oracle':>11}{'> objective':>13}{tol:>9}"
        f"{'worst':>8}{'scalings':>10}"
    )
    for name, r in runs.items():
        r["cost_vs_oracle"] = r["replica_hours"] / base
        print(
            f"{name:<14}{r['replica_hours']:>10.1f}{r['cost_vs_oracle']:>10.2f}x"
            f"{r['fraction_over_objective']:>13.1%}{r['fraction_over_tolerance']:>9.1%}"
            f"{r['worst_tpot_over_objective']:>7.2f}x{r.get('scale_events', ''):>10}"
        )
    ratio = runs["learned"]["replica_hours"] / runs["proportional"]["replica_hours"]
    print(f"learned / proportional cost: {ratio:.2f}x")
    return {"runs": runs, "learned_cost_vs_proportional": ratio, "workload": work.__dict__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=6.0, help="simulated time (one 'day')")
    parser.add_argument("--interval", type=float, default=15.0, help="evaluation interval, s")
    parser.add_argument("--startup", type=float, default=60.0, help="replica start-up time, s")
    parser.add_argument("--objective-ms", type=float, default=50.0, help="TPOT objective")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "autoscaler.json"))
    args = parser.parse_args()
    results = {name: run_workload(work, args) for name, work in WORKLOADS.items()}
    settings = {
        k: getattr(args, k) for k in ("hours", "interval", "startup", "objective_ms", "seed")
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workloads": results, **settings}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
