"""The router process: an aiohttp app serving the OpenAI API (/v1/completions,
/v1/chat/completions, /v1/models) plus /health, /ready and /metrics on one port, and the
`splitserve router` command. It holds the tokenizer only (no weights): openai_api.py parses,
flow.py drives the workers picked by picking.py, detok.py turns tokens into text."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_request import BaseRequest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from splitserve_workers import http_errors
from splitserve_workers.config import ConfigError, ServingConfig, flag_or
from splitserve_workers.engine.tokenizer import NoChatTemplate
from splitserve_workers.http_errors import QuietErrorHandler
from splitserve_workers.metrics import RouterMetrics, router_metrics
from splitserve_workers.proto import serving_pb2
from splitserve_workers.router import openai_api as api
from splitserve_workers.router import reasoning, tool_parsers
from splitserve_workers.router.auth import ENV_VAR, ApiKeys
from splitserve_workers.router.detok import IncrementalDetokenizer
from splitserve_workers.router.discovery import (
    Discovery,
    DnsDiscovery,
    FileDiscovery,
    StaticDiscovery,
    split_endpoints,
)
from splitserve_workers.router.flow import (
    Flow,
    FlowError,
    FlowRequest,
    FlowSettings,
    TokenChunk,
    finish_aborts,
)
from splitserve_workers.router.picking import (
    COLOCATED_POLICIES,
    DECODE_POLICIES,
    PREFILL_POLICIES,
    WorkerPool,
)

log = logging.getLogger("splitserve.router")
request_log = logging.getLogger("splitserve.requests")

_PRIORITY = {
    "interactive": serving_pb2.PRIORITY_INTERACTIVE,
    "background": serving_pb2.PRIORITY_BACKGROUND,
}


@dataclass
class RouterOptions:
    model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int | None = None  # the model's (embedding rows); token-id prompts must fit
    service: str = "local"
    discovery: Discovery = field(default_factory=StaticDiscovery)
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    colocated_policy: str = "cache_aware"
    max_request_bytes: int = 4 << 20
    poll_interval: float = 0.5
    flow: FlowSettings = field(default_factory=FlowSettings)
    drain_timeout: float = 30.0
    # A streaming client that takes none of the answer for this long (its TCP window and the
    # router's send buffer full) is cut: its request is aborted on the workers. 0: never.
    write_timeout: float = 60.0
    # /ready without a worker in some pool (one that may be scaled to zero).
    ready_without_workers: bool = False
    # /debug/workers lists every worker's address and load; off unless asked for, since the
    # router's port is the one clients reach.
    debug_endpoints: bool = False
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none configured: the port is open
    log_requests: bool = False  # a JSON line per generation request (logger splitserve.requests)
    # How the model writes tool calls, for tool_choice auto (tool_parsers.py): "auto" = what
    # its chat template shows, "none" = refuse auto.
    tool_call_parser: str = "auto"
    # How a thinking model marks its reasoning (reasoning.py): "auto" = what its chat template
    # shows, "none" = leave it in the content.
    reasoning_parser: str = "auto"


def _format(setting: str, tokenizer: Any, kind: Any, field: str) -> str | None:
    """A model-family format (`kind`: tool_parsers or reasoning): as set, or ("auto") the one
    the chat template shows; None: none (tool_choice auto is refused; reasoning stays in the
    content)."""
    if setting == "auto":
        return kind.detect(getattr(tokenizer, "chat_template", None))  # type: ignore[no-any-return]
    if setting == "none":
        return None
    if setting not in kind.PARSERS:
        raise ConfigError(
            f"router.{field}: {setting!r} is not one of auto, none, " + ", ".join(kind.PARSERS)
        )
    return setting


def model_config(model_dir: str) -> dict[str, Any]:
    return dict(json.loads((Path(model_dir) / "config.json").read_text()))


def model_max_len(model_dir: str) -> int:
    """The context limit the workers' engines use (ModelConfig, the engine's own parse)."""
    from splitserve_workers.engine.model_config import ModelConfig

    return ModelConfig.from_dir(model_dir).max_model_len


def load_tokenizer(model_dir: str) -> Any:
    # Only the tokenizer module of the engine: the router never loads weights.
    from splitserve_workers.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    tokenizer.max_token_bytes  # noqa: B018 - computed once here, not on a request's event loop
    return tokenizer


_BODY_HEADERS = ("content-type", "content-length")
# The request Content-Encodings aiohttp decodes here (br and zstd need optional modules).
CONTENT_CODINGS = (
    ("gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())
)


def unsupported_coding(coding: str) -> api.APIError:
    """RFC 9110 15.5.16: a body in a content coding the server cannot decode is a 415, whose
    Accept-Encoding says which it can."""
    return api.APIError(
        415,
        f"request body Content-Encoding {coding!r} is not supported; send it uncompressed or "
        f"as {', '.join(CONTENT_CODINGS)}",
        code="unsupported_content_encoding",
        headers={"Accept-Encoding": ", ".join(CONTENT_CODINGS)},
    )


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

# Request statuses refused before any work: their prompts count no tokens.
REFUSED = ("rejected", "no_capacity")


def _request_id(kind: str) -> str:
    """A generation request's id (the answer's `id`, `X-Request-Id`, the request log's)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def _needs_key(path: str) -> bool:
    """The API (and the debug view) need a key when keys are configured; the probes and
    /metrics (the kubelet and Prometheus call them, inside the cluster) do not."""
    return path.startswith("/v1/") or path.startswith("/debug/")


