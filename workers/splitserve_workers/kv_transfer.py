"""Moving one request's KV cache from a prefill worker to a decode worker over DecodeService.PushKV.

The prefill side (`KVSender`) turns each layer slice the engine hands to `on_kv` into finished
KVChunk messages on the engine thread (the only copy on that side; small slices are copied out
and batched across layers instead, joined when the batch leaves), queues them in a bounded queue
(backpressure) and streams them over a pooled channel with the sync gRPC API. The decode side parses
chunks without copying (`parse_kv_chunk`: memoryviews into the received bytes), checks them
(`TransferTracker`) and hands torch views to engine.import_kv. Both ends share the channel settings
and the compatibility check (`model_spec`, `check_compatible`). reservations.py owns the leases.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from splitserve_workers.proto import serving_pb2

# One KV message carries key+value for a token range of one layer (or of several layers, see
# SMALL_FRACTION). 2 MiB: a message is only handed on once it is whole, so smaller messages let
# the stages (encode, gRPC send, receive, import) overlap; 4-16 MB transfers took 15-25% less
# time than with 8 MiB, 1 MiB cost more per message at 256 MB (bench/kv_transfer.py).
DEFAULT_CHUNK_BYTES = 2 << 20
# Per-transfer queue between the engine thread and the sender: a few layers of a long prompt.
DEFAULT_QUEUE_BYTES = 64 << 20
# Message-size limit on both ends: a chunk plus its header, with room for larger chunk settings.
MAX_KV_MESSAGE_BYTES = 80 << 20
DEFAULT_CHANNELS_PER_PEER = 4
# Slices of at most chunk_bytes / SMALL_FRACTION (key+value) are batched across layers
# (layer_count), so at least two ride in one message; larger ones are split to chunk_bytes.
SMALL_FRACTION = 2
# How long an open batch of small slices waits for the next layer before it leaves unfilled.
# Real prefill hands over a layer every few ms; this bounds what batching adds to a transfer.
BATCH_MAX_WAIT_S = 0.002

PUSH_KV_METHOD = "/splitserve.v1.DecodeService/PushKV"
REQUEST_ID_METADATA = "splitserve-request-id"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# torch.frombuffer warns that the received bytes are read-only; we only ever read them
# (import_kv copies into the cache), so the warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# grpc's connectivity poller (behind a readiness watch) looks at its subscriptions every 0.2 s;
# a channel closed under it kills that thread with "Cannot monitor channel state: Channel
# closed!". A channel whose watch was just cancelled is closed this much later instead.
CLOSE_AFTER_UNWATCH_S = 1.0

KEEPALIVE_TIME_MS = 10_000  # HTTP/2 ping interval on KV connections (both directions)
KEEPALIVE_TIMEOUT_MS = 5_000  # no ping acknowledgement within this: the connection is dead


def kv_channel_options() -> list[tuple[str, Any]]:
    """gRPC channel/server options for the KV path (both ends use them)."""
    return [
        ("grpc.max_send_message_length", MAX_KV_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_KV_MESSAGE_BYTES),
        # A larger initial HTTP/2 window lets a multi-MiB chunk flow without waiting for the
        # BDP estimator to grow the window from 64 KiB.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.max_frame_size", 1 << 20),
        ("grpc.http2.bdp_probe", 1),
        # Read the socket in MiB-sized pieces instead of the default few KiB: fewer syscalls
        # and slices per multi-MiB message (the receiver is the CPU-bound side).
        ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
        # Each pooled channel gets its own TCP connection (the default subchannel pool would
        # share one connection between channels with equal arguments).
        ("grpc.use_local_subchannel_pool", 1),
        # A peer that stops answering without closing the connection (frozen process,
        # partitioned node) must fail the KV stream in seconds: PushKV has no deadline, so
        # without pings Prefill, and the client behind the router, would wait as long as the
        # peer stays frozen. Ping every 10 s, give up 5 s later, also while no data flows
        # (after the last chunk, waiting for decode's acknowledgement). This gRPC core only
        # enforces the ping timeout (default 1 minute), not keepalive_timeout: set both.
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
        # Server side: accept those pings (the default minimum interval is 5 minutes, and
        # faster pings count as abuse and end the connection with GOAWAY).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ]


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers_in_heap() -> bool:
    """Make glibc reuse freed MiB-sized buffers instead of mapping fresh pages for each.

    Every KV message is a new multi-MiB `bytes` on both ends (and gRPC allocates its slices
    alike). By default glibc serves those with mmap and unmaps them on free, so each one pays a
    page fault per 4 KiB page on first touch: joining a 1 MiB message took 2-3 ms instead of
    0.2 ms here. Raising the mmap and trim thresholds keeps such buffers in the heap for reuse;
    the cost is that the heap keeps its high-water mark (bounded by the transfer queues). Called
    once per process by the prefill and decode roles; a no-op (False) without glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # 32 MiB is glibc's ceiling for the mmap threshold; messages are 2 MiB by default.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 512 << 20))


