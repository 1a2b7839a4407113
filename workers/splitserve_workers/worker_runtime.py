"""What the three worker processes (`splitserve prefill|decode|colocated`) share: the command-line
flags layered over the ServingConfig file, loading the engine, the gRPC server with the KV channel
settings, the /health /ready /metrics HTTP server (worker_http.py), the READY line, and SIGTERM
draining. Each role module supplies a `Role` with its servicers; see prefill_worker.py,
decode_worker.py, colocated_worker.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry

from splitserve_workers.config import ConfigError, ServingConfig, flag_or
from splitserve_workers.kv_transfer import kv_channel_options, model_fingerprint, model_spec
from splitserve_workers.proto import serving_pb2
from splitserve_workers.worker_http import WorkerMetricsUpdater, WorkerStatus, start_http

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9100
# A reservation lease beyond a day is a typo; ReserveResponse.lease_ms is an int64.
MAX_LEASE_SECONDS = 86400.0


class StartupError(Exception):
    """The worker cannot start here (a port in use, a model that does not load): the command
    prints one line naming what failed and exits 1, instead of a traceback."""


@dataclass
class WorkerSettings:
    role: str
    model_dir: str
    model_name: str
    service: str
    device: str
    dtype: str
    host: str
    port: int
    metrics_port: int
    max_batch_tokens: int
    max_batch_size: int
    kv_cache_memory_bytes: int
    num_kv_blocks: int | None
    block_size: int
    max_model_len: int | None
    drain_timeout_s: float
    lease_s: float
    threads: int | None
    speculative_tokens: int = 0
    kv_send_after_prefill: bool = False  # prefill ablation (bench/kv_transfer.py)
    kv_cache_memory_fraction: float | None = None  # instead of kv_cache_memory_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every worker role; each overrides its value from --config."""
    a = parser.add_argument
    a("--config", help="ServingConfig YAML (the operator mounts /etc/splitserve/config.yaml)")
    a("--model", help="Hugging Face-format model directory (overrides model.path)")
    a("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    a("--port", type=int, help="gRPC port (0 = pick a free one; the READY line says which)")
    a(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="HTTP port for /health /ready /metrics (default 9100; 0 = pick a free one)",
    )
    a("--device", help="auto | cpu | cuda | cuda:N (overrides model.device)")
    a("--dtype", help="auto | float32 | bfloat16 | float16 (overrides model.dtype)")
    a("--max-batch-tokens", type=int, help="prefill token budget per forward pass")
    a("--max-batch-size", type=int, help="sequences per decode iteration")
    a("--kv-cache-memory", type=int, help="KV cache budget in bytes")
    a(
        "--kv-cache-memory-fraction",
        type=float,
        help="KV cache budget as a share in (0, 1] of the memory free once the weights are "
        "loaded (GPU free memory; on CPU MemAvailable capped by the cgroup limit); instead of "
        "--kv-cache-memory",
    )
    a("--num-kv-blocks", type=int, help="exact number of KV blocks (overrides the budget)")
    a("--block-size", type=int, help="tokens per KV block")
    a("--max-model-len", type=int, help="longest prompt + output in tokens")
    a(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests get to finish after SIGTERM (default 60)",
    )
    a(
        "--lease-seconds",
        type=float,
        help="decode: free a reservation's blocks when no KV chunk arrives for this long",
    )
    a("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    a(
        "--speculative-tokens",
        type=int,
        help="decode: draft tokens (n-gram lookup in the prompt and output) verified per "
        "sequence per decode pass; 0 = off (default)",
    )


def load_settings(role: str, args: argparse.Namespace) -> WorkerSettings:
    cfg = ServingConfig.load(args.config) if args.config else ServingConfig()
    model_dir = args.model or cfg.model.path
    if not model_dir:
        raise ConfigError("model.path: no model directory (pass --model or set it in --config)")
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json")
    pool = cfg.prefill if role == "prefill" else cfg.decode
    if args.kv_cache_memory is not None and args.kv_cache_memory_fraction is not None:
        raise ConfigError(
            "kv_cache_memory: give --kv-cache-memory (bytes) or --kv-cache-memory-fraction, "
            "not both"
        )
    # A budget in bytes on the command line also drops the file's share.
    kv_fraction = None if args.kv_cache_memory is not None else pool.kv_cache_memory_fraction

    settings = WorkerSettings(
        role=role,
        model_dir=str(model_dir),
        model_name=cfg.model.name or Path(model_dir).name,
        service=cfg.service,
        device=flag_or(args.device, cfg.model.device),
        dtype=flag_or(args.dtype, cfg.model.dtype),
        host=args.host,
        port=flag_or(args.port, pool.port),
        metrics_port=args.metrics_port,
        max_batch_tokens=flag_or(args.max_batch_tokens, cfg.prefill.max_batch_tokens),
        max_batch_size=flag_or(args.max_batch_size, cfg.decode.max_batch_size),
        kv_cache_memory_bytes=flag_or(args.kv_cache_memory, pool.kv_cache_memory_bytes),
        num_kv_blocks=args.num_kv_blocks,
        block_size=flag_or(args.block_size, cfg.decode.block_size),
        max_model_len=flag_or(args.max_model_len, cfg.model.max_model_len),
        drain_timeout_s=args.drain_timeout,
        lease_s=flag_or(args.lease_seconds, cfg.decode.reservation_lease_seconds),
        threads=args.threads,
        speculative_tokens=flag_or(args.speculative_tokens, cfg.decode.speculative_tokens),
        kv_send_after_prefill=getattr(args, "kv_send_after_prefill", False),
        kv_cache_memory_fraction=flag_or(args.kv_cache_memory_fraction, kv_fraction),
    )
    for name in ("max_batch_tokens", "max_batch_size", "block_size", "kv_cache_memory_bytes"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"{name}: {getattr(settings, name)} must be at least 1")
    # Finite too: nan never expires a lease, and inf (or past int64 ms) fails every Reserve.
    if not 0 < settings.lease_s <= MAX_LEASE_SECONDS:
        raise ConfigError(
            f"lease_seconds: {settings.lease_s} must be in (0, {MAX_LEASE_SECONDS:g}]"
        )
    # Checked before anything binds or loads, so a bad flag exits 2 with its name instead of
    # failing later with a traceback (port) or after the model load (engine settings).
    for name in ("port", "metrics_port"):
        if not 0 <= getattr(settings, name) <= 65535:
            raise ConfigError(f"{name}: {getattr(settings, name)} must be in [0, 65535]")
    if not settings.drain_timeout_s >= 0:  # nan too: it would cut every stream at once
        raise ConfigError(f"drain_timeout: {settings.drain_timeout_s} must be >= 0")
    if settings.threads is not None and settings.threads < 1:
        raise ConfigError(f"threads: {settings.threads} must be at least 1")
    try:
        engine_config(settings).validate()
    except ValueError as e:  # "EngineConfig.<field>: ..." names the field too
        raise ConfigError(str(e).removeprefix("EngineConfig.")) from e
    # The engine needs the tokenizer too (EOS ids, chat template); say so before loading weights.
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no tokenizer.json")
    return settings


def engine_config(s: WorkerSettings) -> Any:
    from splitserve_workers.engine import EngineConfig

    return EngineConfig(
        model=s.model_dir,
        dtype=s.dtype,
        device=s.device,
        block_size=s.block_size,
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        kv_cache_memory_fraction=s.kv_cache_memory_fraction,
        num_kv_blocks=s.num_kv_blocks,
        max_batch_size=s.max_batch_size,
        max_batch_tokens=s.max_batch_tokens,
        max_model_len=s.max_model_len,
        speculative_tokens=s.speculative_tokens,
    )


def load_engine(s: WorkerSettings) -> Any:
    import torch

    from splitserve_workers.engine import LLMEngine

    if s.threads:
        torch.set_num_threads(s.threads)
    return LLMEngine(engine_config(s))


class Worker:
    """The pieces a role's servicers use: engine, loop, metrics, status, identity."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.status = WorkerStatus()
        self.registry = CollectorRegistry()
        self.fingerprint = model_fingerprint(settings.model_dir, settings.model_name)
        self.metrics = WorkerMetricsUpdater(
            self.registry, settings.service, settings.role, settings.model_name
        )
        self.metrics.set_limits(settings.max_batch_size, settings.max_batch_tokens)
        self.engine: Any = None
        self.loop: Any = None  # EngineLoop
        self.spec = serving_pb2.ModelSpec()

    def attach_engine(self, engine: Any) -> None:
        from splitserve_workers.engine_loop import EngineLoop

        self.engine = engine
        self.spec = model_spec(engine, self.fingerprint, engine.block_size)
        self.loop = EngineLoop(engine, on_iteration=self.metrics.observe)
        self.metrics.observe(engine.stats())

    def refresh_occupancy(self) -> None:
        if self.engine is not None:
            self.metrics.occupancy(self.engine.stats())

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.status.draining:
            self.metrics.rejected("draining")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    def load_report(self, **extra: Any) -> serving_pb2.LoadReport:
        st = self.engine.stats()
        return serving_pb2.LoadReport(
            role=self.settings.role,
            model=self.spec,
            running=st.num_running,
            waiting=st.num_waiting,
            queued_tokens=st.queued_prefill_tokens,
            free_blocks=st.free_blocks,
            total_blocks=st.total_blocks,
            draining=self.status.draining,
            max_batch_size=self.settings.max_batch_size,
            max_batch_tokens=self.settings.max_batch_tokens,
            **extra,
        )


class _Unparseable:
    """What RefuseUnparseable's deserializer hands the handler in place of a request whose
    bytes are not the RPC's message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RefuseUnparseable(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A unary request whose bytes do not parse as the RPC's protobuf message (corrupt wire
    format, a truncated message, bad UTF-8 in a string field) gets INVALID_ARGUMENT naming the
    method, as a bad PushKV chunk does, instead of grpcio's UNKNOWN "Unexpected DecodeError"
    and a logged traceback per call. Streamed requests (PushKV) parse their own chunks."""

    async def intercept_service(
        self, continuation: Any, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # google.protobuf.message.DecodeError, in every backend
                return _Unparseable(f"{method}: the request is not a valid protobuf message: {e}")

        async def refuse(request: _Unparseable, context: grpc.aio.ServicerContext) -> None:
            log.debug("refused an unparseable request: %s", request.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

        serialize = handler.response_serializer
        if handler.response_streaming:
            stream = handler.unary_stream

            async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Unparseable):
                    await refuse(request, context)
                async for event in stream(request, context):
                    yield event

            return grpc.unary_stream_rpc_method_handler(
                streamed, request_deserializer=deserialize, response_serializer=serialize
            )
        unary = handler.unary_unary

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Unparseable):
                await refuse(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            answered, request_deserializer=deserialize, response_serializer=serialize
        )


class Role(Protocol):
    """A worker role's servicers, built once the engine is loaded."""

    def register(self, server: grpc.aio.Server) -> None: ...

    def busy(self) -> int:
        """Requests (and reservations) still in flight; draining waits for 0."""
        ...

    def cut(self, reason: str) -> None:
        """The drain deadline passed: end what is in flight, telling each caller `reason`."""
        ...

    async def close(self) -> None: ...


def setup_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def serve(settings: WorkerSettings, make_role: Any) -> int:
    """Run one worker until SIGTERM/SIGINT, then drain and return the exit code (0)."""
    try:
        worker = Worker(settings)  # reads config.json and every *.safetensors for the fingerprint
    except OSError as e:  # a dangling symlink (a half-downloaded cache), a directory, no access
        where = e.filename or settings.model_dir
        reason = e.strerror or str(e)
        raise StartupError(f"model.path: cannot read {where}: {reason}") from e
    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, stop.set)

    # Probes first: liveness answers while the model loads; readiness stays false until then.
    try:
        runner, metrics_port = await start_http(
            worker.status,
            worker.registry,
            settings.host,
            settings.metrics_port,
            refresh=worker.refresh_occupancy,
        )
    except OSError as e:
        where = f"{settings.host}:{settings.metrics_port}"
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise StartupError(f"metrics_port: cannot listen on {where}: {reason}") from e
    # Both ports are taken before the model loads, so a port in use fails in a second rather
    # than after a long load. Servicers are registered later, before start().
    server = grpc.aio.server(
        options=kv_channel_options(),
        compression=grpc.Compression.NoCompression,
        interceptors=(RefuseUnparseable(),),
    )
    try:
        port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    except RuntimeError:  # grpcio raises on a failed bind (older versions returned 0)
        port = 0
    if port == 0:
        await runner.cleanup()
        where = f"{settings.host}:{settings.port}"
        raise StartupError(f"port: cannot listen on {where} (address in use?)")
    log.info("loading %s on %s", settings.model_dir, settings.device)
    try:
        engine = await aio_loop.run_in_executor(None, load_engine, settings)
    except Exception as e:  # unreadable, truncated or inconsistent model files
        await runner.cleanup()
        log.debug("model load failed", exc_info=True)
        if isinstance(e, ValueError) and str(e).startswith("EngineConfig."):
            # A setting that only the model's config.json rules out (max_model_len past
            # the model's own limit): name the setting, not the model.
            raise StartupError(str(e).removeprefix("EngineConfig.")) from e
        reason = f"{type(e).__name__}: {e}"
        raise StartupError(f"model.path: cannot load {settings.model_dir}: {reason}") from e
    worker.attach_engine(engine)
    worker.loop.start()
    role: Role = make_role(worker)
    role.register(server)
    await server.start()
    worker.status.loaded = True
    log.info(
        "%s worker ready: grpc %d, http %d, model %s (%s, %d KV blocks of %d tokens: %s)",
        settings.role,
        port,
        metrics_port,
        worker.spec.model,
        worker.spec.dtype,
        engine.num_kv_blocks,
        engine.block_size,
        engine.kv_cache_sizing,
    )
    print(f"READY role={settings.role} port={port} metrics_port={metrics_port}", flush=True)

    await stop.wait()
    # Draining: readiness drops (the Service stops routing here), new work is refused with
    # UNAVAILABLE "draining", and what is in flight gets up to drain_timeout to finish.
    worker.status.draining = True
    worker.metrics.set_draining(True)
    log.info("draining: %d in flight", role.busy())
    deadline = time.monotonic() + settings.drain_timeout_s
    while role.busy() > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if role.busy() > 0:
        log.warning("drain timeout: %d requests still in flight are cut", role.busy())
        # Each running stream ends with UNAVAILABLE and this reason (the router relays it to
        # the client), instead of the bare cancellation server.stop would give it.
        role.cut(f"draining: the worker's drain timeout ({settings.drain_timeout_s:g}s) passed")
    await server.stop(grace=1.0)
    await role.close()
    worker.loop.stop()
    await runner.cleanup()
    log.info("drained, exiting")
    return 0


