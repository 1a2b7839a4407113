"""The workers' /health /ready /metrics server (worker_http.py) over a real socket: probes and
scrapes work, and a peer cannot make it read a request body or oversized headers."""

from __future__ import annotations

import asyncio
import json
import logging
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


@pytest.mark.parametrize(
    ("case", "head", "words"),
    [
        (
            "a header over the limit",
            "GET /health HTTP/1.1\r\nX-Long: " + "a" * 20000 + "\r\n",
            "longer",
        ),
        (
            "too many headers",
            "GET /health HTTP/1.1\r\n" + "".join(f"X-{i}: v\r\n" for i in range(100)),
            "too many headers",
        ),
        ("TLS on the plain port", "\x16\x03\x01\x02\x00\x01\x00\r\n", "https"),
    ],
)
async def test_malformed_requests_get_a_json_error_and_no_error_log(
    port: int, case: str, head: str, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    status, response, closed = await exchange(port, head)
    assert status == 400, (case, response)
    assert b"application/json" in response.lower(), response
    assert closed
    # The body (read again: exchange returns only the head).
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode("latin-1") + b"\r\n")
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    error = json.loads(raw.partition(b"\r\n\r\n")[2])["error"]
    assert words in error.lower(), error
    # The client's fault, not the worker's: aiohttp alone logs each as an ERROR with a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    status, _, _ = await exchange(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 200
