"""A streaming client that stops reading but keeps its connection open is cut after
--write-timeout: its request is aborted on the decode worker (its stream there ends), it is
counted as `stalled`, and the router serves others. Without the cut it held the connection,
the decode worker's Generate stream and every token made for it, for as long as it liked."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_failures import WAIT_S, load, router_args, wait_ready

pytestmark = pytest.mark.slow


def test_a_client_that_stops_reading_is_cut(
    tiny_model: Path, launch_worker: Any, worker_flags: Any
) -> None:
    prefill = launch_worker("prefill", worker_flags(tiny_model))
    decode = launch_worker("decode", worker_flags(tiny_model))
    pools = ("--prefill", prefill.endpoint, "--decode", decode.endpoint)
    router = launch_worker("router", router_args(tiny_model, *pools, "--write-timeout", "1"))
    base = f"http://127.0.0.1:{router.port}"
    wait_ready(base)
    # Far more than the router's socket buffer (4 MiB at most) holds: its writes must wait.
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "a long story begins",
            "max_tokens": 1000,
            "n": 48,
            "logprobs": 5,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", router.port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    try:
        assert client.recv(12) == b"HTTP/1.1 200"  # then it reads nothing more
        deadline = time.monotonic() + WAIT_S
        metrics = ""
        while time.monotonic() < deadline:
            metrics = httpx.get(base + "/metrics", timeout=WAIT_S).text
            if 'status="stalled"' in metrics:
                break
            time.sleep(0.2)
        assert 'status="stalled"' in metrics
        # Nothing is left running for it on the decode worker.
        while time.monotonic() < deadline and load(decode.endpoint, "decode").running:
            time.sleep(0.1)
        assert load(decode.endpoint, "decode").running == 0
        # ... because it was aborted, not because it ran to the end: far fewer tokens were
        # generated than the request asked for.
        assert decode.metrics_port is not None
        page = httpx.get(f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=WAIT_S).text
        (generated,) = [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("splitserve_generation_tokens_processed_total{")
        ]
        assert generated < 0.9 * 48 * 1000, generated
        # Its connection was reset rather than left open.
        client.settimeout(WAIT_S)
        with pytest.raises(ConnectionResetError):
            while client.recv(1 << 16):
                pass
    finally:
        client.close()
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "again", "max_tokens": 4}, timeout=WAIT_S
    )
    assert r.status_code == 200, r.text