class Router:
    def __init__(self, options: RouterOptions, tokenizer: Any) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.registry = CollectorRegistry()
        self.metrics: RouterMetrics = router_metrics(self.registry)
        self.labels = {"service": options.service, "pool": "router", "model": options.model_name}
        roles = options.discovery.roles()
        self.colocated = "colocated" in roles
        if self.colocated and ("prefill" in roles or "decode" in roles):
            raise ValueError("a router fronts either a colocated pool or prefill+decode pools")
        if not self.colocated and not {"prefill", "decode"} <= set(roles):
            raise ValueError("the router needs prefill and decode endpoints (or colocated ones)")
        poll = options.poll_interval
        self.pools: dict[str, WorkerPool] = {}
        if self.colocated:
            self.pools["colocated"] = WorkerPool(
                "colocated", options.discovery, options.colocated_policy, poll
            )
        else:
            self.pools["prefill"] = WorkerPool(
                "prefill", options.discovery, options.prefill_policy, poll
            )
            self.pools["decode"] = WorkerPool(
                "decode", options.discovery, options.decode_policy, poll
            )
        self.created = api.now()
        self.in_flight = 0
        self.draining = False
        self.answers: set[_Answer] = set()  # requests generating now (the drain deadline cuts)
        # Prompts are tokenized here; two threads, so a burst of long prompts queues instead of
        # taking every core from the event loop.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # Chat templates are rendered here, before the size check that may refuse the prompt
        # at once: not queued behind the tokenizer threads' long jobs.
        self.render_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="render")
        # Handlers waiting for their prompt's tokens -> why they were cut (None: not cut).
        self.tokenizing: dict[asyncio.Task[Any], str | None] = {}
        self.eos_token_ids: list[int] = list(getattr(tokenizer, "eos_token_ids", []) or [])
        # Model vocabularies are often padded past the tokenizer's: the model's size decides.
        self.vocab_size = options.vocab_size or getattr(tokenizer, "vocab_size", None)
        self.tool_parser = _format(
            options.tool_call_parser, tokenizer, tool_parsers, "tool_call_parser"
        )
        self.reasoning_parser = _format(
            options.reasoning_parser, tokenizer, reasoning, "reasoning_parser"
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        # The body limit is enforced by aiohttp while reading; the handler turns the overflow
        # into an OpenAI-style 413.
        app = web.Application(
            client_max_size=self.options.max_request_bytes, middlewares=[self._errors]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_endpoint)
        if self.options.debug_endpoints:
            app.router.add_get("/debug/workers", self.workers)
        app.on_startup.append(self._start_pools)
        app.on_cleanup.append(self._close_pools)
        return app

    async def _start_pools(self, _app: web.Application) -> None:
        for pool in self.pools.values():
            await pool.start()

    async def _close_pools(self, _app: web.Application) -> None:
        await finish_aborts()  # over the channels about to close: cut requests free their blocks
        for pool in self.pools.values():
            await pool.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.render_pool.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response = await self._answer(request, handler)
        if self.draining:
            # Shutting down: tell keep-alive clients not to send another request on this
            # connection, or the one that crosses our exit is lost without an answer.
            response.force_close()
        return response

    async def _answer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if _needs_key(request.path) and not self.options.api_keys.allows(
            request.headers.get("Authorization")
        ):
            err = api.APIError(
                401,
                "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
            headers = {"WWW-Authenticate": "Bearer"}
            if self.options.log_requests and request.path in GENERATION_PATHS:
                # Refused before any work, but an operator auditing the log wants to see it;
                # the client gets the id it is logged under, as for any other answer.
                kind = "chat" if request.path == "/v1/chat/completions" else "completion"
                headers["X-Request-Id"] = rid = _request_id(kind)
                log_request(rid, request.path, "rejected", time.monotonic(), None, err)
            return web.json_response(err.body(), status=401, headers=headers)
        try:
            return await handler(request)
        except api.APIError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status)
            err = api.APIError(e.status, e.reason, code=code)
            # Keeps what the exception carries for the client, e.g. a 405's `Allow`.
            headers = {k: v for k, v in e.headers.items() if k.lower() not in _BODY_HEADERS}
            return web.json_response(err.body(), status=e.status, headers=headers)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug must still answer in the API's shape
            log.exception("unhandled error on %s", request.path)
            err = api.APIError(
                500, f"internal error: {type(e).__name__}: {e}", code="internal_error"
            )
            return web.json_response(err.body(), status=500)

    # ---- plain endpoints -------------------------------------------------------------------

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            api.models_response(self.options.model_name, self.created, self.options.max_model_len)
        )

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model} (the openai client's `models.retrieve`)."""
        name = request.match_info["model"]
        self._check_model(name)
        return web.json_response(api.model_object(name, self.created, self.options.max_model_len))

    def _check_model(self, name: str) -> None:
        """404 model_not_found unless `name` is the model this router serves."""
        if name != self.options.model_name:
            # Echoed cut short, as other values are: the body may carry megabytes of it.
            shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
            raise api.APIError(
                404,
                f"The model '{shown}' does not exist; this server serves "
                f"'{self.options.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        pools = {role: pool.ready() for role, pool in self.pools.items()}
        # A pool that may be scaled to zero must not take the router out of its Service: the
        # requests that wake the pool have to reach the router.
        ok = (all(pools.values()) or self.options.ready_without_workers) and not self.draining
        return web.json_response(
            {"ready": ok, "draining": self.draining, "pools": pools}, status=200 if ok else 503
        )

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def workers(self, _request: web.Request) -> web.Response:
        return web.json_response({role: p.snapshot() for role, p in self.pools.items()})

    def cut_in_flight(self) -> None:
        """The drain deadline: every request still generating is cancelled as if its client had
        hung up (which aborts it on the workers) and answered 503 `draining` instead."""
        pending = [answer for answer in self.answers if answer.cuttable]
        tokenizing = [task for task, why in self.tokenizing.items() if why is None]
        if (pending and not any(answer.cut_reason for answer in pending)) or tokenizing:
            count = len(pending) + len(tokenizing)
            log.warning("drain timeout: %d requests still in flight are cut", count)
        why = (
            "the router is shutting down and its drain timeout "
            f"({self.options.drain_timeout:g}s) has passed"
        )
        for answer in pending:
            answer.cut(why)
        for task in tokenizing:
            self.tokenizing[task] = why
            task.cancel()

    # ---- generation ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.options.max_request_bytes
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity", *CONTENT_CODINGS):
            # aiohttp passes a coding it does not know through undecoded (as JSON garbage).
            raise unsupported_coding(coding)
        if request.content_length is not None and request.content_length > limit:
            raise api.APIError(
                413,
                f"request body is {request.content_length} bytes; the limit "
                f"is {limit} bytes (router.max_request_bytes)",
                code="request_too_large",
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise api.APIError(
                413,
                f"request body exceeds the limit of {limit} bytes (router.max_request_bytes)",
                code="request_too_large",
            ) from e
        except web.RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match
            detail = " ".join(str(e).split())  # aiohttp's text spans lines
            raise api.APIError(
                400, f"request body cannot be read: {detail}", code="invalid_body"
            ) from e

    def _check_logit_bias(self, req: api.GenerationRequest) -> None:
        if self.vocab_size is None:
            return
        bad = sorted(t for t in req.logit_bias if t >= self.vocab_size)
        if bad:
            raise api.invalid(
                "logit_bias",
                f"'logit_bias' token id {bad[0]} is out of the vocabulary (size {self.vocab_size})",
            )

    def _chat_text(self, req: api.GenerationRequest) -> str:
        """A chat request's prompt: its messages rendered with the model's chat template."""
        assert req.messages is not None
        try:
            # The tools (unless tool_choice is none) go to the template, which shows them to the
            # model.
            extra = {"tools": req.tools} if req.tools else {}
            return self.tokenizer.apply_chat_template(  # type: ignore[no-any-return]
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **req.template_kwargs,
                **extra,
            )
        except NoChatTemplate as e:  # the model's fault, not the messages'
            raise api.APIError(400, str(e), code="no_chat_template") from e
        except Exception as e:  # a template may reject a message order (raise_exception)
            raise api.invalid("messages", f"chat template rejected the messages: {e}") from e

    def _prompt_ids(
        self, req: api.GenerationRequest, i: int, prompt: str | list[int]
    ) -> tuple[list[int], str]:
        """Token ids and the prompt text (for echo) of chat's rendered prompt or of the
        completion prompt `i`."""
        if req.kind == "chat":
            assert isinstance(prompt, str)
            # The template writes its own BOS.
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if isinstance(prompt, list):
            if self.vocab_size is not None:
                bad = [t for t in prompt if t >= self.vocab_size]
                if bad:
                    label = req.prompt_label(i)
                    raise api.invalid(
                        label,
                        f"'{label}' token id {bad[0]} is out of the vocabulary "
                        f"(size {self.vocab_size})",
                    )
            return list(prompt), self.tokenizer.decode(prompt)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            # OpenAI and vLLM take "" as the BOS token alone; a tokenizer without one leaves
            # nothing to generate from.
            label = req.prompt_label(i)
            raise api.invalid(
                label, f"'{label}' is empty, and this model's tokenizer adds no BOS token to it"
            )
        return ids, prompt

    def _all_prompt_ids(
        self, req: api.GenerationRequest, prompts: list[str | list[int]]
    ) -> list[tuple[list[int], str]]:
        return [self._prompt_ids(req, i, p) for i, p in enumerate(prompts)]

    async def _tokenize(self, req: api.GenerationRequest) -> list[tuple[list[int], str]]:
        """_all_prompt_ids off the event loop: a prompt of megabytes takes seconds to tokenize,
        and every other stream, /health and /ready would wait for it. A chat's messages are
        rendered first, on a thread of the render pool (a render takes milliseconds: it is
        not queued behind the tokenizer threads' seconds), so that the size check sees all
        the text the template puts in the prompt. Meanwhile the request is in `tokenizing`,
        where the drain deadline finds it too (cut_in_flight)."""
        task = asyncio.current_task()
        assert task is not None
        self.tokenizing[task] = None
        loop = asyncio.get_running_loop()
        try:
            prompts: list[str | list[int]] = list(req.prompts)
            if req.kind == "chat":
                prompts = [await loop.run_in_executor(self.render_pool, self._chat_text, req)]
            self._refuse_certainly_too_long(req, prompts)
            return await loop.run_in_executor(
                self.tokenize_pool, self._all_prompt_ids, req, prompts
            )
        except asyncio.CancelledError:
            why = self.tokenizing.get(task)
            if why is None:
                raise  # the client hung up
            task.uncancel()  # answered, not cancelled
            raise api.APIError(
                503, f"{why}; the request was cut before generation started", code="draining"
            ) from None
        finally:
            self.tokenizing.pop(task, None)

    def _refuse_certainly_too_long(
        self, req: api.GenerationRequest, prompts: list[str | list[int]]
    ) -> None:
        """A prompt whose text alone proves it longer than the context is refused before the
        tokenizer threads spend seconds on it (and other requests queue behind it): no token
        covers more than the vocabulary's longest token's bytes, so a text of more bytes than
        that times the limit (times 4, for normalizers that shrink text) cannot fit. A chat's
        text is its rendered prompt: every message's content, the tools and earlier calls'
        arguments as far as the template shows them, and the template's own text."""
        if not self.tokenizer.spells_every_byte:
            return
        limit = self.options.max_model_len
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                continue
            size = len(text.encode("utf-8", "surrogatepass"))
            if size <= 4 * limit * self.tokenizer.max_token_bytes:
                continue
            label = req.prompt_label(i)
            what, fields = f"{label} is", f"the {label}"
            if req.kind == "chat":
                shown = "messages and tools" if req.tools else "messages"
                what = f"{shown}, rendered with the chat template, are"
                fields = "the messages or the tools" if req.tools else "the messages"
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{what} {size} bytes, more than {limit} tokens can hold. Please shorten "
                f"{fields}.",
                param=label,
                code="context_length_exceeded",
            )

    def _check_length(self, req: api.GenerationRequest, n_prompt: int, label: str) -> int:
        limit = self.options.max_model_len
        if n_prompt >= limit:
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{label} has {n_prompt} tokens, leaving no room for the completion. "
                f"Please shorten the {label}.",
                param=label,
                code="context_length_exceeded",
            )
        if req.max_tokens is None:
            return limit - n_prompt
        if n_prompt + req.max_tokens > limit:
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the {label}, "
                f"{req.max_tokens} for the completion). Please reduce the length of the "
                f"{label} or {req.max_tokens_param}.",
                param=req.max_tokens_param,
                code="context_length_exceeded",
            )
        return req.max_tokens

    def _sampling(
        self, req: api.GenerationRequest, max_tokens: int, copy: int
    ) -> serving_pb2.SamplingParams:
        sampling = serving_pb2.SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=max_tokens,
            stop_token_ids=req.stop_token_ids,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            logprobs=1 if req.logprobs else 0,
            top_logprobs=req.top_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias,
            grammar=req.grammar or "",
        )
        if req.prompt_logprobs:
            sampling.prompt_logprobs = req.top_logprobs
        if req.seed is not None:
            # n copies of one prompt with one seed would all sample the same tokens; as vLLM,
            # copy j samples with seed + j, so the answer is reproducible and its choices differ.
            sampling.seed = (req.seed + copy + 2**63) % 2**64 - 2**63  # stays an int64
        return sampling

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.monotonic()
        status = "rejected"
        rid = _request_id(kind)
        answer: _Answer | None = None
        error: api.APIError | None = None
        self.in_flight += 1
        self.metrics.requests_in_flight.labels(**self.labels).inc()
        try:
            if self.draining:
                raise api.APIError(503, "the router is shutting down", code="draining")
            body = api.parse_json_body(await self._read_body(request))
            header_priority = request.headers.get(api.PRIORITY_HEADER)
            parse: Any = (
                functools.partial(api.parse_chat, tool_parser=self.tool_parser)
                if kind == "chat"
                else api.parse_completion
            )
            if api.CONSTRAINT_FIELDS & body.keys():
                # Compiling a schema takes up to a second for a large one: on the tokenizer
                # threads (llguidance releases the GIL), not the event loop, which meanwhile
                # serves the other streams and the probes.
                req = await asyncio.get_running_loop().run_in_executor(
                    self.tokenize_pool, parse, body, header_priority
                )
            else:
                req = parse(body, header_priority)
            if req.model:
                self._check_model(req.model)
            self._check_logit_bias(req)
            prompts = await self._tokenize(req)
            limits = [
                self._check_length(req, len(ids), req.prompt_label(i))
                for i, (ids, _text) in enumerate(prompts)
            ]
            runs = []
            for i, ((prompt_ids, prompt_text), max_tokens) in enumerate(
                zip(prompts, limits, strict=True)
            ):
                for copy in range(req.n):
                    index = i * req.n + copy  # OpenAI's order: a prompt's n choices together
                    # The workers know each choice as a request of its own.
                    worker_rid = rid if len(prompts) * req.n == 1 else f"{rid}-{index}"
                    flow = Flow(
                        FlowRequest(
                            worker_rid,
                            prompt_ids,
                            self._sampling(req, max_tokens, copy),
                            _PRIORITY[req.priority],
                            [] if req.ignore_eos else self.eos_token_ids,
                            max_tokens_explicit=req.max_tokens is not None,
                            max_tokens_param=req.max_tokens_param,
                            grammar_param=req.grammar_param,
                        ),
                        self.options.flow,
                        prefill=self.pools.get("prefill"),
                        decode=self.pools.get("decode"),
                        colocated=self.pools.get("colocated"),
                    )
                    runs.append(_Run(self, req, flow, index, prompt_ids, prompt_text, arrival))
            answer = _Answer(self, req, rid, runs)
            self.answers.add(answer)
            try:
                return await (answer.stream(request) if req.stream else answer.complete())
            finally:
                self.answers.discard(answer)
                status = answer.status
        except FlowError as e:
            if e.code == "no_capacity":
                status = "no_capacity"  # refused for want of workers or KV blocks: ours to fix
            else:
                status = "rejected" if e.status < 500 else "error"
            error = api.APIError(e.status, e.message, param=e.param, code=e.code)
            raise error from e
        except api.APIError as e:
            error = e
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = "abort"
            raise
        except Exception:
            status = "error"  # answered as a 500 (the middleware): a server fault
            raise
        finally:
            if answer is not None:
                for k, run in enumerate(answer.runs):
                    # A prompt's tokens count once, as in usage: its first copy's. Recorded
                    # with the request's final status: a refusal (no usage) counts no tokens.
                    run.record(status, count_prompt=k % answer.req.n == 0)
            self.in_flight -= 1
            self.metrics.requests_in_flight.labels(**self.labels).dec()
            self.metrics.requests.labels(**self.labels, status=status).inc()
            if self.options.log_requests:
                log_request(rid, request.path, status, arrival, answer, error)


