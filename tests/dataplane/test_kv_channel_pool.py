"""KV sender channel pool (kv_transfer.ChannelPool) against a real local gRPC server: which
connection a transfer gets, eager connection, and the allocator setting the KV roles apply.
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
