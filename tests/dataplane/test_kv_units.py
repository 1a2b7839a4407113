"""The pure parts of the KV path without processes: the hand-written KVChunk wire format against
the generated protobuf classes, chunk validation, the sender's bounded queue (backpressure,
batching of small layers, close) and the reservation leases with an injected clock."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from splitserve_workers.kv_transfer import (
    ChunkQueue,
    KVChunkError,
    TransferTracker,
    _Batch,
    check_compatible,
    encode_kv_chunk,
    model_fingerprint,
    parse_kv_chunk,
    slice_bytes,
    slice_view,
    tensor_bytes,
)
from splitserve_workers.proto import serving_pb2 as pb
from splitserve_workers.reservations import Failure, Reservations, State

HEADS, DIM = 2, 4


def kv(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, HEADS, DIM).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encoded_chunk_is_plain_protobuf_and_parses_back(dtype: torch.dtype) -> None:
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    k, v = kv(5, dtype), kv(5, dtype)
    data = encode_kv_chunk("r", 3, 7, 5, name, tensor_bytes(k), tensor_bytes(v), last=True)
    msg = pb.KVChunk.FromString(data)
    assert (msg.request_id, msg.layer, msg.token_start, msg.token_count, msg.dtype, msg.last) == (
        "r", 3, 7, 5, name, True,
    )  # fmt: skip
    assert msg.key == bytes(tensor_bytes(k)) and msg.layer_count == 0
    view = parse_kv_chunk(data)
    assert view.malformed is None and view.layer_count == 1
    tracker = TransferTracker("r", 12, 4, HEADS, DIM, name)
    accepted = tracker.accept(view)
    assert accepted is not None
    layer, start, k2, v2 = accepted
    assert (layer, start) == (3, 7) and torch.equal(k2, k) and torch.equal(v2, v)


def test_generated_serialization_parses_too() -> None:
    k = kv(2)
    msg = pb.KVChunk(
        request_id="x", layer=-1, token_start=-5, token_count=2, dtype="float32",
        key=bytes(tensor_bytes(k)), value=bytes(tensor_bytes(k)), layer_count=3,
    )  # fmt: skip
    view = parse_kv_chunk(msg.SerializeToString())
    assert (view.layer, view.token_start, view.layer_count) == (-1, -5, 3)
    assert bytes(view.key) == msg.key


def test_layer_batch_is_one_multi_layer_view() -> None:
    ks = [kv(3) for _ in range(3)]
    vs = [kv(3) for _ in range(3)]
    batch = _Batch(
        1, 0, 3, [bytes(tensor_bytes(t)) for t in ks], [bytes(tensor_bytes(t)) for t in vs]
    )
    tracker = TransferTracker("r", 3, 4, HEADS, DIM, "float32")
    accepted = tracker.accept(parse_kv_chunk(batch.encode("r", "float32")))
    assert accepted is not None
    first, start, k, v = accepted  # one [layers, tokens, heads, dim] view per side: one call
    assert (first, start) == (1, 0) and k.shape == v.shape == (3, 3, HEADS, DIM)
    assert all(torch.equal(k[i], ks[i]) and torch.equal(v[i], vs[i]) for i in range(3))
    assert tracker.received_token_layers == 9 and not tracker.complete


def test_tokens_the_decode_side_holds_are_validated_then_skipped() -> None:
    # 10 prompt tokens, the first 4 cached on the decode worker: only [4, 10) is expected. A
    # sender that sends them anyway (one older than the skip) still completes.
    ks = [kv(10) for _ in range(2)]
    vs = [kv(10) for _ in range(2)]
    batch = _Batch(
        0, 0, 10, [bytes(tensor_bytes(t)) for t in ks], [bytes(tensor_bytes(t)) for t in vs]
    )
    tracker = TransferTracker("r", 10, 2, HEADS, DIM, "float32", cached_tokens=4)
    assert tracker.expected_token_layers == 12
    accepted = tracker.accept(parse_kv_chunk(batch.encode("r", "float32")))
    assert accepted is not None
    first, start, k, v = accepted
    assert (first, start) == (0, 4) and k.shape == v.shape == (2, 6, HEADS, DIM)
    assert all(torch.equal(k[i], ks[i][4:]) and torch.equal(v[i], vs[i][4:]) for i in range(2))
    assert tracker.complete
    # A chunk of held tokens only is ignored, one overlapping received ones is a duplicate.
    tracker = TransferTracker("r", 10, 1, HEADS, DIM, "float32", cached_tokens=4)
    held = encode_kv_chunk("r", 0, 0, 4, "float32", tensor_bytes(kv(4)), tensor_bytes(kv(4)))
    assert tracker.accept(parse_kv_chunk(held)) is None
    rest = encode_kv_chunk("r", 0, 2, 8, "float32", tensor_bytes(kv(8)), tensor_bytes(kv(8)))
    accepted = tracker.accept(parse_kv_chunk(rest))
    assert accepted is not None and accepted[1] == 4 and tracker.complete
    with pytest.raises(KVChunkError, match="duplicate"):
        tracker.accept(parse_kv_chunk(rest))
    # A wrongly sized chunk of held tokens is still refused.
    with pytest.raises(KVChunkError, match="key: 3 bytes"):
        tracker.accept(parse_kv_chunk(encode_kv_chunk("r", 0, 0, 2, "float32", b"abc", b"abc")))


def test_malformed_bytes_do_not_raise() -> None:
    assert "not a KVChunk" in (parse_kv_chunk(b"\x0a\x05ab").malformed or "")
    assert "not a KVChunk" in (parse_kv_chunk(b"\xff").malformed or "")
    assert parse_kv_chunk(b"").malformed is None  # an empty message is all defaults


def test_tracker_rejects_with_field_names() -> None:
    t = TransferTracker("r", 10, 2, HEADS, DIM, "float32")

    def chunk(**kw: object) -> bytes:
        fields = dict(request_id="r", layer=0, token_start=0, token_count=2, dtype="float32")
        fields.update(kw)
        n = int(fields["token_count"]) * HEADS * DIM * 4  # type: ignore[call-overload]
        fields.setdefault("key", b"\0" * n)
        fields.setdefault("value", b"\0" * n)
        return pb.KVChunk(**fields).SerializeToString()  # type: ignore[arg-type]

    cases = {
        "key: 3 bytes": chunk(key=b"abc"),
        "dtype": chunk(dtype="bfloat16"),
        "layer: 2": chunk(layer=2),
        "layer: [1, 3)": chunk(layer=1, layer_count=2),
        "token_start": chunk(token_start=9),
        "request_id": chunk(request_id="s"),
        "token_count: 0": chunk(token_count=0),
    }
    for expected, data in cases.items():
        with pytest.raises(KVChunkError) as e:
            t.accept(parse_kv_chunk(data))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in e.value.message
    t.accept(parse_kv_chunk(chunk()))
    with pytest.raises(KVChunkError, match="duplicate"):
        t.accept(parse_kv_chunk(chunk(token_start=1)))
    assert t.accept(parse_kv_chunk(chunk(token_count=0, last=True))) is None  # bare end marker


def test_compatibility_names_the_first_mismatch() -> None:
    a = pb.ModelSpec(model="m@1", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=4)
    b = pb.ModelSpec()
    b.CopyFrom(a)
    b.block_size = 32  # informational only
    assert check_compatible(a, b) is None
    b.head_dim = 8
    assert check_compatible(a, b) == "incompatible: head_dim 8 != this worker's 4"


def test_queue_backpressure_and_close() -> None:
    q = ChunkQueue(max_bytes=10)
    assert q.put(b"x" * 8)
    blocked = threading.Event()
    done = threading.Event()

    def producer() -> None:
        blocked.set()
        q.put(b"y" * 8)  # over budget: waits until the consumer takes the first
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    blocked.wait()
    time.sleep(0.05)
    assert not done.is_set()
    assert q.get() == b"x" * 8
    assert done.wait(60)  # bounds a hang only
    assert q.get() == b"y" * 8
    q.close()
    assert q.put(b"late") is False


def test_queue_merges_small_slices_of_consecutive_layers() -> None:
    q = ChunkQueue(max_bytes=1 << 20)
    for layer in range(3):
        assert q.merge_small(layer, 0, 2, b"k" * 4, b"v" * 4, layer == 2, limit=1000)
    q.merge_small(5, 0, 2, b"k" * 4, b"v" * 4, False, limit=1000)  # not the next layer
    first, second = q.get(), q.get()
    assert isinstance(first, _Batch) and len(first.keys) == 3 and first.last
    assert isinstance(second, _Batch) and second.layer == 5


def test_open_batch_is_not_taken_half_built() -> None:
    """The sender waits for a batch to be sealed (here by the last slice) instead of taking it
    while the engine is still appending layers."""
    q = ChunkQueue(max_bytes=1 << 20, batch_wait=600.0)
    got: list[object] = []
    consumer = threading.Thread(target=lambda: got.append(q.get()), daemon=True)
    consumer.start()
    for layer in range(4):
        time.sleep(0.01)  # the consumer is already waiting while slices arrive
        assert q.merge_small(layer, 0, 2, b"k" * 4, b"v" * 4, layer == 3, limit=1000)
    consumer.join(60)  # bounds a hang only
    [batch] = got
    assert isinstance(batch, _Batch) and len(batch.keys) == 4 and batch.last and batch.sealed


def test_full_batch_leaves_and_open_batch_leaves_after_its_deadline() -> None:
    q = ChunkQueue(max_bytes=1 << 20, batch_wait=600.0)
    # 16 bytes per slice, limit 40: after two slices a third would not fit, so the batch is
    # sealed at once and the sender takes it without waiting for the deadline.
    for layer in range(2):
        assert q.merge_small(layer, 0, 2, b"k" * 8, b"v" * 8, False, limit=40)
    full = q.get()
    assert isinstance(full, _Batch) and len(full.keys) == 2 and full.sealed
    q = ChunkQueue(max_bytes=1 << 20, batch_wait=0.05)
    assert q.merge_small(0, 0, 2, b"k" * 8, b"v" * 8, False, limit=1000)
    lone = q.get()  # no more layers come: it leaves alone once the deadline passes
    assert isinstance(lone, _Batch) and len(lone.keys) == 1 and lone.sealed
    assert q.merge_small(1, 0, 2, b"k" * 8, b"v" * 8, True, limit=1000)  # a new batch
    rest = q.get()
    assert isinstance(rest, _Batch) and rest.layer == 1 and rest.last


def test_put_seals_the_open_batch_before_it() -> None:
    q = ChunkQueue(max_bytes=1 << 20, batch_wait=600.0)
    assert q.merge_small(0, 0, 2, b"k" * 4, b"v" * 4, False, limit=1000)
    assert q.put(b"message")
    first = q.get()
    assert isinstance(first, _Batch) and first.sealed
    assert q.get() == b"message"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_bytes_matches_tensor_memory(dtype: torch.dtype) -> None:
    t = kv(5, dtype)
    assert slice_bytes(t) == bytes(tensor_bytes(t))
    strided = torch.randn(5, 3 * HEADS * DIM).to(dtype)[:, HEADS * DIM : 2 * HEADS * DIM]
    strided = strided.view(5, HEADS, DIM)  # like v: a column slice of a fused projection
    assert not strided.is_contiguous()
    assert slice_bytes(strided) == bytes(tensor_bytes(strided.contiguous()))
    row = HEADS * DIM * t.element_size()
    assert slice_bytes(t[2:4]) == bytes(tensor_bytes(t))[2 * row : 4 * row]
    assert slice_bytes(t[:0]) == b""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_view_holds_the_tensor_and_encodes_the_same_bytes(dtype: torch.dtype) -> None:
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    k, v = kv(6, dtype), kv(6, dtype)
    want_k, want_v = bytes(tensor_bytes(k)), bytes(tensor_bytes(v))
    held_k, held_v = slice_view(k), slice_view(v)
    assert not isinstance(held_k, bytes)  # a whole fresh tensor is not copied
    del k, v  # the views alone keep the memory alive
    torch.randn(64, HEADS, DIM)  # allocations that could reuse freed memory
    assert bytes(held_k) == want_k and bytes(held_v) == want_v
    data = encode_kv_chunk("r", 0, 0, 6, name, [held_k], [held_v], last=True)
    chunk = parse_kv_chunk(data)
    assert bytes(chunk.key) == want_k and bytes(chunk.value) == want_v

    # A column slice of a fused projection (like v) is made contiguous: a fresh tensor.
    fused = torch.randn(6, 3 * HEADS * DIM).to(dtype)
    strided = fused[:, HEADS * DIM : 2 * HEADS * DIM].view(6, HEADS, DIM)
    assert bytes(slice_view(strided)) == bytes(tensor_bytes(strided.contiguous()))
    # Two rows of a 40-row tensor are copied: holding them must not pin the other 38.
    big = kv(40, dtype)
    small = slice_view(big[3:5])
    assert isinstance(small, bytes) and small == bytes(tensor_bytes(big[3:5].contiguous()))
    assert slice_view(big[:0]) == b""


def test_reservation_leases() -> None:
    released: list[str] = []
    table = Reservations(released.append, lease_s=1.0, deadline_s=3.0)

    def add(rid: str, now: float):
        return table.add(rid, TransferTracker(rid, 4, 1, HEADS, DIM, "float32"), now)

    idle = add("idle", 0.0)
    busy = add("busy", 0.0)
    done = add("done", 0.0)
    table.mark_complete(done, 0.5)
    table.touch(busy, 0.9)
    assert table.expire(1.2) == [idle] and released == ["idle"]
    assert idle.failure is not None and idle.failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stalled" in idle.failure.message
    assert table.expire(1.6) == [done] and released == ["idle", "done"]  # no Generate came
    table.touch(busy, 2.5)
    assert table.expire(2.9) == []  # chunks keep coming...
    assert table.expire(3.1) == [busy]  # ...but the deadline holds
    assert busy.failure is not None and "not complete within" in busy.failure.message
    assert table.live == 0 and released == ["idle", "done", "busy"]


def test_release_waits_for_imports_in_flight() -> None:
    released: list[str] = []
    table = Reservations(released.append, lease_s=10.0)
    res = table.add("r", TransferTracker("r", 4, 1, HEADS, DIM, "float32"), 0.0)
    res.busy = 1
    assert table.fail(res, Failure(grpc.StatusCode.CANCELLED, "x", "cancelled"), 1.0)
    assert released == [] and res.state is State.FAILED
    table.import_done(res)
    assert released == ["r"]
    assert not table.fail(res, Failure(grpc.StatusCode.CANCELLED, "x", "cancelled"), 2.0)
    assert released == ["r"]  # exactly once


def test_failed_reservation_is_kept_without_its_coverage_map() -> None:
    # A failed reservation stays tombstone_s (120 s) for a late Generate; every router abort
    # (client gone, stop at the first token, max_tokens 1) leaves one. It must not keep the
    # layers x prompt tokens coverage map: 32 layers x 4096 tokens is 128 KB per tombstone.
    import tracemalloc

    released: list[str] = []
    table = Reservations(released.append, lease_s=10.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(8):
            res = table.add(f"r{i}", TransferTracker(f"r{i}", 4096, 32, HEADS, DIM, "float32"), 0.0)
            assert table.fail(res, Failure(grpc.StatusCode.CANCELLED, "aborted", "aborted"), 1.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(released) == 8 and all(f"r{i}" in table for i in range(8))  # tombstones stay
    assert held < 8 * 32 * 4096 // 8, f"{held} bytes held by 8 failed reservations"
    tracker = res.tracker
    assert tracker.progress() == "0 of 131072 token-layers" and not tracker.complete
    with pytest.raises(KVChunkError) as e:  # no chunk is taken into a failed transfer
        tracker.accept(parse_kv_chunk(encode_kv_chunk("r7", 0, 0, 1, "float32", b"", b"", True)))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_fingerprint_tells_checkpoints_of_one_architecture_apart(tmp_path) -> None:
    import shutil

    from splitserve_workers.engine.make_model import write_model

    a = write_model("tiny-llama", tmp_path / "a", seed=1)
    copy = shutil.copytree(a, tmp_path / "copy")
    other = write_model("tiny-llama", tmp_path / "other", seed=2)  # same config, new weights
    assert (a / "config.json").read_bytes() == (other / "config.json").read_bytes()
    assert model_fingerprint(a, "m") == model_fingerprint(copy, "m")  # where it lives is moot
    assert model_fingerprint(a, "m") != model_fingerprint(other, "m")
    assert model_fingerprint(a, "m").startswith("m@")
    assert model_fingerprint(a).startswith("a@")
