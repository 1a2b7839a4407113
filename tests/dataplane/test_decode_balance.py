"""Decode picking against real processes: one prefill worker, two decode workers and a router
(the default policies). Requests arriving together each pick a decode worker before any of
their reservations returns; each pick counts on its worker at once, so a burst spreads over
the pool instead of all landing on the worker that looked freest at the last Load poll."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_openai_client import metric, wait_ready

pytestmark = pytest.mark.slow

BURST = 16
MAX_TOKENS = 6


def generated(worker: Any) -> float:
    """Tokens this decode worker has generated so far."""
    return metric(
        f"http://127.0.0.1:{worker.metrics_port}/metrics",
        "splitserve_generation_tokens_processed_total",
    )


def test_a_burst_of_requests_spreads_over_the_decode_pool(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    decode = [
        launch_worker("decode", worker_flags(tiny_model), name=f"decode-{i}") for i in range(2)
    ]
    router = launch_worker(
        "router",
        [
            "--model", str(tiny_model), "--port", "0", "--host", "127.0.0.1",
            "--prefill", prefill.endpoint,
            "--decode", ",".join(d.endpoint for d in decode),
        ],
    )  # fmt: skip
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    prompts = [[6 + (97 * i + j) % 390 for j in range(40)] for i in range(BURST)]
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    # One request with 16 prompts: the router starts their 16 flows at the same moment.
    before = [generated(d) for d in decode]
    r = httpx.post(base + "/v1/completions", json={**body, "prompt": prompts}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == BURST
    together = [generated(d) - b for d, b in zip(decode, before, strict=True)]

    # 16 clients at once (their requests reach the router a little apart).
    before = [generated(d) for d in decode]

    async def clients() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            answers = await asyncio.gather(
                *(
                    client.post(base + "/v1/completions", json={**body, "prompt": p[::-1]})
                    for p in prompts
                )
            )
        return [a.status_code for a in answers]

    assert asyncio.run(clients()) == [200] * BURST
    apart = [generated(d) - b for d, b in zip(decode, before, strict=True)]

    # Every request generates as many tokens on its decode worker: the shares are the
    # requests'. Each worker took at least a quarter of each burst (all of the first on one
    # worker, before a pick counted on its worker at once).
    for got in (together, apart):
        assert sum(got) > 0, (together, apart)
        assert min(got) >= sum(got) / 4, (together, apart)
