"""The engine benchmarks that drive the engine's internals (a stand-in drafter, a timed grammar
hook) still run end to end on a tiny model: an engine change that breaks their stand-ins would
otherwise go unseen until someone runs `make bench` (two did). Their numbers are not checked
here: benchmarks measure, tests do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_speculative_benchmark_runs(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    run_bench(
        "speculative.py", "--model", str(tiny_llama), "--batches", "1", "--reps", "1",
        "--max-tokens", "8", "--prompt-tokens", "16", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {r["workload"] for r in rows} >= {"oracle", "wrong", "json"}
    assert all(r["identical"] for r in rows)  # speculation never changes an answer


def test_structured_benchmark_runs(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    run_bench(
        "structured.py", "--model", str(tiny_llama), "--quick", "--batches", "1",
        "--max-tokens", "24", "--prompt-len", "16", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["batch"] == 1 and row["decode_tokens"] > 0
    assert result["setup"]["vocab_size"] > 0