def log_request(
    rid: str,
    path: str,
    status: str,
    arrival: float,
    answer: _Answer | None,
    error: api.APIError | None,
) -> None:
    """One JSON line per generation request (`--log-requests`): what it asked, what it got,
    where it ran and how long it took, for the operator reading the router's log."""
    record: dict[str, Any] = {"id": rid, "path": path, "status": status}
    if answer is not None:
        error_text = answer.error
        usage = answer.usage()
        first = [run.token_times[0][0] for run in answer.runs if run.token_times]
        record |= {
            "choices": len(answer.runs),
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "kv_reused_tokens": sum(r.flow.stats.decode_cached_tokens for r in answer.runs),
            "kv_bytes": sum(r.flow.stats.kv_transfer_bytes for r in answer.runs),
            "finish_reasons": [run.finish_reason for run in answer.runs],
            "priority": answer.req.priority,
            "constraint": answer.req.constraint,  # response_format.type, structured_outputs.*
            "tool_choice": "function" if _named(answer.req.tool_choice) else answer.req.tool_choice,
            "stream": answer.req.stream,
            "ttft_ms": round((min(first) - arrival) * 1000, 1) if first else None,
            "prefill": sorted({r.flow.stats.prefill_endpoint for r in answer.runs} - {""}),
            "decode": sorted({r.flow.stats.decode_endpoint for r in answer.runs} - {""}),
        }
    else:
        error_text = None
    if error is not None:
        record |= {"http_status": error.status, "error_code": error.code}
        error_text = error.message
    record["e2e_ms"] = round((time.monotonic() - arrival) * 1000, 1)
    if error_text:
        record["error"] = error_text
    request_log.info("%s", json.dumps(record, separators=(",", ":")))


