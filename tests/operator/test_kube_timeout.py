"""The operator's API layer gives up on an API server that accepts a connection and then says
nothing (a partition, a frozen control plane): without a timeout the call blocked forever,
holding the LLMService's reconcile lock."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from kubernetes import client
from splitserve_operator.kube import Kube, Ref


def test_a_silent_api_server_times_out_instead_of_blocking_forever() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)  # read nothing, answer nothing, never close

    threading.Thread(target=accept, daemon=True).start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.getsockname()[1]}"
    config.retries = False  # the timeout under test, not urllib3's retries of it
    kube = Kube(client.ApiClient(config))
    kube.timeout = (1.0, 1.0)
    outcome: list[Any] = []

    def call() -> None:
        try:
            kube.get(Ref("apps/v1", "Deployment", "ns", "chat-decode"))
            outcome.append("answered")
        except Exception as e:  # noqa: BLE001 - any error is the point: the call returned
            outcome.append(e)

    started = time.monotonic()
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(20)
    try:
        assert not caller.is_alive(), "Kube.get still blocked on a silent API server after 20 s"
        assert outcome and outcome[0] != "answered"
        assert time.monotonic() - started < 20
    finally:
        server.close()
        for conn in held:
            conn.close()
