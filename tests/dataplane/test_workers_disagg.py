"""Prefill and decode workers as real processes over real gRPC: the disaggregated greedy output
equals a single in-process engine token for token; the colocated worker too; admission control,
compatibility checks, cancellation and the HTTP probes/metrics behave as specified."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from splitserve_workers.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from splitserve_workers.proto import serving_pb2 as pb

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Lengths around block boundaries (16) and past the prefill worker's token budget (64: chunked).
PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 130, 200]


@pytest.fixture(scope="module")
def reference_engine(tiny_model: Path) -> LLMEngine:
    import torch

    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def prompts(reference_engine: LLMEngine) -> list[list[int]]:
    rng = random.Random(7)
    vocab = reference_engine.model_config.vocab_size
    out = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    out.append(reference_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog."))
    return out


@pytest.fixture(scope="module")
def pair(launch_module_worker, tiny_model: Path, worker_flags):
    """One prefill worker (chunking at 64 tokens) and one decode worker."""
    decode = launch_module_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "256"))
    prefill = launch_module_worker("prefill", worker_flags(tiny_model, "--max-batch-tokens", "64"))
    return prefill, decode


def reference(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_disaggregated_equals_single_engine(pair, dataplane, reference_engine, prompts):
    prefill, decode = pair
    initial = await dataplane.load(decode.endpoint)
    expected = reference(reference_engine, prompts, MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        tokens, first, done = await dataplane.generate_disaggregated(
            prefill.endpoint, decode.endpoint, f"seq-{i}", prompt, MAX_TOKENS
        )
        assert tokens == expected[i], f"prompt {i} (length {len(prompt)})"
        kv_bytes = len(prompt) * reference_engine.kv_bytes_per_token()
        assert done.bytes == kv_bytes
        assert first.compute_seconds >= 0 and done.transfer_seconds >= 0
    after = await dataplane.load(decode.endpoint)
    assert after.free_blocks == initial.free_blocks


async def test_concurrent_transfers_equal_single_engine(pair, dataplane, reference_engine, prompts):
    """Many transfers at once (several channels, batched decode) still give the same tokens."""
    prefill, decode = pair
    initial = await dataplane.load(decode.endpoint)
    expected = reference(reference_engine, prompts, MAX_TOKENS)
    results = await asyncio.gather(
        *(
            dataplane.generate_disaggregated(
                prefill.endpoint, decode.endpoint, f"conc-{i}", p, MAX_TOKENS
            )
            for i, p in enumerate(prompts)
        )
    )
    assert [r[0] for r in results] == expected
    assert (await dataplane.load(decode.endpoint)).free_blocks == initial.free_blocks


async def test_prefix_cache_hit_on_prefill_still_matches(
    pair, dataplane, reference_engine, prompts
):
    prefill, decode = pair
    prompt = prompts[PROMPT_LENGTHS.index(130)]
    expected = reference(reference_engine, [prompt], MAX_TOKENS)[0]
    for i in range(2):
        tokens, first, _ = await dataplane.generate_disaggregated(
            prefill.endpoint, decode.endpoint, f"prefix-{i}", prompt, MAX_TOKENS
        )
        assert tokens == expected
    assert first.num_cached_tokens > 0  # the second prefill reused cached blocks


async def test_first_token_ends_request(pair, dataplane, reference_engine, prompts):
    """max_tokens=1: prefill's token is the whole answer; Generate ends at once, blocks freed."""
    prefill, decode = pair
    initial = await dataplane.load(decode.endpoint)
    tokens, _, _ = await dataplane.generate_disaggregated(
        prefill.endpoint, decode.endpoint, "one-token", prompts[3], 1
    )
    assert tokens == reference(reference_engine, [prompts[3]], 1)[0]
    assert (await dataplane.load(decode.endpoint)).free_blocks == initial.free_blocks