def _indexed(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as a stream delta carries them: each with its `index`."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def _named(tool_choice: str | None) -> bool:
    """A tool_choice that names a function (not auto, required, or none given)."""
    return tool_choice not in (None, "auto", "required")


Chunk = tuple[str, str | None, list[api.TokenLogprob]]  # text delta, finish reason, logprobs


class _Run:
    """One choice of a request: consumes its flow, detokenizes, and keeps the timestamps the
    edge metrics come from."""

    def __init__(
        self,
        router: Router,
        req: api.GenerationRequest,
        flow: Flow,
        index: int,
        prompt_ids: list[int],
        prompt_text: str,
        arrival: float,
    ) -> None:
        self.router = router
        self.req = req
        self.flow = flow
        self.index = index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.arrival = arrival
        self.detok = IncrementalDetokenizer(
            router.tokenizer, req.stop, [] if req.ignore_eos else router.eos_token_ids, prompt_ids
        )
        self.token_times: list[tuple[float, int]] = []  # (arrival at router, tokens in event)
        self.num_tokens = 0
        # The answer's count of this choice's tokens handed to it so far (continuous usage:
        # choices run ahead of the stream by up to the queue between them), and the count
        # after each chunk not yet handed over.
        self.delivered = 0
        self.counts: collections.deque[int] = collections.deque()
        self.finish_reason: str | None = None
        self.first = True  # no chunk of this choice has gone out yet
        self.text_cursor = api.TextCursor()  # past the tokens whose logprobs went out

    async def chunks(self) -> AsyncIterator[Chunk]:
        """(text delta, finish_reason or None, the event's tokens' logprobs if asked) per worker
        event; the last has a reason."""
        tokens = self.flow.tokens()
        try:
            async for chunk in tokens:
                self._observe(chunk)
                self.counts.append(self.num_tokens)
                text = self.detok.add(chunk.token_ids)
                entries = self._logprobs(chunk)
                if self.detok.stopped:
                    self.finish_reason = "stop"
                    yield text, "stop", entries
                    return  # closing `tokens` aborts the rest on the workers
                if chunk.finished:
                    text += self.detok.finish()
                    # The flush of a trailing incomplete character can complete a stop string:
                    # then the text was cut there, and the reason is "stop" (as vLLM reports a
                    # stop string found on the last token), not the worker's "length".
                    reason = "stop" if self.detok.stopped else chunk.finish_reason
                    self.finish_reason = reason or "stop"
                    yield text, self.finish_reason, entries
                    return
                # One chunk per token event even when its text is empty (held back for a stop
                # string, an incomplete character, a token without text): clients time tokens
                # by chunks, and an empty delta is valid OpenAI streaming.
                yield text, None, entries
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]

    def _added_prompt_tokens(self) -> int | None:
        """For a text prompt, how many of its first ids the tokenizer added (a BOS) rather than
        spelled from the text; None for token ids (echoed as their decoded text, which leaves
        every special token out) and chat."""
        if self.req.kind == "chat":
            return None
        prompt = self.req.prompts[self.index // self.req.n]
        if not isinstance(prompt, str):
            return None
        plain = self.router.tokenizer.encode(prompt, add_special_tokens=False)
        added = len(self.prompt_ids) - len(plain)
        return added if added >= 0 and self.prompt_ids[added:] == plain else 0

    def _logprobs(self, chunk: TokenChunk) -> list[api.TokenLogprob]:
        if not self.req.logprobs:
            return []
        tok = self.router.tokenizer

        def entry(token_id: int, logprob: float | None, top: Any) -> api.TokenLogprob:
            text, raw = tok.token_text(token_id)
            alternatives = [(*tok.token_text(t), value) for t, value in top]
            # A special token's text is not in the choice's (text_offset must not count it).
            return api.TokenLogprob(text, raw, logprob, alternatives, tok.shown_bytes(token_id))

        entries = []
        if chunk.prompt_logprobs is not None and self.req.prompt_logprobs:
            # The echoed prompt's tokens first: the first has no logprob, each later one its
            # own given the tokens before it.
            entries.append(entry(self.prompt_ids[0], None, []))
            for token_id, (logprob, top) in zip(
                self.prompt_ids[1:], chunk.prompt_logprobs, strict=False
            ):
                entries.append(entry(token_id, logprob, top))
            added = self._added_prompt_tokens()
            if added is not None:
                # A text prompt is echoed as the client wrote it: a special token it spells
                # out (a hand-written "<|im_start|>") is in the text; only those the tokenizer
                # added (a BOS) are not.
                for k, e in enumerate(entries[: len(self.prompt_ids)]):
                    if k >= added:
                        e.shown = None
        # A worker sends one logprob per token when asked; a shorter list is a worker that
        # did not (an older one): those tokens get no entry rather than a made-up value.
        for i, (token_id, logprob) in enumerate(zip(chunk.token_ids, chunk.logprobs, strict=False)):
            top = chunk.top_logprobs[i] if i < len(chunk.top_logprobs) else []
            entries.append(entry(token_id, logprob, top))
        return entries

    def logprobs_object(self, entries: list[api.TokenLogprob]) -> dict[str, Any] | None:
        """choices[].logprobs for these tokens (None unless asked); legacy completions' cursor
        moves past them (text_offset counts from the choice's start)."""
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return api.chat_logprobs(entries)
        return api.completion_logprobs(entries, self.text_cursor)

    def _observe(self, chunk: TokenChunk) -> None:
        if chunk.token_ids:
            self.token_times.append((time.monotonic(), len(chunk.token_ids)))
            self.num_tokens += len(chunk.token_ids)

    def record(self, status: str, count_prompt: bool = True) -> None:
        """Edge metrics for this choice, given its request's outcome; `count_prompt`: its
        prompt's tokens too (a prompt's n copies count it once, as usage does)."""
        m = self.router.metrics
        labels = self.router.labels
        if count_prompt and status not in REFUSED:
            m.prompt_tokens.labels(**labels).inc(len(self.prompt_ids))
        if self.num_tokens:
            m.generation_tokens.labels(**labels).inc(self.num_tokens)
        stats = self.flow.stats
        if stats.decode_admission_seconds is not None:
            m.decode_admission.labels(**labels).observe(stats.decode_admission_seconds)
        if stats.prefill_queue_seconds is not None:
            m.prefill_queue.labels(**labels).observe(stats.prefill_queue_seconds)
        if stats.prefill_compute_seconds is not None:
            m.prefill_compute.labels(**labels).observe(stats.prefill_compute_seconds)
        if stats.kv_transfer_seconds is not None:
            m.kv_transfer.labels(**labels).observe(stats.kv_transfer_seconds)
            m.kv_transfer_bytes.labels(**labels).inc(stats.kv_transfer_bytes)
        if not self.token_times:
            return
        first_time = self.token_times[0][0]
        m.ttft.labels(**labels).observe(first_time - self.arrival)
        prev = first_time
        for t, n in self.token_times[1:]:
            # An event carrying several tokens spreads its gap over them.
            for _ in range(n):
                m.itl.labels(**labels).observe((t - prev) / n)
            prev = t
        if status == "ok":
            last_time = self.token_times[-1][0]
            m.e2e.labels(**labels).observe(last_time - self.arrival)
            if self.num_tokens > 1:
                m.tpot.labels(**labels).observe((last_time - first_time) / (self.num_tokens - 1))


class _Answer:
    """One generation request at the edge: runs its choices (one, or `n` per prompt, at once),
    and writes the answer, whole or as SSE chunks."""

    def __init__(
        self, router: Router, req: api.GenerationRequest, rid: str, runs: list[_Run]
    ) -> None:
        self.router = router
        self.req = req
        self.rid = rid
        self.runs = runs
        self.created = api.now()
        self.model = router.options.model_name
        self.status = "abort"  # until proven otherwise: a cancelled request is an abort
        self.task = asyncio.current_task()
        self.cut_reason: str | None = None
        self.cut_seen = False  # the cut became this request's answer
        self.error: str | None = None  # what ended a stream after its first token
        # Forced tool calls: each choice's call id, and (tool_choice "required", streamed) the
        # text held back until the whole array of calls can be parsed.
        self.call_ids: dict[int, str] = {}
        self.held: dict[int, list[str]] = collections.defaultdict(list)
        self.splitters: dict[int, tool_parsers.StreamSplitter] = {}  # tool_choice auto
        # A thinking model's reasoning, split from the content: before an answer the model
        # writes freely (a grammar holds the output from its first token: no reasoning then).
        parser = getattr(router, "reasoning_parser", None)
        self.reasoning = parser if parser and req.kind == "chat" and req.grammar is None else None
        self.thinkers: dict[int, reasoning.Splitter] = {}
        # Where the answer starts, as the prompt (the same for every choice of a chat) ends.
        self.reasoning_start: str | None = None
        if self.reasoning is not None and runs:
            final = (req.messages or [{}])[-1].get("content")
            prefill = final if req.continue_final_message and isinstance(final, str) else None
            self.reasoning_start = reasoning.start(runs[0].prompt_text, prefill)

    def call_id(self, run: _Run) -> str:
        if run.index not in self.call_ids:
            self.call_ids[run.index] = "call_" + uuid.uuid4().hex[:24]
        return self.call_ids[run.index]

    @property
    def cuttable(self) -> bool:
        """Still generating and not yet answering a cut (a cancel can be swallowed, e.g. by a
        wait_for finishing at the same moment: cutting again is how it lands)."""
        return not self.cut_seen and self.task is not None and not self.task.done()

    def cut(self, why: str) -> None:
        """Ends the request now: its handler is cancelled (the client-disconnect path, which
        aborts the request on the workers), and the cancellation becomes a 503 `draining` answer
        in `_cut_is_an_error`."""
        self.cut_reason = why
        if self.task is not None:
            self.task.cancel()

    @contextlib.contextmanager
    def _cut_is_an_error(self) -> Iterator[None]:
        try:
            yield
        except asyncio.CancelledError:
            if self.cut_reason is None or self.task is None:
                raise
            self.cut_seen = True
            self.task.uncancel()  # answered, not cancelled: the handler goes on to write it
            tokens = sum(run.num_tokens for run in self.runs)
            raise FlowError(
                503,
                f"{self.cut_reason}; the request was cut after {tokens} tokens",
                code="draining",
            ) from None

    async def _chunks(self) -> AsyncIterator[tuple[_Run, Chunk]]:
        """Every choice's chunks as they come, until each has its finish reason. The first
        error of any choice ends them all (closing a choice's chunks aborts it on the workers).

        A prompt's first copy starts at once, its other copies when its first token is back:
        by then its prefill worker holds the prompt in its prefix cache, and cache-aware
        routing sends them there, so the prompt is computed once, not n times."""
        if len(self.runs) == 1:
            run = self.runs[0]
            chunks = run.chunks()
            try:
                async for item in chunks:
                    run.delivered = run.counts.popleft()
                    yield run, item
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the client left, or the drain deadline cut the request
                # A gRPC call cancelled under the flow (a retired worker's channel closed):
                # the client gets an error, not a dropped connection.
                raise FlowError(502, "the worker call was cancelled") from None
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
            return
        # Bounded: a slow client slows the choices down instead of piling their tokens up.
        queue: asyncio.Queue[tuple[_Run, Chunk | None, Exception | None]] = asyncio.Queue(
            maxsize=2 * len(self.runs)
        )
        tasks: list[asyncio.Task[None]] = []

        def start(run: _Run, copies: list[_Run]) -> None:
            tasks.append(asyncio.create_task(pump(run, copies)))

        async def pump(run: _Run, copies: list[_Run]) -> None:
            chunks = run.chunks()
            try:
                async for item in chunks:
                    for copy in copies:
                        start(copy, [])
                    copies = []
                    await queue.put((run, item, None))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the request is ending (below): nobody reads the queue any more
                # Not this task's cancellation: a gRPC call cancelled under the flow (grpc.aio
                # raises CancelledError when the router closes a retired worker's channel).
                # Unreported, the other choices' consumer waited for this one forever.
                error = FlowError(502, f"choice {run.index}: the worker call was cancelled")
                await queue.put((run, None, error))
                return
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((run, None, e))
                return
            finally:
                # Closed now even when cancelled while waiting on the queue (the generator
                # suspended at a yield): its flow's aborts go out at once, not at garbage
                # collection.
                await chunks.aclose()  # type: ignore[attr-defined]
            for copy in copies:  # (a flow ends with a token, but the count must not hang)
                start(copy, [])
            await queue.put((run, None, None))

        n = self.req.n
        for first in range(0, len(self.runs), n):
            start(self.runs[first], self.runs[first + 1 : first + n])
        try:
            running = len(self.runs)
            while running:
                run, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    running -= 1
                else:
                    run.delivered = run.counts.popleft()
                    yield run, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage(self, delivered: bool = False) -> dict[str, Any]:
        """A prompt's tokens count once however many choices it has (as OpenAI's): its first
        copy's prefill, whose cached tokens are the prompt's `cached_tokens`."""
        firsts = self.runs[:: self.req.n]
        return api.usage(
            sum(len(run.prompt_ids) for run in firsts),
            sum(run.delivered if delivered else run.num_tokens for run in self.runs),
            sum(run.flow.stats.num_cached_tokens for run in firsts),
        )

    async def complete(self) -> web.Response:
        parts: dict[int, list[str]] = {
            run.index: [run.prompt_text] if self.req.echo else [] for run in self.runs
        }
        entries: dict[int, list[api.TokenLogprob]] = {run.index: [] for run in self.runs}
        with self._cut_is_an_error():
            async for run, (text, _reason, chunk_entries) in self._chunks():
                parts[run.index].append(text)
                entries[run.index] += chunk_entries
        self.status = "ok"
        choices = []
        for run in self.runs:
            text = "".join(parts[run.index])
            logprobs = run.logprobs_object(entries[run.index])
            if self.req.kind != "chat":
                choices.append(api.completion_choice(run.index, text, run.finish_reason, logprobs))
                continue
            thought = None
            if self.reasoning is not None:
                thought, text = reasoning.split(text, self.reasoning, self.reasoning_start)
            if self.req.tool_choice is None:
                choices.append(
                    api.chat_choice(run.index, text, run.finish_reason, logprobs, None, thought)
                )
            else:
                content, calls, reason = api.tool_answer(
                    self.req, text, run.finish_reason, self.call_id(run)
                )
                choices.append(
                    api.chat_choice(run.index, content, reason, logprobs, calls, thought)
                )
        return web.json_response(
            api.response(
                self.req.kind, self.rid, self.model, self.created, choices, self.usage(), False
            ),
            headers={"X-Request-Id": self.rid},
        )

    def _tool_delta(
        self, run: _Run, text: str, reason: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """A tool-choice answer's stream delta (None: nothing to send yet) and finish reason. A
        named function's arguments stream as they come (OpenAI's shape: the first delta has
        the call's id and name); "required" calls go out whole in the last chunk, once the
        array parses; "auto" streams its content until a call begins, and the calls (or, if
        they do not parse, the text) go out in the last chunk."""
        delta: dict[str, Any] = {"role": "assistant", "content": None} if run.first else {}
        choice = self.req.tool_choice
        if choice == "auto":
            parser = self.req.tool_parser or "hermes"
            splitter = self.splitters.setdefault(run.index, tool_parsers.StreamSplitter(parser))
            content = splitter.feed(text)
            if reason is None:
                if splitter.held is not None and not content and not run.first:
                    return None, None  # inside a call
                return delta | {"content": content}, None
            pending, held = splitter.finish()
            content += pending
            calls = None
            if held:  # from the call's start on: the whole answer's rule decides
                _, calls, call_reason = api.tool_answer(self.req, held, reason, self.call_id(run))
            if calls is None:
                return delta | {"content": content + held}, reason
            if content:
                delta["content"] = content
            return delta | {"tool_calls": _indexed(calls)}, call_reason
        if choice != "required":
            call: dict[str, Any] = {"index": 0}
            if run.first:
                call |= {"id": self.call_id(run), "type": "function"}
                call["function"] = {"name": choice, "arguments": text}
            else:
                call["function"] = {"arguments": text}
            if text or run.first:
                delta["tool_calls"] = [call]
            return delta, reason
        self.held[run.index].append(text)
        if reason is None:
            return (delta if run.first else None), None
        whole = "".join(self.held.pop(run.index))
        unparsed, required, reason = api.tool_answer(self.req, whole, reason, self.call_id(run))
        if required is None:
            delta["content"] = unparsed
        else:
            delta["tool_calls"] = _indexed(required)
        return delta, reason

    def _chunk(
        self, run: _Run, text: str, reason: str | None, logprobs: Any
    ) -> dict[str, Any] | None:
        if self.req.kind == "chat":
            thought = ""
            if self.reasoning is not None:
                thinker = self.thinkers.get(run.index)
                if thinker is None:
                    thinker = reasoning.Splitter(self.reasoning, self.reasoning_start)
                    self.thinkers[run.index] = thinker
                thought, text = thinker.feed(text)
                if reason is not None:
                    more_thought, more_text = thinker.finish()
                    thought, text = thought + more_thought, text + more_text
            delta: dict[str, Any] | None
            if self.req.tool_choice is not None:
                delta, reason = self._tool_delta(run, text, reason)
                if delta is None and not thought:
                    return None
                delta = delta or {}
            else:
                delta = {"content": text} if text or not reason else {}
                if run.first:
                    delta = {"role": "assistant", "content": text}
            if thought:
                if not run.first and not delta.get("content"):
                    delta.pop("content", None)  # a reasoning delta, no content in it
                delta["reasoning"] = delta["reasoning_content"] = thought  # as chat_choice
            choice = api.chat_delta_choice(run.index, delta, reason, logprobs)
        else:
            choice = api.completion_choice(run.index, text, reason, logprobs)
        run.first = False
        chunk = api.response(
            self.req.kind, self.rid, self.model, self.created, [choice], None, chunk=True
        )
        if self.req.include_usage:
            # OpenAI: every chunk before the usage chunk carries `usage: null`; with
            # continuous_usage_stats, the totals so far.
            # (What went out so far: other choices' tokens still queued are not yet.)
            chunk["usage"] = self.usage(delivered=True) if self.req.continuous_usage else None
        return chunk

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        timeout = self.router.options.write_timeout
        if not timeout:
            await response.write(data)
            return
        try:
            async with asyncio.timeout(timeout):
                await response.write(data)
        except TimeoutError:
            raise _Stalled from None

    async def stream(self, request: web.Request) -> web.StreamResponse:
        chunks = self._chunks()
        response: web.StreamResponse | None = None
        try:
            # Wait for the first token before answering: an error before it (no capacity,
            # every prefill failed) is still a plain HTTP error with the right status.
            with self._cut_is_an_error():
                first = await anext(chunks, None)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": self.rid,
                }
            )
            if request.version < HttpVersion11:
                # HTTP/1.0 has no chunking: the stream's end is the connection's. aiohttp
                # (3.14) decides so when it writes the headers but does not keep the decision,
                # so a keep-alive client's connection stayed open after [DONE] and it waited
                # forever (its next request's answer would have been read as more of this body).
                response.force_close()
            await response.prepare(request)
            pending = [first] if first is not None else []
            # A tool call's text held back (sent whole at the end) keeps its tokens' logprobs
            # for the chunk that finally carries it.
            held_entries: dict[int, list[api.TokenLogprob]] = {}
            try:
                with self._cut_is_an_error():
                    while True:
                        if pending:
                            run, (text, reason, entries) = pending.pop()
                        else:
                            item = await anext(chunks, None)
                            if item is None:
                                break
                            run, (text, reason, entries) = item
                        if run.first and self.req.echo:
                            text = run.prompt_text + text
                        entries = held_entries.pop(run.index, []) + entries
                        logprobs = run.logprobs_object(entries)
                        chunk = self._chunk(run, text, reason, logprobs)
                        if chunk is not None:
                            await self._send(response, api.sse(chunk))
                        elif entries:
                            held_entries[run.index] = entries
            except FlowError as e:
                # Tokens already went out: the status line is sent, so the error is an event
                # (a dead decode worker, or the router's drain deadline).
                self.status = "error"
                self.error = e.message
                err = api.APIError(e.status, e.message, code=e.code)
                await self._send(response, api.sse(err.body()))
                await self._send(response, api.sse("[DONE]"))
                return response
            if self.req.include_usage:
                await self._send(
                    response,
                    api.sse(
                        api.usage_chunk(
                            self.rid, self.model, self.created, self.req.kind, self.usage()
                        )
                    ),
                )
            await self._send(response, api.sse("[DONE]"))
            self.status = "ok"
            return response
        except ConnectionResetError:
            # The client hung up between two writes (the handler is only cancelled once
            # aiohttp notices the lost connection): an ordinary abort, not a server error.
            # Returning the started response lets aiohttp close it quietly; raising would log
            # "Error handling request" with a traceback for every such client.
            self.status = "abort"
            if response is not None:
                return response
            raise
        except _Stalled:
            # The client stopped reading: without a cut it held its connection, its stream
            # on the decode worker and every token generated for it, for as long as it kept
            # the connection open. Reset, so the kernel drops the unsent data too.
            self.status = "stalled"
            log.warning(
                "%s: the client read nothing for %gs (--write-timeout): cut",
                self.rid,
                self.router.options.write_timeout,
            )
            await chunks.aclose()  # type: ignore[attr-defined]  # before the reset cancels us
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        linger = struct.pack("ii", 1, 0)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                transport.abort()
            assert response is not None  # only writes after prepare raise it
            return response
        except asyncio.CancelledError:
            self.status = "abort"
            raise
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]


