"""KVSender (the prefill side of the KV path) against a real decode worker process: large layer
slices are split into several messages, small ones leave batched across layers in one message,
and when layers come slowly a batch leaves by its deadline instead of waiting for the rest. In
every case the decode worker accepts the whole transfer and generates from it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from splitserve_workers.kv_transfer import ChannelPool, KVSender
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.proto import serving_pb2_grpc as pbg

PROMPT = 24  # tokens per transfer
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def decode(launch_module_worker, tiny_model: Path, worker_flags):
    return launch_module_worker(
        "decode", worker_flags(tiny_model, "--num-kv-blocks", "64", "--lease-seconds", "600")
    )


@pytest.fixture(scope="module")
def stub(decode) -> Iterator[pbg.DecodeServiceStub]:
    channel = grpc.insecure_channel(decode.endpoint)
    yield pbg.DecodeServiceStub(channel)
    channel.close()


@pytest.fixture
def pool() -> Iterator[ChannelPool]:
    pool = ChannelPool()
    yield pool
    pool.close()


def transfer(
    stub: pbg.DecodeServiceStub,
    pool: ChannelPool,
    endpoint: str,
    request_id: str,
    slow_layers: bool = False,
    **sender_args: float,
) -> tuple[int, int, int]:
    """Reserve, stream every layer of a random KV through a KVSender (with slow_layers, like
    an engine slower than the batch deadline: each next layer only once the sender has taken
    the one before), generate two tokens; returns (messages, bytes, tokens generated)."""
    spec = stub.Load(pb.LoadRequest()).model
    assert stub.Reserve(
        pb.ReserveRequest(request_id=request_id, model=spec, num_prompt_tokens=PROMPT)
    ).accepted
    sender = KVSender(
        pool, endpoint, request_id, PROMPT, spec.num_layers, spec.dtype, timeout=120, **sender_args
    )
    shape = (PROMPT, spec.num_kv_heads, spec.head_dim)
    kv = [
        (torch.randn(shape).to(DTYPES[spec.dtype]), torch.randn(shape).to(DTYPES[spec.dtype]))
        for _ in range(spec.num_layers)
    ]
    sender.start()
    for layer, (k, v) in enumerate(kv):
        sender.on_kv(request_id, layer, 0, k, v)
        if slow_layers and layer < spec.num_layers - 1:
            # This layer's batch is open (not the last layer, far under the size limit): only
            # its deadline lets the sender take it. Waiting for that, rather than sleeping a
            # multiple of the deadline, holds however late a busy machine runs the sender.
            until = time.monotonic() + 120  # bounds a hang only
            while sender.chunks <= layer and time.monotonic() < until:
                time.sleep(0.005)
            assert sender.chunks == layer + 1, "an open batch did not leave by its deadline"
    result = sender.future.result(timeout=120)  # bounds a hang only
    events = stub.Generate(
        pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=list(range(1, PROMPT + 1)), first_token=3,
            sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
        )
    )  # fmt: skip
    tokens = [t for ev in events for t in ev.token_ids]
    return result.chunks, result.bytes, len(tokens)


def kv_bytes(stub: pbg.DecodeServiceStub) -> tuple[int, int]:
    """(bytes of one layer's key+value for the prompt, number of layers)."""
    spec = stub.Load(pb.LoadRequest()).model
    itemsize = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    return 2 * PROMPT * spec.num_kv_heads * spec.head_dim * itemsize, spec.num_layers


def test_small_slices_leave_as_one_message(decode, stub, pool) -> None:
    per_layer, layers = kv_bytes(stub)
    # A batch deadline no scheduler delay reaches: the batch leaves when its last layer seals
    # it. (With the 2 ms default, a busy machine sometimes let the deadline pass between two
    # layers and the transfer left as two messages; the deadline has its own test below.)
    chunks, nbytes, tokens = transfer(stub, pool, decode.endpoint, "batched", batch_wait=600.0)
    assert (chunks, nbytes) == (1, per_layer * layers)
    assert tokens == 2  # max_tokens counts the first token, which decode was given


def test_large_slices_are_split(decode, stub, pool) -> None:
    per_layer, layers = kv_bytes(stub)
    # Messages of 6 tokens' key+value: every layer's 24 tokens leave as 4 messages.
    chunk = per_layer // 4
    chunks, nbytes, tokens = transfer(stub, pool, decode.endpoint, "split", chunk_bytes=chunk)
    assert (chunks, nbytes) == (4 * layers, per_layer * layers)
    assert tokens == 2


def test_batch_leaves_by_its_deadline_when_layers_come_slowly(decode, stub, pool) -> None:
    per_layer, layers = kv_bytes(stub)
    assert layers > 1
    # The next layer comes only after the default deadline let the sender take the open batch
    # (a fixed pause, 100 times the deadline, raced a sender thread a busy machine ran late:
    # all layers then left as one message): every layer leaves as its own message.
    chunks, nbytes, tokens = transfer(stub, pool, decode.endpoint, "slow", slow_layers=True)
    assert (chunks, nbytes) == (layers, per_layer * layers)
    assert tokens == 2
