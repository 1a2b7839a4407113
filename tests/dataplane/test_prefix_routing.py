"""Cache-aware prefill routing against real processes: two prefill workers, one decode worker
and a router. Each turn of a conversation resends the whole history plus a new message; with
`--prefill-policy cache_aware` every turn goes back to the prefill worker that holds the history
in its prefix cache (the answer's usage says how many prompt tokens were cached), where
round-robin sends the next turn to the other worker, which computes it all again."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_openai_client import metric, wait_ready

pytestmark = pytest.mark.slow

BLOCK = 16  # the workers' KV block size (the engine's default)


@pytest.fixture(scope="module")
def pools(tiny_model: Path, launch_module_worker: Any, worker_flags: Any) -> dict[str, Any]:
    prefill = [
        launch_module_worker("prefill", worker_flags(tiny_model), name=f"prefill-{i}")
        for i in range(2)
    ]
    decode = launch_module_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "256"))
    return {"prefill": prefill, "decode": decode}


def start_router(
    pools: dict[str, Any],
    launch_worker: Any,
    model: Path,
    name: str,
    policy: str | None = None,
    *flags: str,
) -> str:
    """A router in front of both pools, ready; returns its base URL."""
    router = launch_worker(
        "router",
        [
            "--model", str(model), "--port", "0", "--host", "127.0.0.1",
            "--prefill", ",".join(p.endpoint for p in pools["prefill"]),
            "--decode", pools["decode"].endpoint,
            *(["--prefill-policy", policy] if policy else []),
            *flags,
        ],
        name=name,
    )  # fmt: skip
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)  # its first refresh polls every worker of both pools at once
    return base


def cached_tokens_per_turn(base: str, conversations: int, turns: int, salt: int) -> list[list]:
    """[(previous prompt length, cached tokens)] of every turn after the first, per
    conversation; conversations take turns one request at a time."""
    prompts = [
        [4 + (salt * 97 + c * 31 + i) % 400 for i in range(37)] for c in range(conversations)
    ]
    out: list[list[tuple[int, int]]] = [[] for _ in range(conversations)]
    for turn in range(turns):
        for c in range(conversations):
            r = httpx.post(
                base + "/v1/completions",
                json={"prompt": prompts[c], "max_tokens": 2, "temperature": 0, "ignore_eos": True},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            details = r.json()["usage"].get("prompt_tokens_details") or {}
            if turn:
                out[c].append((len(prompts[c]) - 21, details.get("cached_tokens", 0)))
            prompts[c] = prompts[c] + [5 + (turn * 13 + c * 7 + i) % 300 for i in range(21)]
    return out


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_a_conversation_returns_to_the_worker_that_caches_it(
    pools: dict[str, Any], launch_worker: Any, tiny_model: Path, policy: str
) -> None:
    base = start_router(pools, launch_worker, tiny_model, f"router-{policy}", policy)
    # Prompts of their own per policy (the workers, and so their caches, are shared by both
    # runs): len(policy) was the same salt for both, 11 letters each.
    salt = ["cache_aware", "round_robin"].index(policy) + 1
    turns = cached_tokens_per_turn(base, conversations=3, turns=4, salt=salt)
    # Every full block of the previous turn's prompt is in the cache of the worker it went to.
    full = [[cached >= prev // BLOCK * BLOCK for prev, cached in conv] for conv in turns]
    if policy == "cache_aware":
        assert all(all(conv) for conv in full), turns
    else:
        # Round-robin alternates the two workers: some turn lands where its history is not.
        assert not all(all(conv) for conv in full), turns


def cache_queries(worker: Any) -> float:
    """Prompt blocks this worker has looked up in its prefix cache so far (one per block of
    every prompt it prefilled)."""
    return metric(
        f"http://127.0.0.1:{worker.metrics_port}/metrics", "splitserve_prefix_cache_queries_total"
    )


def test_new_conversations_arriving_together_spread(
    pools: dict[str, Any], launch_worker: Any, tiny_model: Path
) -> None:
    # Requests that arrive together all pick a worker before any of their reservations
    # returns; each counts as queued where it picked at once, so they do not all land on the
    # same idle worker.
    base = start_router(pools, launch_worker, tiny_model, "router-burst")  # the default policy
    before = [cache_queries(p) for p in pools["prefill"]]
    prompts = [[6 + (97 * c + i) % 390 for i in range(64)] for c in range(6)]

    def send(prompt: list[int]) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        return httpx.post(base + "/v1/completions", json=body, timeout=120).status_code

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(send, prompts)) == [200] * len(prompts)
    after = [cache_queries(p) for p in pools["prefill"]]
    got = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g > 0 for g in got), got  # both workers took some


def prefix_hits(worker: Any) -> float:
    return metric(
        f"http://127.0.0.1:{worker.metrics_port}/metrics", "splitserve_prefix_cache_hits_total"
    )


def test_the_copies_of_a_prompt_reuse_its_first_prefill(
    pools: dict[str, Any], launch_worker: Any, tiny_model: Path
) -> None:
    """n choices: the first copy's prefill computes the prompt, and the other copies, started
    once its first token is back, go to the same worker and find the prompt's blocks cached
    (started together, the pick spreads them over both workers, each computing it all)."""
    base = start_router(pools, launch_worker, tiny_model, "router-n")  # the default policy
    queries = [cache_queries(p) for p in pools["prefill"]]
    hits = [prefix_hits(p) for p in pools["prefill"]]
    prompt = [7 + (53 * i) % 380 for i in range(6 * BLOCK + 5)]  # 6 whole blocks
    body = {"prompt": prompt, "n": 4, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in answer["choices"]}) == 1  # greedy: equal copies
    # The prompt counts once, and its one real prefill found nothing cached.
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert "prompt_tokens_details" not in answer["usage"]
    looked_up = [cache_queries(p) - q for p, q in zip(pools["prefill"], queries, strict=True)]
    found = [prefix_hits(p) - h for p, h in zip(pools["prefill"], hits, strict=True)]
    # All four prefills on one worker (6 blocks looked up each), three of them cache hits.
    assert sorted(looked_up) == [0, 4 * 6], looked_up
    assert sorted(found) == [0, 3 * 6], found


def kv_bytes_sent(base: str) -> float:
    return metric(base + "/metrics", "splitserve_kv_transfer_bytes_total")


def test_kv_the_decode_worker_holds_is_not_sent_again(
    pools: dict[str, Any], launch_worker: Any, tiny_model: Path
) -> None:
    """A decode worker publishes the prompt blocks it imported in its prefix cache; a later
    prompt that starts with them (a conversation's next turn) reserves them there, and the
    prefill worker sends only the rest. `--no-decode-kv-reuse` sends everything (the
    baseline); the answers are the same."""
    full = start_router(
        pools, launch_worker, tiny_model, "router-no-reuse", None, "--no-decode-kv-reuse"
    )
    reuse = start_router(pools, launch_worker, tiny_model, "router-reuse")
    first = [9 + (71 * i) % 370 for i in range(37)]  # 2 whole blocks and 5 tokens
    second = first + [11 + (29 * i) % 330 for i in range(21)]  # 58 tokens: 3 whole blocks

    def send(base: str, prompt: list[int]) -> tuple[str, float]:
        before = kv_bytes_sent(base)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], kv_bytes_sent(base) - before

    send(full, first)
    text_full, bytes_full = send(full, second)  # every token's KV travels
    per_token = bytes_full / len(second)
    assert per_token > 0 and per_token.is_integer()
    # The decode worker now holds both prompts' whole blocks (published when they started).
    text_first, bytes_first = send(reuse, first)
    assert bytes_first == per_token * (len(first) - 32)
    text_reuse, bytes_reuse = send(reuse, second)
    assert bytes_reuse == per_token * (len(second) - 48)
    assert text_reuse == text_full