class _Stalled(Exception):
    """A write to a streaming client waited longer than --write-timeout."""


# ---- the `splitserve router` command --------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="ServingConfig YAML (flags override it)")
    parser.add_argument("--port", type=int, help="HTTP port (0 = pick a free one)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--model", help="model directory (the router loads its tokenizer only)")
    parser.add_argument("--model-name", help="name clients pass as 'model' (default: dir name)")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--service", help="service label on metrics (default: config's)")
    parser.add_argument("--prefill", help="prefill endpoints host:port,... (dns: the Service)")
    parser.add_argument("--decode", help="decode endpoints host:port,... (dns: the Service)")
    parser.add_argument(
        "--colocated",
        help="colocated endpoints host:port,... (instead of prefill+decode; dns: the Service)",
    )
    parser.add_argument("--discovery", choices=("static", "dns"))
    parser.add_argument(
        "--workers-file",
        help="JSON {role: [host:port, ...]} re-read when it changes (instead of the lists above; "
        "local mode's autoscaler rewrites it)",
    )
    parser.add_argument("--prefill-policy", choices=PREFILL_POLICIES)
    parser.add_argument(
        "--decode-policy",
        choices=DECODE_POLICIES,
        help="cache_aware (default) and most_free_blocks both pick the decode worker with the "
        "smallest share in use of its scarcer resource, batch slots or KV blocks; cache_aware "
        "counts the prompt's blocks a worker holds as free",
    )
    parser.add_argument("--colocated-policy", default="cache_aware", choices=COLOCATED_POLICIES)
    parser.add_argument(
        "--api-key-file",
        help="require 'Authorization: Bearer <key>' on /v1/*: keys one per line (re-read when "
        f"the file changes); also or instead {ENV_VAR} (comma-separated)",
    )
    parser.add_argument("--max-request-bytes", type=int)
    parser.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between Load polls of each worker"
    )
    parser.add_argument(
        "--admission-timeout",
        type=float,
        help="seconds a request may wait for free KV blocks on a decode worker (default: "
        "config router.admission_timeout_seconds, 30)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    parser.add_argument(
        "--write-timeout",
        type=float,
        help="seconds one write to a streaming client may wait (its buffers full) before it "
        "is cut and its request aborted (counted as status stalled; default: config "
        "router.write_timeout_seconds, 60; 0: never)",
    )
    parser.add_argument(
        "--ready-without-workers",
        action="store_true",
        help="stay ready while a pool has no worker (pools that scale to zero: the requests "
        "that wake them must reach the router)",
    )
    parser.add_argument(
        "--empty-pool-wait",
        type=float,
        help="seconds a request waits for a worker of a pool that has none (one waking from "
        "zero, or every worker restarting) before its 503 (default: --admission-timeout)",
    )
    parser.add_argument(
        "--no-decode-kv-reuse",
        action="store_true",
        help="send every prompt's whole KV to the decode worker, even the blocks its prefix "
        "cache holds (an ablation for benchmarks)",
    )
    parser.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve /debug/workers (worker addresses, health and load) on the API port",
    )
    parser.add_argument(
        "--log-requests",
        action="store_true",
        default=None,
        help="log one JSON line per generation request (id, status, tokens, TTFT, workers, "
        "error) on the logger splitserve.requests",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("auto", "none", *tool_parsers.PARSERS),
        default=None,
        help="how the model writes tool calls, for tool_choice auto: auto (default) = the "
        "format its chat template shows (hermes: <tool_call> JSON, as Qwen's; llama3_json: "
        "Llama 3.1's JSON calls); none = refuse tool_choice auto",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=("auto", "none", *reasoning.PARSERS),
        default=None,
        help="how a thinking model marks its reasoning, returned as reasoning_content: auto "
        "(default) = what its chat template shows (qwen3: <think>...</think> written by the "
        "model; deepseek_r1: the template opens <think>); none = leave it in the content",
    )
    parser.add_argument("--log-level", default="INFO")