def run_role(role_name: str, args: argparse.Namespace, make_role: Any) -> int:
    setup_logging()
    try:
        settings = load_settings(role_name, args)
    except ConfigError as e:
        print(f"splitserve {role_name}: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(settings, make_role))
    except StartupError as e:
        print(f"splitserve {role_name}: {e}", file=sys.stderr)
        return 1


# ---- input limits and conversions shared by the servicers --------------------------------------

# Any pod that reaches a worker's gRPC port can call it, so every field is bounded before it is
# used, not only by the router's checks. The router's ids are 41 bytes; its stop lists are at
# most 4 strings.
MAX_REQUEST_ID_BYTES = 128
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000


def request_problem(
    request_id: str, num_prompt_tokens: int | None = None, max_model_len: int | None = None
) -> str | None:
    """Why a request's id or prompt length is refused (INVALID_ARGUMENT), or None. Checked
    before the prompt becomes a Python list: a message at the size limit holds ~20 M ids."""
    if not request_id:
        return "request_id: required"
    if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        return f"request_id: longer than {MAX_REQUEST_ID_BYTES} bytes"
    if num_prompt_tokens is not None:
        if num_prompt_tokens == 0:
            return "prompt_token_ids: empty prompt"
        if max_model_len is not None and num_prompt_tokens > max_model_len:
            return (
                f"prompt_token_ids: {num_prompt_tokens} tokens, more than max_model_len "
                f"{max_model_len}"
            )
    return None


async def compile_grammar(engine: Any, params: Any) -> None:
    """Compiles a request's grammar into the engine's cache on a thread (llguidance releases
    the GIL), so that adding the request on the event loop finds it compiled: a large schema
    takes a second or more, which on the loop held every other stream of this worker.
    ValueError ("grammar: ...", as the engine's) if it cannot be used."""
    if getattr(params, "grammar", None) is None:
        return
    from splitserve_workers.engine.grammar import GrammarError

    try:
        await asyncio.get_running_loop().run_in_executor(
            None, engine.grammars.matcher, params.grammar
        )
    except GrammarError as e:
        raise ValueError(f"grammar: {e}") from e


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _at_least(value: float, bound: float) -> float:
    """A proto float arrives rounded to float32: a value the router accepted at an inclusive
    lower bound that float32 cannot hold (repetition_penalty 0.01 arrives as 0.0099999998) is
    that bound, not a value below it."""
    return bound if _float32(bound) <= value < bound else value


def sampling_from_proto(p: serving_pb2.SamplingParams) -> Any:
    """Proto sampling -> engine SamplingParams; raises ValueError naming the field."""
    from splitserve_workers.engine import SamplingParams
    from splitserve_workers.engine.sampling import (
        MAX_LOGIT_BIAS_TOKENS,
        MAX_PROMPT_LOGPROBS,
        MAX_TOP_LOGPROBS,
        MIN_REPETITION_PENALTY,
    )

    if p.temperature < 0:
        raise ValueError(f"sampling.temperature: {p.temperature} must be >= 0")
    if not 0 <= p.top_p <= 1:
        raise ValueError(f"sampling.top_p: {p.top_p} must be in [0, 1]")
    if p.top_k < 0:
        raise ValueError(f"sampling.top_k: {p.top_k} must be >= 0")
    if p.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens: {p.max_tokens} must be at least 1")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"sampling.top_logprobs: {p.top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}"
        )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"sampling.stop_token_ids: {len(p.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}"
        )
    if len(p.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"sampling.stop: {len(p.stop)} strings, at most {MAX_STOP_STRINGS}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        raise ValueError(f"sampling.stop: a string longer than {MAX_STOP_STRING_CHARS} characters")
    if len(p.logit_bias) > MAX_LOGIT_BIAS_TOKENS:  # before it becomes a dict
        raise ValueError(
            f"sampling.logit_bias: {len(p.logit_bias)} tokens, at most {MAX_LOGIT_BIAS_TOKENS}"
        )
    prompt = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    if prompt is not None and not 0 <= prompt <= MAX_PROMPT_LOGPROBS:
        raise ValueError(
            f"sampling.prompt_logprobs: {prompt} must be between 0 and {MAX_PROMPT_LOGPROBS}"
        )
    params = SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs > 0 or p.top_logprobs > 0,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=prompt,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=_at_least(p.repetition_penalty or 1.0, MIN_REPETITION_PENALTY),
        logit_bias=dict(p.logit_bias),
        grammar=p.grammar or None,
    )
    try:
        params.validate()  # the engine checks logit_bias token ids against its vocabulary
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None
    return params


