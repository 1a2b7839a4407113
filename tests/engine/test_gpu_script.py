"""bench/gpu_engine.sh runs only where a GPU is lent, so nothing else would notice it rot (its
synthetic mode once unpacked two of run_prefill's three results): SMOKE=1 runs the same script
on the CPU with the tiny-llama shape, in both modes, and its JSON has every field. The numbers
of a smoke run mean nothing; only that the script runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_engine.sh"


@pytest.mark.parametrize("mode", ["synthetic", "files"])
def test_the_gpu_benchmark_script_runs_end_to_end(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "gpu_engine.json"
    # OUT may name the file, or a folder to write gpu_engine.json into (a remote runner's).
    target = out if mode == "files" else tmp_path
    env = dict(os.environ, SMOKE="1", MODE=mode, MODELS_DIR=str(tmp_path), OUT=str(target))
    env |= {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == mode and result["device"] == "cpu (smoke run)"
    decode, prefill = result["decode"], result["prefill"]
    assert decode["tpot_ms_median"] > 0 and decode["floor_ms"] > 0
    assert prefill["tokens_per_s"] > 0 and prefill["achieved_flops_per_s"] > 0
    spec = result["speculative"]
    if mode == "files":
        assert spec["draft_tokens"] == 4 and spec["effective_tpot_ms"] > 0
        assert spec["plain_tpot_ms"] == pytest.approx(decode["tpot_ms_median"])
        assert result["kv_cache"]["blocks"] > 0
        assert result["kv_cache"]["sizing"] == f"kv_cache_memory_bytes {64 << 20}"
    else:  # the synthetic mode has no scheduler to draft with
        assert spec is None
