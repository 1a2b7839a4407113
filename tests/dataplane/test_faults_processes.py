"""Whole processes failing or stopping: a decode worker killed mid-stream, a prefill worker killed
before its first token, a KV sender killed mid-transfer, and SIGTERM draining (in-flight work
completes, new work is refused with "draining", exit code 0)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from splitserve_workers.proto import serving_pb2 as pb

pytestmark = pytest.mark.slow

# A bound on waiting for something that must happen; a failure, not a measurement.
HANG_GUARD_S = 60


async def wait_free(dataplane, endpoint: str, expected: int, role: str = "decode") -> None:
    free = -1
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        free = (await dataplane.load(endpoint, role)).free_blocks
        if free == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"free blocks {free}, expected {expected}")


def ready_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def start_generation(dataplane, prefill, decode, rid: str, max_tokens: int):
    """Reserve + Prefill to completion, then open Generate; returns the Generate call."""
    spec = (await dataplane.load(decode.endpoint)).model
    prompt = list(range(10, 30))
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    res = await dataplane.decode(decode.endpoint).Reserve(
        pb.ReserveRequest(request_id=rid, model=spec, num_prompt_tokens=len(prompt))
    )
    assert res.accepted
    first = None
    async for ev in dataplane.prefill(prefill.endpoint).Prefill(
        pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            decode_endpoint=decode.endpoint, decode_model=spec,
        )
    ):  # fmt: skip
        if ev.HasField("first_token"):
            first = ev.first_token.token_id
    assert first is not None
    return dataplane.decode(decode.endpoint).Generate(
        pb.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, first_token=first, sampling=sampling
        )
    )


async def test_decode_killed_mid_stream(launch_worker, tiny_model, worker_flags, dataplane):
    decode = launch_worker("decode", worker_flags(tiny_model))
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    prefill_initial = (await dataplane.load(prefill.endpoint, "prefill")).free_blocks
    call = await start_generation(dataplane, prefill, decode, "doomed", 900)
    first_event = await call.read()
    assert first_event.token_ids
    decode.kill()

    async def drain() -> None:
        while True:
            ev = await call.read()
            if ev is grpc.aio.EOF or ev.finished:
                raise AssertionError("the stream of a killed worker ended normally")

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(drain(), HANG_GUARD_S)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # The prefill worker holds nothing for the dead request.
    await wait_free(dataplane, prefill.endpoint, prefill_initial, "prefill")


async def test_prefill_killed_before_first_token(
    launch_worker, tiny_model, worker_flags, dataplane
):
    decode = launch_worker("decode", worker_flags(tiny_model, "--lease-seconds", "1"))
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    initial = (await dataplane.load(decode.endpoint)).free_blocks
    spec = (await dataplane.load(decode.endpoint)).model
    prompt = list(range(1, 60))
    assert (
        await dataplane.decode(decode.endpoint).Reserve(
            pb.ReserveRequest(request_id="orphan", model=spec, num_prompt_tokens=len(prompt))
        )
    ).accepted
    # Frozen, the prefill worker cannot answer; then it dies without a word.
    prefill.proc.send_signal(signal.SIGSTOP)
    call = dataplane.prefill(prefill.endpoint).Prefill(
        pb.PrefillRequest(
            request_id="orphan", prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=4),
            decode_endpoint=decode.endpoint, decode_model=spec,
        )
    )  # fmt: skip
    await asyncio.sleep(0.3)
    prefill.kill()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(call.read(), HANG_GUARD_S)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # No KV ever came: the decode worker's lease frees the reservation.
    await wait_free(dataplane, decode.endpoint, initial)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in dataplane.decode(decode.endpoint).Generate(
            pb.GenerateRequest(
                request_id="orphan", prompt_token_ids=prompt, first_token=1,
                sampling=pb.SamplingParams(max_tokens=4),
            )
        ):  # fmt: skip
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


SENDER = textwrap.dedent(
    """
    import sys, time, grpc
    from splitserve_workers.proto import serving_pb2 as pb, serving_pb2_grpc as pbg
    endpoint, rid, layers, heads, dim, n = sys.argv[1:3] + [int(x) for x in sys.argv[3:]]
    def chunks():
        for layer in range(layers - 1):  # all but the last layer, then hang
            data = bytes(n * heads * dim * 4)
            yield pb.KVChunk(request_id=rid, layer=layer, token_start=0, token_count=n,
                             dtype="float32", key=data, value=data)
        print("SENT", flush=True)
        time.sleep(3600)
    pbg.DecodeServiceStub(grpc.insecure_channel(endpoint)).PushKV(chunks())
    """
)


async def test_sender_process_killed_mid_transfer(
    launch_worker, tiny_model, worker_flags, dataplane
):
    # A long lease, so only the broken connection can explain the blocks coming back.
    decode = launch_worker("decode", worker_flags(tiny_model, "--lease-seconds", "600"))
    load = await dataplane.load(decode.endpoint)
    spec, initial = load.model, load.free_blocks
    n = 50
    assert (
        await dataplane.decode(decode.endpoint).Reserve(
            pb.ReserveRequest(request_id="half", model=spec, num_prompt_tokens=n)
        )
    ).accepted
    args = [decode.endpoint, "half", spec.num_layers, spec.num_kv_heads, spec.head_dim, n]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, *map(str, args)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, sender.stdout.readline),
            HANG_GUARD_S,
        )
        assert line.strip() == "SENT"
        await asyncio.sleep(0.3)
        sender.kill()
        await wait_free(dataplane, decode.endpoint, initial)
    finally:
        sender.kill()
        sender.wait()


async def test_sigterm_drains_colocated(launch_worker, tiny_model, worker_flags, dataplane):
    colo = launch_worker("colocated", worker_flags(tiny_model, "--drain-timeout", "120"))
    stub = dataplane.colocated(colo.endpoint)
    assert ready_status(colo.metrics_port) == 200
    call = stub.Complete(
        pb.CompleteRequest(
            request_id="inflight", prompt_token_ids=list(range(5, 25)),
            sampling=pb.SamplingParams(max_tokens=900, ignore_eos=True),
        )
    )  # fmt: skip
    tokens = list((await call.read()).token_ids)
    colo.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:  # readiness drops first
        if ready_status(colo.metrics_port) == 503:
            break
        await asyncio.sleep(0.02)
    assert ready_status(colo.metrics_port) == 503
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Complete(
            pb.CompleteRequest(
                request_id="late", prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams()
            )
        ):
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "draining"
    reason = ""
    while (ev := await call.read()) is not grpc.aio.EOF:
        tokens.extend(ev.token_ids)
        reason = ev.finish_reason or reason
    assert len(tokens) == 900 and reason == "length"
    assert await asyncio.get_running_loop().run_in_executor(None, colo.proc.wait, 120) == 0
    assert "draining: 1 in flight" in colo.log()


async def test_sigterm_drains_disaggregated_pair(
    launch_worker, tiny_model, worker_flags, dataplane
):
    # A drain timeout no loaded machine comes near: the 900 tokens must finish, not be cut.
    decode = launch_worker("decode", worker_flags(tiny_model, "--drain-timeout", "300"))
    prefill = launch_worker("prefill", worker_flags(tiny_model, "--drain-timeout", "300"))
    call = await start_generation(dataplane, prefill, decode, "inflight", 900)
    tokens = list((await call.read()).token_ids)
    # Read the spec first: the prefill worker has nothing in flight, so after SIGTERM it may
    # finish draining and close its server before a Load reaches it.
    spec = (await dataplane.load(prefill.endpoint, "prefill")).model
    decode.proc.send_signal(signal.SIGTERM)
    prefill.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        if (await dataplane.load(decode.endpoint)).draining:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dataplane.decode(decode.endpoint).Reserve(
            pb.ReserveRequest(request_id="late", model=spec, num_prompt_tokens=3)
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "draining"
    while (ev := await call.read()) is not grpc.aio.EOF:
        tokens.extend(ev.token_ids)
    assert len(tokens) == 899  # max_tokens minus the first token, which prefill sampled
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, decode.proc.wait, 120) == 0
    assert await loop.run_in_executor(None, prefill.proc.wait, 120) == 0


def test_bad_flags_exit_with_a_named_field(tiny_model: Path, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "splitserve_workers.cli", "decode", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert out.returncode == 2 and "model.path" in out.stderr