def priority_from_proto(p: int) -> Any:
    from splitserve_workers.engine import Priority

    return Priority.BACKGROUND if p == serving_pb2.PRIORITY_BACKGROUND else Priority.INTERACTIVE


def top_logprobs(pairs: list[tuple[int, float]]) -> serving_pb2.TopLogprobs:
    return serving_pb2.TopLogprobs(token_ids=[t for t, _ in pairs], logprobs=[v for _, v in pairs])


def prompt_logprobs(
    entries: list[tuple[float, list[tuple[int, float]] | None]],
) -> serving_pb2.PromptLogprobs:
    out = serving_pb2.PromptLogprobs(logprobs=[value for value, _ in entries])
    for _, top in entries:
        if top is not None:
            out.top_logprobs.append(top_logprobs(top))
    return out


def grammar_failed(outputs: list[Any]) -> str | None:
    """INVALID_ARGUMENT details for a request whose grammar failed at its first token (a limit
    of the grammar engine, such as a regex too large for its lexer): the request's fault,
    which no other worker would serve. None when no output says so."""
    for o in outputs:
        if o.grammar_error is not None:
            return f"grammar: {o.grammar_error} (at the first token)"
    return None


def token_event(outputs: list[Any]) -> serving_pb2.TokenEvent:
    """Several engine outputs of one request -> one TokenEvent (tokens batched)."""
    ev = serving_pb2.TokenEvent()
    for o in outputs:
        if o.token_id is not None:
            ev.token_ids.append(o.token_id)
            if o.logprob is not None:
                ev.logprobs.append(o.logprob)
            if o.top_logprobs is not None:
                ev.top_logprobs.append(top_logprobs(o.top_logprobs))
            if o.prompt_logprobs is not None:
                ev.prompt_logprobs.CopyFrom(prompt_logprobs(o.prompt_logprobs))
        if o.finished:
            ev.finished = True
            ev.finish_reason = o.finish_reason or ""
        ev.num_prompt_tokens = o.num_prompt_tokens
        ev.num_cached_tokens = o.num_cached_tokens
    return ev
