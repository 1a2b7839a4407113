"""Shared fixtures for the data-plane tests: a tiny random-weight model made once per session with
`splitserve make-model`, and a launcher for real worker processes (`splitserve prefill|decode|
colocated|router ...`) that waits for their READY line. Worker and router tests both use these."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY_RE = re.compile(
    r"^READY role=(?P<role>\S+) port=(?P<port>\d+)(?: metrics_port=(?P<mport>\d+))?"
)
# Generous: a worker imports torch and loads a model on a busy 2-core machine. This bounds a hang,
# it does not measure anything.
START_TIMEOUT_S = 300.0


def child_env() -> dict[str, str]:
    """Environment for worker subprocesses: one thread each, so several fit on two cores."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def splitserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve_workers.cli", *args]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny-llama model directory (config.json, model.safetensors, tokenizer.json)."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    subprocess.run(
        splitserve_cmd("make-model", "--preset", "tiny-llama", "--out", str(out)),
        check=True,
        env=child_env(),
    )
    return out


@dataclass
class WorkerProcess:
    """A running `splitserve <role>` subprocess; its ports come from its READY line."""

    role: str
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int | None
    log_path: Path
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM (the worker drains) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process vanishes without draining (a crashed pod)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def launch(role: str, args: list[str], log_dir: Path, name: str | None = None) -> WorkerProcess:
    """Start `splitserve <role> <args>` and wait for its READY line (raises with the log)."""
    name = name or role
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(
        splitserve_cmd(role, *args),
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    ready: dict[str, re.Match[str]] = {}
    found = threading.Event()

    def pump() -> None:
        # Keep draining stdout for the process's whole life so it never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = READY_RE.match(line)
            if m and not found.is_set():
                ready["m"] = m
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(START_TIMEOUT_S) or "m" not in ready:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        raise RuntimeError(
            f"{name} did not become ready (exit {proc.returncode}); stdout: {lines[-20:]}\n"
            f"log:\n{log_path.read_text(errors='replace')[-4000:]}"
        )
    m = ready["m"]
    return WorkerProcess(
        role=m["role"],
        proc=proc,
        port=int(m["port"]),
        metrics_port=int(m["mport"]) if m["mport"] else None,
        log_path=log_path,
        stdout_lines=lines,
    )


def _launcher(log_dir: Path) -> Iterator:
    started: list[WorkerProcess] = []
    counter = [0]

    def _launch(role: str, args: list[str], name: str | None = None) -> WorkerProcess:
        counter[0] += 1
        w = launch(role, args, log_dir, name or f"{role}-{counter[0]}")
        started.append(w)
        return w

    yield _launch
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=30)


@pytest.fixture
def launch_worker(tmp_path: Path) -> Iterator:
    """Factory: `launch_worker("decode", [...args])`; every process is killed at teardown."""
    yield from _launcher(tmp_path)


@pytest.fixture(scope="module")
def launch_module_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Like launch_worker, for processes shared by a whole test module (started once)."""
    yield from _launcher(tmp_path_factory.mktemp("workers"))


def worker_args(model: Path, *extra: str) -> list[str]:
    """The usual flags for a test worker: free ports, CPU, one thread."""
    return [
        "--model",
        str(model),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--threads",
        "1",
        # A small cache (16 MiB) keeps several test workers within memory; --num-kv-blocks in
        # `extra` overrides it.
        "--kv-cache-memory",
        str(16 << 20),
        *extra,
    ]


@pytest.fixture(scope="session")
def worker_flags() -> object:
    """`worker_flags(model, *extra)` -> the usual CLI flags for a test worker."""
    return worker_args


class DataPlaneClient:
    """A minimal router stand-in for worker tests: Reserve -> Prefill -> Generate over real gRPC,
    plus Load and raw channels. One instance per test (channels are per event loop)."""

    def __init__(self) -> None:
        import grpc.aio

        self._grpc_aio = grpc.aio
        self._channels: dict[str, object] = {}

    def channel(self, endpoint: str):  # -> grpc.aio.Channel
        if endpoint not in self._channels:
            self._channels[endpoint] = self._grpc_aio.insecure_channel(
                endpoint,
                options=[
                    ("grpc.max_send_message_length", 256 << 20),
                    ("grpc.max_receive_message_length", 256 << 20),
                ],
            )
        return self._channels[endpoint]

    def decode(self, endpoint: str):
        from splitserve_workers.proto import serving_pb2_grpc

        return serving_pb2_grpc.DecodeServiceStub(self.channel(endpoint))

    def prefill(self, endpoint: str):
        from splitserve_workers.proto import serving_pb2_grpc

        return serving_pb2_grpc.PrefillServiceStub(self.channel(endpoint))

    def colocated(self, endpoint: str):
        from splitserve_workers.proto import serving_pb2_grpc

        return serving_pb2_grpc.ColocatedServiceStub(self.channel(endpoint))

    async def load(self, endpoint: str, role: str = "decode"):
        from splitserve_workers.proto import serving_pb2

        stub = {"decode": self.decode, "prefill": self.prefill, "colocated": self.colocated}[role](
            endpoint
        )
        return await stub.Load(serving_pb2.LoadRequest())

    async def generate_disaggregated(
        self,
        prefill_ep: str,
        decode_ep: str,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        ignore_eos: bool = True,
    ) -> tuple[list[int], object, object]:
        """Reserve on decode, Prefill (KV pushed to decode), Generate. Returns (all tokens
        including the first, FirstToken, TransferDone)."""
        from splitserve_workers.proto import serving_pb2 as pb

        decode = self.decode(decode_ep)
        spec = (await self.load(decode_ep)).model
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        res = await decode.Reserve(
            pb.ReserveRequest(
                request_id=request_id,
                model=spec,
                num_prompt_tokens=len(prompt),
                max_tokens=max_tokens,
            )
        )
        assert res.accepted, res.reason
        first = done = None
        async for ev in self.prefill(prefill_ep).Prefill(
            pb.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                decode_endpoint=decode_ep,
                decode_model=spec,
            )
        ):
            if ev.HasField("first_token"):
                first = ev.first_token
            else:
                done = ev.transfer_done
        assert first is not None and done is not None
        tokens = [first.token_id]
        async for ev in decode.Generate(
            pb.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                first_token=first.token_id,
                sampling=sampling,
            )
        ):
            tokens.extend(ev.token_ids)
            if ev.finished:
                break
        return tokens, first, done

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()  # type: ignore[attr-defined]


@pytest.fixture
async def dataplane() -> object:
    client = DataPlaneClient()
    yield client
    await client.close()