# ---- compatibility ---------------------------------------------------------------------------


# Slices of each weights file hashed into the fingerprint, spread evenly over the file.
FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 64 << 10


def model_fingerprint(model_dir: str | Path, name: str = "") -> str:
    """`<name>@<12 hex>`: a sha256 over config.json and the weights (each safetensors file's
    name, size, header and FINGERPRINT_SAMPLES slices of its bytes: ~1 MiB read per file).
    Two workers exchange KV only when these are equal, so a rollout from one checkpoint to
    another of the same architecture (a new fine-tune at another path, same model name) never
    decodes one model's KV with the other's weights."""
    path = Path(model_dir)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header, 100 << 20)))
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(size * i // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return f"{name or path.name}@{digest.hexdigest()[:12]}"


def model_spec(engine: Any, model_name: str, block_size: int) -> serving_pb2.ModelSpec:
    """This worker's side of the compatibility check, from a loaded engine."""
    mc = engine.model_config
    return serving_pb2.ModelSpec(
        model=model_name,
        dtype=DTYPE_NAMES.get(engine.dtype, str(engine.dtype)),
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=block_size,
    )


def check_compatible(local: serving_pb2.ModelSpec, remote: serving_pb2.ModelSpec) -> str | None:
    """None when KV computed by one can be imported by the other, else the first mismatch.

    block_size is not compared: chunks carry token ranges, and each side pages them itself.
    """
    for name in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            return f"incompatible: {name} {theirs!r} != this worker's {mine!r}"
    return None


# ---- wire format -----------------------------------------------------------------------------
# KVChunk fields 6 (key) and 7 (value) are length-delimited bytes. Writing them by hand lets the
# tensor bytes go straight into the outgoing message, and reading them by hand gives memoryviews
# instead of copies. The result is ordinary protobuf: generated stubs interoperate both ways.

_KEY_TAG = bytes([(6 << 3) | 2])
_VALUE_TAG = bytes([(7 << 3) | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a tensor's data (on CPU, contiguous; bfloat16 viewed as bytes)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    return t.view(torch.uint8).numpy().data.cast("B")


def slice_bytes(t: torch.Tensor) -> bytes:
    """A copy of a tensor's data as `bytes` (one memcpy from the tensor's memory). For the many
    small slices of a short prompt this is several times cheaper per call than
    `bytes(tensor_bytes(t))`, whose cost is torch/numpy dispatch, not the copy."""
    if not t.is_cpu:
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


# slice_view copies a slice whose tensor's storage is more than this many times its size, so a
# batch waiting to leave never pins the whole forward pass's K (several prompts) for one slice.
VIEW_MAX_STORAGE_RATIO = 2


# What encode_kv_chunk joins: bytes, a memoryview, or slice_view's ctypes array over a tensor.
KVBuffer = bytes | memoryview | ctypes.Array[ctypes.c_char]


def slice_view(t: torch.Tensor) -> KVBuffer:
    """A tensor's data as a buffer for `encode_kv_chunk`, without a copy where that is safe: the
    engine hands on_kv fresh tensors of the forward pass (RoPE'd K, a contiguous V, blocks read
    from the cache), never views of the KV cache, so holding one until its message is encoded
    reads stable bytes. The buffer keeps the tensor alive. A slice that is a small part of a
    larger tensor is copied instead (`slice_bytes`). The 32 on_kv calls of a transfer took
    104 -> 87 us at 1 MB and 360 -> 97 us at 17 MB (engine thread, heap kept as the workers
    keep it); the one copy left is the message's own, in the sender thread."""
    if not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu").contiguous()  # a fresh copy either way
    n = t.numel() * t.element_size()
    if not n:
        return b""
    if t.untyped_storage().nbytes() > VIEW_MAX_STORAGE_RATIO * n:
        return slice_bytes(t)
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf._tensor = t  # type: ignore[attr-defined]  # the memory lives as long as the view
    return buf


def encode_kv_chunk(
    request_id: str,
    layer: int,
    token_start: int,
    token_count: int,
    dtype: str,
    key: KVBuffer | list[KVBuffer],
    value: KVBuffer | list[KVBuffer],
    last: bool = False,
    layer_count: int = 1,
) -> bytes:
    """A serialized KVChunk. key/value (or lists of per-layer parts) are copied once, into the
    message itself."""
    header = serving_pb2.KVChunk(
        request_id=request_id,
        layer=layer,
        token_start=token_start,
        token_count=token_count,
        dtype=dtype,
        last=last,
        layer_count=layer_count if layer_count != 1 else 0,
    ).SerializeToString()
    parts: list[KVBuffer] = [header]
    for tag, data in ((_KEY_TAG, key), (_VALUE_TAG, value)):
        pieces = data if isinstance(data, list) else [data]
        n = sum(len(p) for p in pieces)
        if n:
            parts += [tag, _varint(n), *pieces]
    return b"".join(parts)


@dataclass
class KVChunkView:
    """A parsed KVChunk whose key/value are memoryviews into the received message."""

    request_id: str = ""
    layer: int = 0
    token_start: int = 0
    token_count: int = 0
    dtype: str = ""
    key: memoryview = field(default_factory=lambda: memoryview(b""))
    value: memoryview = field(default_factory=lambda: memoryview(b""))
    last: bool = False
    layer_count: int = 1
    nbytes: int = 0
    malformed: str | None = None  # why the bytes are not a KVChunk (reported as INVALID_ARGUMENT)


def _int32(v: int) -> int:
    v &= (1 << 64) - 1
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def parse_kv_chunk(data: bytes) -> KVChunkView:
    """Parse a serialized KVChunk without copying key/value. Never raises: a malformed message
    comes back with `malformed` set, so the handler can answer INVALID_ARGUMENT with a reason."""
    chunk = KVChunkView(nbytes=len(data))
    mv = memoryview(data)
    pos, end = 0, len(data)

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            if pos >= end or shift > 63:
                raise ValueError("truncated varint")
            b = data[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    try:
        while pos < end:
            tag = varint()
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                v = varint()
                if number == 2:
                    chunk.layer = _int32(v)
                elif number == 3:
                    chunk.token_start = _int32(v)
                elif number == 4:
                    chunk.token_count = _int32(v)
                elif number == 8:
                    chunk.last = bool(v)
                elif number == 9:
                    chunk.layer_count = _int32(v) or 1
            elif wire == 2:
                n = varint()
                if pos + n > end:
                    raise ValueError(f"field {number} runs past the end of the message")
                piece = mv[pos : pos + n]
                pos += n
                if number == 1:
                    chunk.request_id = bytes(piece).decode("utf-8")
                elif number == 5:
                    chunk.dtype = bytes(piece).decode("utf-8")
                elif number == 6:
                    chunk.key = piece
                elif number == 7:
                    chunk.value = piece
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"unsupported wire type {wire} for field {number}")
            if pos > end:
                raise ValueError("message truncated")
    except (ValueError, UnicodeDecodeError) as e:
        chunk.malformed = f"not a KVChunk: {e}"
    return chunk


# ---- decode side: checking a transfer --------------------------------------------------------


class KVChunkError(Exception):
    """A chunk or stream that breaks the transfer; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransferTracker:
    """What one reserved request must still receive: every prompt token of every layer, once,
    except the first `cached_tokens`, whose KV the decode worker already holds (its prefix
    cache): chunks for those are validated like any other and then ignored, so a sender that
    sends them anyway (one that predates the skip) still completes the transfer.

    Pure bookkeeping (no I/O): `accept` validates a chunk and returns torch views of its key and
    value, raising KVChunkError with INVALID_ARGUMENT for anything malformed or out of range.
    """

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        cached_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.torch_dtype = DTYPES[dtype]
        self.itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        self.cached_tokens = cached_tokens
        self._covered = [bytearray(num_tokens) for _ in range(num_layers)]
        self.discarded = False
        self.received_token_layers = 0
        self.chunks = 0
        self.bytes = 0

    @property
    def expected_token_layers(self) -> int:
        return (self.num_tokens - self.cached_tokens) * self.num_layers

    @property
    def complete(self) -> bool:
        return self.received_token_layers == self.expected_token_layers

    def progress(self) -> str:
        return f"{self.received_token_layers} of {self.expected_token_layers} token-layers"

    def discard(self) -> None:
        """The transfer failed: drop the per-token coverage (layers x prompt tokens bytes). The
        counters stay, for `progress` and `complete`; `accept` refuses any further chunk."""
        self._covered = []
        self.discarded = True

    def accept(self, chunk: KVChunkView) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        """Validate one chunk; returns (first layer, first token, k, v) as views into the
        message, shaped [tokens, kv_heads, head_dim] for one layer or [layers, tokens, kv_heads,
        head_dim] for a batch of consecutive layers (what engine.import_kv takes); None for a
        bare last marker or a chunk of cached tokens only."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if self.discarded:
            raise KVChunkError(
                grpc.StatusCode.FAILED_PRECONDITION, f"the transfer of {self.request_id} failed"
            )
        if chunk.malformed:
            raise KVChunkError(bad, chunk.malformed)
        if chunk.request_id != self.request_id:
            raise KVChunkError(
                bad,
                f"request_id: chunk for {chunk.request_id!r} on the stream of {self.request_id!r}",
            )
        if chunk.token_count == 0 and not len(chunk.key) and not len(chunk.value):
            if not chunk.last:
                raise KVChunkError(bad, "token_count: 0 is only allowed on the last chunk")
            return None
        if chunk.dtype != self.dtype:
            raise KVChunkError(
                bad, f"dtype: {chunk.dtype!r} does not match the reservation's {self.dtype!r}"
            )
        first, nl = chunk.layer, chunk.layer_count
        if nl < 1 or not 0 <= first or first + nl > self.num_layers:
            span = f"{first}" if nl == 1 else f"[{first}, {first + nl})"
            raise KVChunkError(
                bad, f"layer: {span} is outside [0, {self.num_layers - 1}] (layer_count {nl})"
            )
        start, count = chunk.token_start, chunk.token_count
        if count < 0 or start < 0 or start + count > self.num_tokens:
            raise KVChunkError(
                bad,
                f"token_start/token_count: [{start}, {start + count}) is outside the "
                f"{self.num_tokens} reserved prompt tokens",
            )
        per_layer = count * self.num_kv_heads * self.head_dim * self.itemsize
        expected = nl * per_layer
        for name, data in (("key", chunk.key), ("value", chunk.value)):
            if len(data) != expected:
                raise KVChunkError(
                    bad,
                    f"{name}: {len(data)} bytes, expected {expected} (layers {nl} x token_count "
                    f"{count} x kv_heads {self.num_kv_heads} x head_dim {self.head_dim} x "
                    f"{self.itemsize} bytes of {self.dtype})",
                )
        self.chunks += 1
        self.bytes += len(chunk.key) + len(chunk.value)
        skip = max(0, min(count, self.cached_tokens - start))  # leading tokens held already
        start, count = start + skip, count - skip
        if count == 0:
            return None
        for layer in range(first, first + nl):
            if self._covered[layer].find(1, start, start + count) != -1:
                raise KVChunkError(
                    bad,
                    f"duplicate chunk: layer {layer} tokens [{start}, {start + count}) "
                    "overlap tokens already received",
                )
        ones = b"\x01" * count
        for layer in range(first, first + nl):
            self._covered[layer][start : start + count] = ones
        # One tensor view per side for the whole chunk: the engine imports every layer of a
        # batch in one call (per-layer views and calls cost more than the copy for small slices).
        layer_shape = (skip + count, self.num_kv_heads, self.head_dim)
        shape = (nl, *layer_shape) if nl > 1 else layer_shape
        k = torch.frombuffer(chunk.key, dtype=self.torch_dtype).view(shape)
        v = torch.frombuffer(chunk.value, dtype=self.torch_dtype).view(shape)
        if skip:
            k, v = k[..., skip:, :, :], v[..., skip:, :, :]
        self.received_token_layers += count * nl
        return first, start, k, v


# ---- prefill side: sending a transfer --------------------------------------------------------


# A decode endpoint's channels close after this long without a transfer, and beyond this many
# endpoints the least recently used idle one closes (a new transfer reconnects in ~1 ms).
CHANNEL_IDLE_SECONDS = 600.0
MAX_PEERS = 256


class ChannelPool:
    """A few sync gRPC channels per decode endpoint (each its own TCP connection).

    Transfers take the least busy channel, the lowest index on ties: one transfer at a time
    always reuses the same warm connection (its HTTP/2 windows already grown by earlier
    transfers), while concurrent transfers to one peer spread over connections. All channels of
    an endpoint start connecting when it is first used, so no later transfer pays the TCP and
    HTTP/2 handshakes.

    Endpoints come and go (decode pods of a rollout or a scale-down, or any address a caller
    names), so an endpoint with no transfer for `idle_s` seconds is closed, as is the least
    recently used idle one beyond `max_peers`: otherwise each would keep its channels, their
    reconnect attempts and the threads of their readiness watches for the process's life.
    """

    def __init__(
        self,
        channels_per_peer: int = DEFAULT_CHANNELS_PER_PEER,
        idle_s: float = CHANNEL_IDLE_SECONDS,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channels_per_peer = channels_per_peer
        self.idle_s = idle_s
        self.max_peers = max_peers
        self._clock = clock
        self._lock = threading.Lock()
        self._channels: dict[str, list[grpc.Channel]] = {}
        self._ready: dict[str, list[grpc.Future]] = {}
        self._busy: dict[str, list[int]] = {}
        self._used: dict[str, float] = {}  # endpoint -> last acquire or release
        self._closers: list[threading.Timer] = []  # deferred closes (CLOSE_AFTER_UNWATCH_S)

    def _pick(self, endpoint: str) -> int:
        """Index of the least busy channel for `endpoint` (created on first use); holds _lock."""
        now = self._clock()
        if endpoint not in self._channels:
            self._evict(now)
            chans = [
                grpc.insecure_channel(
                    endpoint,
                    options=kv_channel_options() + [("grpc.channel_id", i)],
                    compression=grpc.Compression.NoCompression,
                )
                for i in range(self.channels_per_peer)
            ]
            # Connect now, not on the first RPC (the future unsubscribes once READY, or when
            # cancelled at eviction: one that never connects would watch forever).
            self._ready[endpoint] = [grpc.channel_ready_future(c) for c in chans]
            self._channels[endpoint] = chans
            self._busy[endpoint] = [0] * self.channels_per_peer
        self._used[endpoint] = now
        busy = self._busy[endpoint]
        return min(range(len(busy)), key=busy.__getitem__)

    def _evict(self, now: float) -> None:
        """Closes idle endpoints: unused for idle_s, then the oldest beyond max_peers - 1."""
        idle = sorted(
            (e for e in self._channels if not any(self._busy[e])), key=self._used.__getitem__
        )
        over = len(self._channels) - (self.max_peers - 1)
        for i, endpoint in enumerate(idle):
            if i < over or now - self._used[endpoint] >= self.idle_s:
                self._close(endpoint)

    def _close(self, endpoint: str) -> None:
        """Closes an endpoint's channels: now if they connected, else once grpc's poller has
        seen their readiness watch cancelled (holds _lock)."""
        watched = [future.cancel() for future in self._ready.pop(endpoint, [])]
        for channel, unwatched in zip(self._channels.pop(endpoint, []), watched, strict=True):
            if not unwatched:
                channel.close()
                continue
            closer = threading.Timer(CLOSE_AFTER_UNWATCH_S, channel.close)
            closer.daemon = True
            closer.start()
            self._closers = [t for t in self._closers if t.is_alive()] + [closer]
        self._busy.pop(endpoint, None)
        self._used.pop(endpoint, None)

    def get(self, endpoint: str) -> grpc.Channel:
        """The channel a transfer would get now (not marked busy)."""
        with self._lock:
            i = self._pick(endpoint)
            return self._channels[endpoint][i]

    def acquire(self, endpoint: str) -> tuple[int, grpc.Channel]:
        """The least busy channel, marked busy until `release(endpoint, index)`."""
        with self._lock:
            i = self._pick(endpoint)
            self._busy[endpoint][i] += 1
            return i, self._channels[endpoint][i]

    def release(self, endpoint: str, index: int) -> None:
        with self._lock:
            busy = self._busy.get(endpoint)
            if busy is not None and busy[index] > 0:
                busy[index] -= 1
                self._used[endpoint] = self._clock()

    @property
    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._channels)

    def push_kv(self, endpoint: str) -> grpc.StreamUnaryMultiCallable:
        return push_kv_callable(self.get(endpoint))

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._channels):
                self._close(endpoint)

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Waits for deferred closes; True when every closed channel is closed."""
        with self._lock:
            closers = list(self._closers)
        deadline = None if timeout is None else time.monotonic() + timeout
        for closer in closers:
            closer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in closers)


def push_kv_callable(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    # Messages are already serialized (encode_kv_chunk), so the serializer is the identity.
    return channel.stream_unary(
        PUSH_KV_METHOD,
        request_serializer=lambda b: b,
        response_deserializer=serving_pb2.PushKVResponse.FromString,
    )


class _Closed(Exception):
    pass


@dataclass
class _Batch:
    """Small layer slices of one token range waiting to leave, merged into one message.

    Open (the engine may still append the next layer) until sealed: when it is full, carries
    the last token-layer, something is queued behind it, or the sender takes it after
    `deadline` (BATCH_MAX_WAIT_S after its first slice)."""

    layer: int
    token_start: int
    token_count: int
    keys: list[KVBuffer] = field(default_factory=list)
    values: list[KVBuffer] = field(default_factory=list)
    nbytes: int = 0
    last: bool = False
    sealed: bool = False
    deadline: float = 0.0

    def encode(self, request_id: str, dtype: str) -> bytes:
        return encode_kv_chunk(
            request_id, self.layer, self.token_start, self.token_count, dtype,
            self.keys, self.values, last=self.last, layer_count=len(self.keys),
        )  # fmt: skip


_Item = bytes | _Batch | None  # a finished message, a mergeable batch, or the end


class ChunkQueue:
    """Bounded by bytes, between the engine thread (put blocks when full: backpressure) and the
    gRPC request iterator. A small slice joins the open batch at the tail (`merge_small`).

    The sender is woken only when there is something it should take now: a finished message,
    a sealed batch, or a new open batch (whose deadline it then sleeps until). Appending to an
    open batch wakes nobody: a sender woken on every slice took half-built batches, so a 1 MB
    transfer left as 1 to 8 messages depending on thread timing, each costing a gRPC round of
    hand-offs. `close` wakes both sides; puts after close are dropped."""

    def __init__(self, max_bytes: int, batch_wait: float = BATCH_MAX_WAIT_S) -> None:
        self.max_bytes = max_bytes
        self.batch_wait = batch_wait
        self._items: deque[_Item] = deque()
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    @staticmethod
    def _size(item: _Item) -> int:
        if item is None:
            return 0
        return item.nbytes if isinstance(item, _Batch) else len(item)

    def _seal_tail(self) -> None:
        """Nothing more joins the tail batch (holds _cond)."""
        tail = self._items[-1] if self._items else None
        if isinstance(tail, _Batch) and not tail.sealed:
            tail.sealed = True
            self._cond.notify_all()

    def put(self, item: _Item) -> bool:
        size = self._size(item)
        with self._cond:
            self._seal_tail()  # before waiting: a full queue must be able to drain
            # An item larger than the whole budget still goes in once the queue is empty.
            while not self._closed and self._items and self._bytes + size > self.max_bytes:
                self._cond.wait()
            if self._closed:
                return False
            self._seal_tail()
            if isinstance(item, _Batch) and not item.sealed:
                item.deadline = time.monotonic() + self.batch_wait
            self._items.append(item)
            self._bytes += size
            self._cond.notify_all()
            return True

    def merge_small(
        self, layer: int, start: int, count: int, k: KVBuffer, v: KVBuffer, last: bool, limit: int
    ) -> bool:
        """Append a slice to the open tail batch if it continues it (same tokens, next layer)
        and stays within `limit` bytes; else queue a new batch. A batch is sealed once another
        slice of this size would not fit, or with the last token-layer. False once closed."""
        size = len(k) + len(v)
        with self._cond:
            tail = self._items[-1] if self._items else None
            if (
                isinstance(tail, _Batch)
                and not tail.sealed
                and not self._closed
                and tail.token_start == start
                and tail.token_count == count
                and tail.layer + len(tail.keys) == layer
                and tail.nbytes + size <= limit
            ):
                tail.keys.append(k)
                tail.values.append(v)
                tail.nbytes += size
                tail.last = last
                self._bytes += size
                if last or tail.nbytes + size > limit:
                    tail.sealed = True
                    self._cond.notify_all()
                return True
        sealed = last or 2 * size > limit
        return self.put(_Batch(layer, start, count, [k], [v], size, last, sealed))

    def get(self) -> _Item:
        """Next item, or None at the end of the stream; raises _Closed if closed early. An open
        batch at the head is taken once sealed or past its deadline."""
        with self._cond:
            while True:
                if self._items:
                    head = self._items[0]
                    if not isinstance(head, _Batch) or head.sealed:
                        break
                    wait = head.deadline - time.monotonic()
                    if wait <= 0:
                        head.sealed = True
                        break
                    self._cond.wait(wait)
                elif self._closed:
                    raise _Closed
                else:
                    self._cond.wait()
            item = self._items.popleft()
            self._bytes -= self._size(item)
            self._cond.notify_all()
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._bytes = 0
            self._cond.notify_all()


@dataclass
class TransferResult:
    bytes: int
    chunks: int
    first_send: float  # time.monotonic() when the first chunk left the queue
    acked: float  # when decode acknowledged the complete transfer


class KVSender:
    """Streams one request's KV to a decode worker as the engine computes it.

    `on_kv` is the engine callback (engine thread): it copies the slice into ready-to-send
    messages, split to at most `chunk_bytes` (or, for a slice of at most chunk_bytes /
    SMALL_FRACTION, holds it in the open batch of the layers before it, copied once when the
    batch is encoded: `slice_view`), and blocks while the queue
    is full. The message carrying the last token-layer has `last` set. `start` opens the
    PushKV stream (gRPC's own thread drains the queue); `future` resolves to a TransferResult
    or raises grpc.RpcError.
    """

    def __init__(
        self,
        pool: ChannelPool,
        endpoint: str,
        request_id: str,
        num_tokens: int,
        num_layers: int,
        dtype: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        timeout: float | None = None,
        hold_until_done: bool = False,
        batch_wait: float = BATCH_MAX_WAIT_S,
        skip_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.request_id = request_id
        self.dtype = dtype
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        # The decode worker holds the first skip_tokens' KV (its prefix cache): not sent.
        self.skip_tokens = skip_tokens
        self.expected_token_layers = (num_tokens - skip_tokens) * num_layers
        self.sent_token_layers = 0  # counted in on_kv, i.e. queued
        self.queue = ChunkQueue(queue_bytes, batch_wait)
        self.bytes = 0
        self.chunks = 0
        self.first_kv_at: float | None = None
        self.last_kv_at: float | None = None
        self._first_send: float | None = None
        self._call: Any = None
        self._channel_index = 0
        self.future: Future[TransferResult] = Future()
        # Ablation (bench/kv_transfer.py): keep every message until prefill ends, then send,
        # i.e. no layer-wise overlap. Unbounded by design; never the serving default.
        self.hold_until_done = hold_until_done
        self._held: list[bytes] = []

    # engine thread
    def on_kv(
        self, request_id: str, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        now = time.monotonic()
        if self.first_kv_at is None:
            self.first_kv_at = now
        if token_start < self.skip_tokens:
            held = min(int(k.shape[0]), self.skip_tokens - token_start)
            if held == int(k.shape[0]):
                return
            k, v, token_start = k[held:], v[held:], token_start + held
        n = int(k.shape[0])
        nbytes = k.numel() * k.element_size()
        if 2 * nbytes <= self.chunk_bytes // SMALL_FRACTION and not self.hold_until_done:
            # Small slice (short prompt or many layers): hold it (slice_view) and let it ride
            # with the next layers in one message, since per-message cost dominates here.
            self.sent_token_layers += n
            self.bytes += 2 * nbytes
            last = self.sent_token_layers >= self.expected_token_layers
            ok = self.queue.merge_small(
                layer, token_start, n, slice_view(k), slice_view(v), last, self.chunk_bytes
            )
            if ok and last:
                self.queue.put(None)
            self.last_kv_at = time.monotonic()
            return
        kb, vb = tensor_bytes(k), tensor_bytes(v)
        per_token = len(kb) // n if n else 0
        step = max(1, self.chunk_bytes // max(1, 2 * per_token)) if per_token else max(n, 1)
        for off in range(0, n, step):
            cnt = min(step, n - off)
            self.sent_token_layers += cnt
            last = self.sent_token_layers >= self.expected_token_layers
            kpart = kb[off * per_token : (off + cnt) * per_token]
            vpart = vb[off * per_token : (off + cnt) * per_token]
            self.bytes += 2 * cnt * per_token
            self.chunks += 1
            message = encode_kv_chunk(
                request_id, layer, token_start + off, cnt, self.dtype, kpart, vpart, last=last
            )
            if self.hold_until_done:
                self._held.append(message)
                continue
            if not self.queue.put(message):
                return  # the stream already failed; the caller sees it in `future`
            if last:
                self.queue.put(None)
        self.last_kv_at = time.monotonic()

    def _messages(self) -> Iterator[bytes]:
        while True:
            try:
                item = self.queue.get()
            except _Closed:
                return
            if item is None:
                return
            if self._first_send is None:
                self._first_send = time.monotonic()
            if isinstance(item, _Batch):
                self.chunks += 1
                item = item.encode(self.request_id, self.dtype)
            yield item

    def start(self) -> None:
        self._channel_index, channel = self.pool.acquire(self.endpoint)
        try:
            call = push_kv_callable(channel).future(
                self._messages(),
                timeout=self.timeout,
                metadata=((REQUEST_ID_METADATA, self.request_id),),
                compression=grpc.Compression.NoCompression,
            )
        except BaseException:
            self.pool.release(self.endpoint, self._channel_index)
            raise
        self._call = call
        call.add_done_callback(self._done)

    def _done(self, call: Any) -> None:
        self.queue.close()  # unblocks an engine thread waiting in on_kv
        self.pool.release(self.endpoint, self._channel_index)
        try:
            try:
                call.result()
            except Exception as e:  # grpc.RpcError, or FutureCancelledError for a cancelled call
                self.future.set_exception(e)
                return
            acked = time.monotonic()
            self.future.set_result(
                TransferResult(
                    bytes=self.bytes,
                    chunks=self.chunks,
                    first_send=self._first_send or acked,
                    acked=acked,
                )
            )
        except InvalidStateError:
            # Whoever waited gave up first (the Prefill call was cancelled, and asyncio's
            # wrap_future cancelled `future`): there is nobody left to tell.
            pass

    def release_held(self) -> None:
        """Send-after-prefill ablation: prefill is done, let the held messages go."""
        held, self._held = self._held, []
        for msg in held:
            if not self.queue.put(msg):
                return
        if held:
            self.queue.put(None)

    def finish_incomplete(self) -> None:
        """Prefill ended but not every token-layer was queued (should not happen with a correct
        engine): send a bare last marker so decode rejects the transfer instead of waiting."""
        if self.sent_token_layers < self.expected_token_layers:
            self.queue.put(encode_kv_chunk(self.request_id, 0, 0, 0, self.dtype, b"", b"", True))
            self.queue.put(None)

    def cancel(self) -> None:
        self.queue.close()
        if self._call is not None:
            self._call.cancel()