async def test_reserve_refuses_when_full_and_incompatible(
    launch_worker, tiny_model, worker_flags, dataplane
):
    decode = launch_worker("decode", worker_flags(tiny_model, "--num-kv-blocks", "4"))
    stub = dataplane.decode(decode.endpoint)
    load = await dataplane.load(decode.endpoint)
    assert load.total_blocks == 4 and load.free_blocks == 4 and load.role == "decode"
    spec = load.model
    ok = await stub.Reserve(pb.ReserveRequest(request_id="a", model=spec, num_prompt_tokens=40))
    assert ok.accepted and ok.lease_ms > 0
    # The gauges show the reservation at once, with no engine iteration since (read at scrape).
    held = fetch(decode.metrics_port, "/metrics")
    assert metric_value(held, "splitserve_kv_blocks_free") == ok.free_blocks < 4
    assert metric_value(held, "splitserve_kv_cache_usage_ratio") == (4 - ok.free_blocks) / 4
    full = await stub.Reserve(pb.ReserveRequest(request_id="b", model=spec, num_prompt_tokens=40))
    assert not full.accepted and full.reason == "no_free_blocks"
    # 64 tokens and the first generated one need 5 blocks of 16: never free, so refused as
    # invalid (the router's 400) rather than "no_free_blocks" (retried until its timeout).
    with pytest.raises(grpc.aio.AioRpcError) as never:
        await stub.Reserve(pb.ReserveRequest(request_id="e", model=spec, num_prompt_tokens=64))
    assert never.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "need 5 KV blocks of 16; this worker has 4 in all" in never.value.details()
    wrong = pb.ModelSpec()
    wrong.CopyFrom(spec)
    wrong.num_kv_heads += 1
    bad = await stub.Reserve(pb.ReserveRequest(request_id="c", model=wrong, num_prompt_tokens=4))
    assert not bad.accepted and bad.reason.startswith("incompatible: num_kv_heads")
    dup = await stub.Reserve(pb.ReserveRequest(request_id="a", model=spec, num_prompt_tokens=4))
    assert not dup.accepted and "duplicate" in dup.reason
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Reserve(pb.ReserveRequest(request_id="d", num_prompt_tokens=4))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in e.value.details()
    assert (await stub.Abort(pb.AbortRequest(request_id="a"))).found
    assert (await dataplane.load(decode.endpoint)).free_blocks == 4
    metrics = fetch(decode.metrics_port, "/metrics")
    assert metric_value(metrics, "splitserve_kv_blocks_free") == 4
    for reason in ("no_free_blocks", "incompatible"):
        line = (
            'splitserve_requests_rejected_total{model="tiny-llama",pool="decode",'
            f'reason="{reason}",service="local"}} 1.0'
        )
        assert line in metrics, line