def check_flags(args: argparse.Namespace) -> None:
    """Out-of-range flags fail here, naming the field, before anything binds or loads."""
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ConfigError(f"port: {args.port} must be in [0, 65535]")
    minimums: list[tuple[str, float | None, float]] = [
        ("max_request_bytes", args.max_request_bytes, 1),
        ("max_model_len", args.max_model_len, 1),
        ("poll_interval", args.poll_interval, 0.01),
        ("admission_timeout", args.admission_timeout, 0),
        ("empty_pool_wait", args.empty_pool_wait, 0),
        ("drain_timeout", args.drain_timeout, 0),
        ("write_timeout", args.write_timeout, 0),
    ]
    for name, value, minimum in minimums:
        if value is not None and not value >= minimum:  # nan too: it compares false
            raise ConfigError(f"{name}: {value} is below the minimum {minimum}")


def options_from_args(args: argparse.Namespace) -> tuple[RouterOptions, int]:
    """Flags over --config -> the router's options and port; raises ConfigError naming the field."""
    check_flags(args)
    config = ServingConfig.load(args.config) if args.config else ServingConfig()
    rs = config.router
    model_dir = args.model or config.model.path
    if not model_dir:
        raise ConfigError("model.path: no model directory (pass --model or set it in --config)")
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"model.path: {model_dir} has no config.json")
    discovery_kind = args.discovery or rs.discovery
    prefill = (
        args.prefill
        if args.prefill is not None
        else (rs.prefill_service if discovery_kind == "dns" else rs.prefill_endpoints)
    )
    decode = (
        args.decode
        if args.decode is not None
        else (rs.decode_service if discovery_kind == "dns" else rs.decode_endpoints)
    )
    discovery: Discovery
    try:
        if args.workers_file:
            given = [
                flag
                for flag, value in (
                    ("--prefill", args.prefill),
                    ("--decode", args.decode),
                    ("--colocated", args.colocated),
                    ("--discovery", args.discovery),
                )
                if value
            ]
            if given:
                raise ValueError(
                    f"workers_file: use --workers-file or {', '.join(given)}, not both"
                )
            discovery = FileDiscovery(args.workers_file)
        elif discovery_kind == "dns":
            discovery = DnsDiscovery(
                {
                    "prefill": str(prefill or ""),
                    "decode": str(decode or ""),
                    "colocated": args.colocated or "",
                }
            )
        else:
            discovery = StaticDiscovery(
                split_endpoints(prefill), split_endpoints(decode), split_endpoints(args.colocated)
            )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    name = args.model_name or config.model.name or Path(model_dir).name
    max_len = args.max_model_len or config.model.max_model_len or model_max_len(model_dir)
    options = RouterOptions(
        model_name=name,
        model_dir=model_dir,
        max_model_len=max_len,
        vocab_size=model_config(model_dir).get("vocab_size"),
        service=args.service or config.service,
        discovery=discovery,
        prefill_policy=args.prefill_policy or rs.prefill_policy,
        decode_policy=args.decode_policy or rs.decode_policy,
        colocated_policy=args.colocated_policy,
        max_request_bytes=args.max_request_bytes or rs.max_request_bytes,
        poll_interval=args.poll_interval,
        flow=FlowSettings(
            admission_timeout_seconds=flag_or(args.admission_timeout, rs.admission_timeout_seconds),
            empty_pool_wait_seconds=args.empty_pool_wait,
            decode_kv_reuse=rs.decode_kv_reuse and not args.no_decode_kv_reuse,
        ),
        drain_timeout=args.drain_timeout,
        write_timeout=flag_or(args.write_timeout, rs.write_timeout_seconds),
        ready_without_workers=args.ready_without_workers,
        debug_endpoints=args.debug_endpoints,
        log_requests=bool(args.log_requests or rs.log_requests),
        tool_call_parser=args.tool_call_parser or rs.tool_call_parser,
        reasoning_parser=args.reasoning_parser or rs.reasoning_parser,
        api_keys=ApiKeys.from_environment(args.api_key_file),
    )
    port = args.port if args.port is not None else rs.port
    return options, port


