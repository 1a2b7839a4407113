"""A network partition between the operator and the API server: connections that go silent
without being closed. The operator's own API calls used to have no timeout, so a reconcile
caught in one blocked for good with the LLMService's lock held: after the partition healed,
that LLMService was never reconciled again (no drift repair, no spec change applied)."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from operator_process import OperatorProcess, get_json, is_ready, wait_until
from test_operator_cluster import apply, llms, tiny, wait_ready

pytestmark = pytest.mark.cluster


class PartitionProxy:
    """A TCP relay to the API server. While `partitioned`, every connection that carries a
    byte (or is opened) goes silent for good, never closed; connections opened after it heals
    work again."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.partitioned = False
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
                up = socket.create_connection(self.upstream)
            except OSError:
                if self.sock.fileno() == -1:
                    return
                continue
            self.sockets += [conn, up]
            silent = {"yes": self.partitioned}
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b, silent), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, silent: dict[str, bool]) -> None:
        while True:
            try:
                data = a.recv(65536)
            except OSError:
                return
            if not data:
                if not silent["yes"]:
                    try:
                        b.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                return
            silent["yes"] = silent["yes"] or self.partitioned
            if silent["yes"]:
                continue
            try:
                b.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for s in self.sockets:
            s.close()


@pytest.fixture
def proxied_operator(
    control_plane: Any, cluster_release: Any
) -> Iterator[tuple[OperatorProcess, PartitionProxy]]:
    kubeconfig = control_plane.kubeconfig_for_service_account(
        cluster_release.namespace, cluster_release.service_account
    )
    doc = yaml.safe_load(Path(kubeconfig).read_text())
    server = urlparse(doc["clusters"][0]["cluster"]["server"])
    proxy = PartitionProxy(str(server.hostname), int(server.port or 443))
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    suffix = uuid.uuid4().hex[:6]
    proxied = Path(control_plane.workdir) / f"operator-proxied-{suffix}.kubeconfig"
    proxied.write_text(yaml.safe_dump(doc))
    log = Path(control_plane.workdir) / "logs" / f"operator-{suffix}.log"
    proc = OperatorProcess(
        proxied, ["--all-namespaces", "--resync-seconds=2", "--peering=splitserve"], log
    )
    proc.start()
    try:
        yield proc, proxy
    finally:
        proc.stop()
        proxy.close()


def test_reconciles_resume_after_a_partition_heals(
    control_plane: Any, proxied_operator: tuple[OperatorProcess, PartitionProxy], namespace: str
) -> None:
    cp = control_plane
    operator, proxy = proxied_operator
    apply(cp, namespace, tiny())
    wait_ready(cp, namespace, "tiny")
    proxy.partitioned = True
    time.sleep(15)  # resyncs (every 2 s) run into it
    proxy.partitioned = False
    cp.kubectl("delete", "-n", namespace, "service", "tiny-router")
    cp.kubectl("patch", "-n", namespace, "llmservice", "tiny", "--type=merge", "-p",
               json.dumps({"spec": {"decode": {"maxBatchSize": 44}}}))  # fmt: skip
    wait_until(
        lambda: get_json(cp, "-n", namespace, "service", "tiny-router"),
        f"the deleted router Service recreated\n{operator.tail()}",
        120,
    )
    wait_until(
        lambda: is_ready(llms(cp, namespace, "tiny")),
        f"the spec change applied\n{operator.tail()}",
        120,
    )