async def test_prefill_checks_compatibility_before_compute(pair, dataplane):
    prefill, decode = pair
    spec = (await dataplane.load(decode.endpoint)).model
    wrong = pb.ModelSpec()
    wrong.CopyFrom(spec)
    wrong.dtype = "bfloat16" if spec.dtype != "bfloat16" else "float16"
    call = dataplane.prefill(prefill.endpoint).Prefill(
        pb.PrefillRequest(
            request_id="mismatch",
            prompt_token_ids=[1, 2, 3],
            sampling=pb.SamplingParams(max_tokens=4),
            decode_endpoint=decode.endpoint,
            decode_model=wrong,
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible: dtype" in e.value.details()


async def test_workers_bound_every_field_before_using_it(pair, dataplane, tiny_model):
    # Any pod that reaches a worker's port can call it: the limits hold without the router.
    prefill, decode = pair
    spec = (await dataplane.load(decode.endpoint)).model
    max_len = ModelConfig.from_dir(tiny_model).max_model_len
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    async def prefill_error(rid: str = "ok", prompt_len: int = 3, **sampling: Any) -> str:
        call = dataplane.prefill(prefill.endpoint).Prefill(
            pb.PrefillRequest(
                request_id=rid,
                prompt_token_ids=[1] * prompt_len,
                sampling=pb.SamplingParams(max_tokens=4, **sampling),
                decode_endpoint=decode.endpoint,
                decode_model=spec,
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == invalid, e.value.details()
        return e.value.details()

    assert "longer than 128 bytes" in await prefill_error(rid="x" * 129)
    too_long = await prefill_error(prompt_len=max_len + 1)
    assert f"{max_len + 1} tokens, more than max_model_len {max_len}" in too_long
    assert "at most 64" in await prefill_error(stop_token_ids=list(range(65)))
    assert "at most 16" in await prefill_error(stop=["a"] * 17)
    assert "longer than 1000 characters" in await prefill_error(stop=["a" * 1001])
    huge_id = "r" * 100_000
    reserve = dataplane.decode(decode.endpoint).Reserve(
        pb.ReserveRequest(request_id=huge_id, model=spec, num_prompt_tokens=4)
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await reserve
    assert e.value.code() == invalid and len(e.value.details()) < 200  # the id is not echoed
    generate = dataplane.decode(decode.endpoint).Generate(
        pb.GenerateRequest(request_id=huge_id, prompt_token_ids=[1], first_token=1)
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in generate:
            pass
    assert e.value.code() == invalid and len(e.value.details()) < 200


async def test_colocated_complete_equals_single_engine(
    launch_worker, tiny_model, worker_flags, dataplane, reference_engine, prompts
):
    colo_started = time.monotonic()
    colo = launch_worker("colocated", worker_flags(tiny_model, "--max-batch-tokens", "48"))
    stub = dataplane.colocated(colo.endpoint)
    initial = await dataplane.load(colo.endpoint, "colocated")
    expected = reference(reference_engine, prompts, MAX_TOKENS)

    async def complete(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for ev in stub.Complete(
            pb.CompleteRequest(
                request_id=f"colo-{i}",
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            )
        ):
            tokens.extend(ev.token_ids)
            if ev.finished:
                assert ev.finish_reason == "length" and ev.num_prompt_tokens == len(prompt)
        return tokens

    got = await asyncio.gather(*(complete(i, p) for i, p in enumerate(prompts)))
    assert got == expected
    # Logprobs ride along, one entry per token (the top alternatives most likely first).
    logprobs: list[float] = []
    tops: list[pb.TopLogprobs] = []
    sampling = pb.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, top_logprobs=2)
    async for ev in stub.Complete(
        pb.CompleteRequest(request_id="colo-lp", prompt_token_ids=prompts[0], sampling=sampling)
    ):
        assert len(ev.logprobs) == len(ev.top_logprobs) == len(ev.token_ids)
        logprobs += ev.logprobs
        tops += ev.top_logprobs
    assert len(logprobs) == 4 and all(v <= 0 for v in logprobs)
    for value, top in zip(logprobs, tops, strict=True):
        assert len(top.token_ids) == 2 and top.logprobs[0] >= top.logprobs[1]
        assert top.logprobs[0] == pytest.approx(value)  # greedy: the sampled token is the top
    # The prompt's logprobs, on the first event only.
    sampling.prompt_logprobs = 2
    events = [
        ev
        async for ev in stub.Complete(
            pb.CompleteRequest(
                request_id="colo-plp", prompt_token_ids=prompts[0], sampling=sampling
            )
        )
    ]
    assert [ev.HasField("prompt_logprobs") for ev in events] == [True] + [False] * (len(events) - 1)
    plp = events[0].prompt_logprobs
    assert len(plp.logprobs) == len(plp.top_logprobs) == len(prompts[0]) - 1
    assert all(v <= 0 for v in plp.logprobs)
    assert all(len(t.token_ids) == 2 for t in plp.top_logprobs)
    assert (await dataplane.load(colo.endpoint, "colocated")).free_blocks == initial.free_blocks
    metrics = fetch(colo.metrics_port, "/metrics")
    for family in (
        "splitserve_batch_size_bucket",
        "splitserve_max_batch_tokens{",
        "splitserve_kv_cache_usage_ratio{",
        "splitserve_prompt_tokens_processed_total{",
        "splitserve_generation_tokens_processed_total{",
        "splitserve_prefix_cache_queries_total{",
    ):
        assert family in metrics, family
    prompt_tokens = metric_value(metrics, "splitserve_prompt_tokens_processed_total")
    assert prompt_tokens >= sum(len(p) for p in prompts) - 64  # prefix-cache hits skip some
    # Time in forward passes: positive after work, and never more than the worker has lived.
    busy = metric_value(metrics, "splitserve_busy_seconds_total")
    assert 0 < busy < time.monotonic() - colo_started


async def test_cancelled_generate_and_complete_free_blocks(
    pair, launch_worker, tiny_model, worker_flags, dataplane, prompts
):
    prefill, decode = pair
    initial = await dataplane.load(decode.endpoint)
    stub = dataplane.decode(decode.endpoint)
    spec = initial.model
    prompt = prompts[5]
    sampling = pb.SamplingParams(max_tokens=1000, ignore_eos=True)
    assert (
        await stub.Reserve(
            pb.ReserveRequest(request_id="cancel", model=spec, num_prompt_tokens=len(prompt))
        )
    ).accepted
    first = None
    async for ev in dataplane.prefill(prefill.endpoint).Prefill(
        pb.PrefillRequest(
            request_id="cancel",
            prompt_token_ids=prompt,
            sampling=sampling,
            decode_endpoint=decode.endpoint,
            decode_model=spec,
        )
    ):
        if ev.HasField("first_token"):
            first = ev.first_token.token_id
    call = stub.Generate(
        pb.GenerateRequest(
            request_id="cancel", prompt_token_ids=prompt, first_token=first, sampling=sampling
        )
    )
    await call.read()  # tokens are flowing
    assert (await dataplane.load(decode.endpoint)).free_blocks < initial.free_blocks
    call.cancel()
    await wait_for_free_blocks(dataplane, decode.endpoint, "decode", initial.free_blocks)

    colo = launch_worker("colocated", worker_flags(tiny_model))
    colo_initial = await dataplane.load(colo.endpoint, "colocated")
    ccall = dataplane.colocated(colo.endpoint).Complete(
        pb.CompleteRequest(request_id="c1", prompt_token_ids=prompt, sampling=sampling)
    )
    await ccall.read()
    ccall.cancel()
    await wait_for_free_blocks(dataplane, colo.endpoint, "colocated", colo_initial.free_blocks)


async def test_speculative_decode_and_colocated_workers_equal_single_engine(
    pair, launch_worker, tiny_model, worker_flags, dataplane, reference_engine
):
    """--speculative-tokens: a decode worker fed by a plain prefill worker and a colocated
    worker emit what plain decoding emits, several tokens per pass, and count their drafts."""
    prefill, _ = pair
    flags = ("--speculative-tokens", "4")
    decode = launch_worker("decode", worker_flags(tiny_model, *flags))
    colo = launch_worker("colocated", worker_flags(tiny_model, *flags))
    rng = random.Random(3)
    vocab = reference_engine.model_config.vocab_size
    phrases = [[rng.randrange(vocab) for _ in range(5 + i)] for i in range(6)]
    prompts = [(ph * 12)[: 20 + 7 * i] for i, ph in enumerate(phrases)]
    expected = reference(reference_engine, prompts, 40)
    initial = await dataplane.load(decode.endpoint)
    split = await asyncio.gather(
        *(
            dataplane.generate_disaggregated(prefill.endpoint, decode.endpoint, f"spec-{i}", p, 40)
            for i, p in enumerate(prompts)
        )
    )
    assert [r[0] for r in split] == expected
    await wait_for_free_blocks(dataplane, decode.endpoint, "decode", initial.free_blocks)

    stub = dataplane.colocated(colo.endpoint)
    sampling = pb.SamplingParams(max_tokens=40, ignore_eos=True)
    events_per_request = []
    for i, prompt in enumerate(prompts):
        tokens: list[int] = []
        events = 0
        async for ev in stub.Complete(
            pb.CompleteRequest(request_id=f"cspec-{i}", prompt_token_ids=prompt, sampling=sampling)
        ):
            tokens.extend(ev.token_ids)
            events += bool(ev.token_ids)
        assert tokens == expected[i]
        events_per_request.append(events)
    assert min(events_per_request) < 40  # accepted drafts arrive together
    for worker in (decode, colo):
        metrics = fetch(worker.metrics_port, "/metrics")
        drafted = metric_value(metrics, "splitserve_spec_draft_tokens_total")
        accepted = metric_value(metrics, "splitserve_spec_accepted_tokens_total")
        assert 0 < accepted <= drafted
        # Generated tokens count what was emitted, not the rows verified.
        generated = metric_value(metrics, "splitserve_generation_tokens_processed_total")
        assert generated == len(prompts) * 39


async def test_probes(pair):
    prefill, decode = pair
    for w in (prefill, decode):
        assert '"status": "ok"' in fetch(w.metrics_port, "/health")
        assert '"ready": true' in fetch(w.metrics_port, "/ready")
        assert "splitserve_draining{" in fetch(w.metrics_port, "/metrics")


# ---- helpers --------------------------------------------------------------------------------


def fetch(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_for_free_blocks(dataplane, endpoint: str, role: str, expected: int) -> None:
    """Poll Load until the free-block count is back (bounded, to turn a leak into a failure)."""
    free = -1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        free = (await dataplane.load(endpoint, role)).free_blocks
        if free == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{endpoint}: free blocks {free}, expected {expected}")
