"""Test-plane numbers: cold build time of the binaries (read from the cache dir, where
hack/testplane/build.sh records it) and warm start time of ControlPlane (start() until the fake
Nodes are Ready), measured here. Prints a table; writes bench/results/testplane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "hack" / "testplane"))

import plane  # noqa: E402  (lives in hack/testplane)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="warm starts to time (>= 1)")
    parser.add_argument("--nodes", type=int, default=3, help="fake Nodes per plane")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "testplane.json")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")

    bin_dir = plane.build()
    cold_file = bin_dir.parent / "cold-build-seconds"
    cold = float(cold_file.read_text().strip()) if cold_file.exists() else None

    starts: list[float] = []
    for _ in range(args.runs):
        cp = plane.ControlPlane(bin_dir=bin_dir, nodes=args.nodes)
        t0 = time.monotonic()
        try:
            cp.start()
            starts.append(time.monotonic() - t0)
        finally:
            cp.stop()

    result = {
        "kube_version": plane.KUBE_VERSION,
        "bin_dir_name": bin_dir.parent.name,
        "cold_build_seconds": cold,
        "warm_start_seconds": [round(s, 2) for s in starts],
        "warm_start_median_seconds": round(statistics.median(starts), 2),
        "nodes": args.nodes,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        ("cold build (all binaries)", f"{cold:.0f} s" if cold is not None else "not recorded"),
        (f"warm start, median of {len(starts)}", f"{statistics.median(starts):.1f} s"),
        ("warm start, each", ", ".join(f"{s:.1f}" for s in starts) + " s"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'test plane ' + plane.KUBE_VERSION:<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
