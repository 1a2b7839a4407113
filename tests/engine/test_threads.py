"""The engine under its threading contract: one thread steps while others add, abort,
reserve, import, start and release."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch
from splitserve_workers.engine import LLMEngine, SamplingParams, TokenOutput
from splitserve_workers.engine_loop import EngineLoop


def test_concurrent_callers_with_one_step_thread(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=64, max_batch_size=4, max_batch_tokens=32)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = {f"r{i}": prompt_ids(engine, 5 + i % 7, salt=i) for i in range(24)}
    expected = dict(
        zip(prompts, make_engine().generate(list(prompts.values()), params), strict=True)
    )
    mc = engine.model_config
    outputs: dict[str, list[TokenOutput]] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set() or engine.has_unfinished():
                for o in engine.step():
                    outputs.setdefault(o.request_id, []).append(o)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def submitter(ids: list[str]) -> None:
        for rid in ids:
            engine.add_request(rid, prompts[rid], params)
            if rid.endswith("3"):
                engine.abort(rid)

    def decoder(name: str, n: int) -> None:
        # Disaggregated arrivals: reserve, import zeros, start or release.
        for i in range(n):
            rid = f"{name}-{i}"
            if not engine.reserve(rid, 6):
                continue
            kv = torch.zeros(6, mc.num_kv_heads, mc.head_dim)
            for layer in range(mc.num_layers):
                engine.import_kv(rid, layer, 0, kv, kv)
            if i % 2:
                engine.release(rid)
            else:
                engine.start_decode(rid, list(range(10, 16)), 7, params)

    step_thread = threading.Thread(target=loop)
    step_thread.start()
    ids = list(prompts)
    workers = [
        threading.Thread(target=submitter, args=(ids[:12],)),
        threading.Thread(target=submitter, args=(ids[12:],)),
        threading.Thread(target=decoder, args=("da", 6)),
        threading.Thread(target=decoder, args=("db", 6)),
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    step_thread.join(timeout=120)
    assert not step_thread.is_alive() and not errors
    for rid, outs in outputs.items():
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        if rid in prompts and outs[-1].finish_reason != "abort":
            assert [o.token_id for o in outs] == expected[rid]
    assert {rid for rid in prompts if not rid.endswith("3")} <= set(outputs)
    assert engine.stats().free_blocks == 64


async def test_a_loop_that_can_schedule_nothing_waits_instead_of_spinning(
    make_engine: Callable[..., LLMEngine], prompt_ids: Callable[..., list[int]]
) -> None:
    # A decode worker whose blocks are all reserved for transfers still in flight: the waiting
    # request cannot start until a reservation is released. The loop used to call step() in a
    # tight loop meanwhile (~10^5 calls a second), burning a core on the engine lock.
    engine = make_engine(block_size=4, num_kv_blocks=8)
    assert engine.reserve("holder", 8 * 4 - 1)  # every block (prompt + first token)
    steps = 0
    step = engine.step

    def counting_step() -> list[TokenOutput]:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, idle_wait_s=0.05)
    loop.start()
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        stream = loop.submit("r", prompt_ids(engine, 5), params)
        started = time.monotonic()
        # The loop steps at least once (it tried the request); on a busy box that can take
        # longer than the window below, so it is waited for, not assumed.
        until = started + 60  # bounds a hang only
        while steps == 0 and time.monotonic() < until:
            await asyncio.sleep(0.01)
        assert steps >= 1
        await asyncio.sleep(0.5)
        elapsed = time.monotonic() - started
        # At most one step per idle_wait_s while stalled (waits only get longer on a busy box).
        assert steps <= elapsed / loop.idle_wait_s + 3, (steps, elapsed)
        engine.release("holder")
        loop.wake()
        tokens: list[int] = []
        while len(tokens) < 3:
            tokens += [o.token_id for o in await stream.next_batch() if o.token_id is not None]
        assert len(tokens) == 3
    finally:
        loop.stop()