# After the drain, how long connections accepted before the listener closed may still send a
# request and get an answer.
DRAIN_LINGER_S = 1.0


class ListenError(Exception):
    """The router's port cannot be bound."""


class _OpenAIErrorHandler(QuietErrorHandler):
    """Protocol-level refusals (see http_errors) answered with an OpenAI-style error body."""

    logger = log

    def error_response(self, request: BaseRequest, status: int, why: str) -> web.StreamResponse:
        code = "internal_error" if status >= 500 else "bad_http_request"
        return web.json_response(api.APIError(status, why, code=code).body(), status=status)

    def client_error(
        self, request: BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse | None:
        if isinstance(exc, ContentEncodingError) and "install" in str(exc):
            # br or zstd without the module that decodes it (aiohttp's text says to install
            # it, which is no advice for a client): a 415 naming what is accepted.
            coding = "zstd" if "zstd" in str(exc) else "br"
            err = unsupported_coding(coding)
            log.info("bad HTTP request from %s: %s", request.remote, err.message)
            return web.json_response(err.body(), status=415, headers=err.headers)
        return None

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A body that fails its Content-Encoding was already answered (400 `invalid_body`);
        # aiohttp meets the same error again when it drains the rest of the body after the
        # handler. That is the client's fault, not an "Unhandled exception" with a traceback.
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            log.info("request body from a client could not be read: %s", " ".join(str(exc).split()))
            return
        super().log_exception(*args, **kw)


class AppRunner(http_errors.AppRunner):
    """web.AppRunner whose connections answer protocol-level errors in the API's shape."""

    handler_class = _OpenAIErrorHandler


async def serve(router: Router, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM/SIGINT (or `stop`), then drains in-flight requests."""
    # The drain deadline is kept below, so cleanup gives what is left (answers still being
    # written) only the linger, not aiohttp's default minute past the deadline.
    runner = AppRunner(
        router.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=DRAIN_LINGER_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:  # a port in use: `run` prints one line instead of a traceback
        await runner.cleanup()
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise ListenError(f"port: cannot listen on {host}:{port}: {reason}") from e
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    print(f"READY role=router port={bound}", flush=True)
    log.info("router serving %s on %s:%d", router.options.model_name, host, bound)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    router.draining = True
    deadline = time.monotonic() + router.options.drain_timeout
    while router.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    # What is still generating is cut, and its client told why (an SSE error event, or a 503).
    router.cut_in_flight()
    # Stop accepting first (new connections are refused: a clean, retryable error), then give
    # requests on connections accepted just before a moment to be read and answered (503
    # draining, Connection: close). Closing right away dropped them unanswered: cleanup closes
    # every connection that has not delivered a request yet.
    for listening in list(runner.sites):
        await listening.stop()
    linger_end = time.monotonic() + DRAIN_LINGER_S
    while time.monotonic() < linger_end or (router.in_flight and time.monotonic() < deadline):
        await asyncio.sleep(0.05)
        router.cut_in_flight()  # again, for a cut that did not land (see _Answer.cuttable)
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        options, port = options_from_args(args)
        tokenizer = load_tokenizer(options.model_dir)
        router = Router(options, tokenizer)
    except ValueError as e:  # ConfigError included: bad input, named, exit 2 like the workers
        print(f"splitserve router: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(router, args.host, port))
    except ListenError as e:
        print(f"splitserve router: {e}", file=sys.stderr)
        return 1
    return 0
