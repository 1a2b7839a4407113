"""KV sender channel pool (kv_transfer.ChannelPool) against a real local gRPC server: which
connection a transfer gets, eager connection, closing idle and surplus endpoints, and the
allocator setting the KV roles apply.
The transfers themselves are covered by test_workers_disagg.py and test_faults_kv.py."""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from splitserve_workers.kv_transfer import ChannelPool, keep_large_buffers_in_heap


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_sequential_transfers_reuse_the_first_channel_concurrent_ones_spread(
    endpoint: str,
) -> None:
    pool = ChannelPool(channels_per_peer=3)
    try:
        i, first = pool.acquire(endpoint)
        assert i == 0
        pool.release(endpoint, i)
        # One transfer at a time: always the same (warm) connection.
        for _ in range(3):
            j, chan = pool.acquire(endpoint)
            assert (j, chan) == (0, first)
            pool.release(endpoint, j)
        # Concurrent transfers: each gets the least busy channel.
        held = [pool.acquire(endpoint) for _ in range(4)]
        assert [j for j, _ in held] == [0, 1, 2, 0]
        assert len({id(c) for _, c in held[:3]}) == 3
        pool.release(endpoint, 1)
        assert pool.get(endpoint) is held[1][1]  # get() does not mark the channel busy
        assert pool.acquire(endpoint)[0] == 1
        pool.release(endpoint, 2)
        pool.release(endpoint, 2)  # an extra release never goes below zero
        assert pool.acquire(endpoint)[0] == 2
        assert pool.acquire(endpoint)[0] == 1
    finally:
        pool.close()


def test_channels_connect_before_the_first_transfer(endpoint: str) -> None:
    pool = ChannelPool(channels_per_peer=2)
    try:
        pool.get(endpoint)  # creates the endpoint's channels; no RPC is made
        for chan in pool._channels[endpoint]:
            ready = threading.Event()

            def seen(state: grpc.ChannelConnectivity, ready: threading.Event = ready) -> None:
                if state is grpc.ChannelConnectivity.READY:
                    ready.set()

            chan.subscribe(seen, try_to_connect=False)  # observe only, never ask to connect
            assert ready.wait(30), "pooled channel did not connect on its own"
            chan.unsubscribe(seen)
    finally:
        pool.close()


def test_keep_large_buffers_in_heap_applies_on_glibc() -> None:
    applied = keep_large_buffers_in_heap()
    assert isinstance(applied, bool)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert applied


def test_idle_and_surplus_endpoints_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode pods come and go (rollouts, scale-downs), and any caller can name an endpoint:
    # each one's channels, reconnects and readiness watch must not stay for the process's
    # life. Nothing listens on these ports; no RPC is made, so every readiness watch is
    # still running when its endpoint is closed.
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    now = [0.0]
    pool = ChannelPool(channels_per_peer=2, idle_s=600.0, max_peers=3, clock=lambda: now[0])
    a, b, c, d = (f"127.0.0.1:{port}" for port in (9, 19, 29, 39))
    try:
        i, _ = pool.acquire(a)
        pool.release(a, i)
        busy_index, _ = pool.acquire(b)  # a transfer in flight
        now[0] = 601.0
        pool.get(c)  # a new endpoint: a has been idle past idle_s
        assert pool.endpoints == [b, c]
        now[0] = 1300.0
        pool.get(d)  # b is busy, so it stays however long; c is idle past idle_s
        assert pool.endpoints == [b, d]
        pool.release(b, busy_index)
        # Beyond max_peers the least recently used idle endpoint goes first.
        now[0] = 1301.0
        pool.get(a)
        now[0] = 1302.0
        pool.get(c)
        assert pool.endpoints == [d, a, c]  # b and d were equally old; b was first
    finally:
        pool.close()
    assert pool.endpoints == []
    assert pool.wait_closed(timeout=30)  # bounds a hang only
    # Closing a channel under grpc's connectivity poller used to kill that thread.
    assert died == []
