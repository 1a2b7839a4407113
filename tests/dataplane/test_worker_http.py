"""The workers' /health /ready /metrics server (worker_http.py) over a real socket: probes and
scrapes work, and a peer cannot make it read a request body or oversized headers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from splitserve_workers.worker_http import MAX_BODY_BYTES, WorkerStatus, start_http


@pytest.fixture
async def port() -> AsyncIterator[int]:
    registry = CollectorRegistry()
    runner, bound = await start_http(WorkerStatus(loaded=True), registry, "127.0.0.1", 0)
    yield bound
    await runner.cleanup()


async def exchange(port: int, head: str, body: bytes = b"") -> tuple[int, bytes, bool]:
    """Sends one raw request; returns (status, response, whether the server closed after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()
    response = await reader.readuntil(b"\r\n\r\n")
    status = int(response.split(b" ", 2)[1])
    try:
        rest = await asyncio.wait_for(reader.read(65536), 5)
        while rest:  # the response body, then EOF if the server closed the connection
            more = await asyncio.wait_for(reader.read(65536), 5)
            if not more:
                break
            rest += more
        closed = True
    except TimeoutError:
        closed = False
    writer.close()
    return status, response, closed


async def test_probes_and_metrics_answer(port: int) -> None:
    status, _, _ = await exchange(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 200
    status, _, _ = await exchange(port, "GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 200
    status, _, _ = await exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 200


async def test_a_declared_body_over_the_limit_is_refused_unread(port: int) -> None:
    # Only the headers are sent: the 413 must come without the server waiting for 1 GiB.
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 30}\r\n"
    status, _, closed = await exchange(port, head)
    assert status == 413
    assert closed


async def test_a_chunked_body_is_refused(port: int) -> None:
    head = "GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    status, _, closed = await exchange(port, head, b"400\r\n" + b"a" * 1024 + b"\r\n")
    assert status == 413
    assert closed


async def test_a_small_body_is_tolerated(port: int) -> None:
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES}\r\n"
    head += "Connection: close\r\n"
    status, _, _ = await exchange(port, head, b"a" * MAX_BODY_BYTES)
    assert status == 200


async def test_oversized_or_too_many_headers_are_refused(port: int) -> None:
    long = "GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + "a" * 20000 + "\r\n"
    status, _, _ = await exchange(port, long)
    assert status in (400, 431)
    many = "GET /health HTTP/1.1\r\nHost: x\r\n" + "".join(f"X-{i}: v\r\n" for i in range(100))
    status, _, _ = await exchange(port, many)
    assert status in (400, 431)
