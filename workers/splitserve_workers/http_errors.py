"""Answers for requests aiohttp refuses before any route runs: an unparseable request line, too
many headers, a header over the size limit, bad chunked framing, TLS on the plain port.

aiohttp's default answers those with a text/plain body and logs each one as an ERROR with a
traceback, although they are the client's fault. Here the answer is a JSON body in the server's
own error shape, and the refusal is logged at INFO (a bad method, which TLS and scanner traffic
produce, at DEBUG). The router and the workers' probe/metrics port both serve this way.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)


def describe(status: int, exc: BaseException | None, message: str | None) -> str:
    """One short line saying why a request was refused."""
    if isinstance(exc, LineTooLong):  # its own text echoes the whole oversized line
        return f"the request line or a header is longer than {exc.args[1]} bytes"
    why = message or (str(exc) if exc else "") or HTTPStatus(status).phrase
    return " ".join(why.split())[:200]  # the C parser's text spans several lines


class QuietErrorHandler(RequestHandler):
    """aiohttp's per-connection protocol with protocol-level refusals answered by
    `error_response` and logged as the client's fault. Server errors (5xx) keep aiohttp's
    logging, traceback included."""

    def error_response(self, request: BaseRequest, status: int, why: str) -> web.StreamResponse:
        return web.json_response({"error": why}, status=status)

    def client_error(
        self, request: BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse | None:
        """A subclass's answer for a particular client error, or None for the general one."""
        return None

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs; its text body is dropped
            response = self.error_response(request, status, HTTPStatus(status).phrase)
        else:
            if request.writer.output_size > 0:
                raise ConnectionError("response already started; cannot send the error")
            special = self.client_error(request, status, exc)
            if special is not None:
                response = special
            else:
                why = describe(status, exc, message)
                level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
                self.logger.log(level, "bad HTTP request from %s: %s", request.remote, why)
                response = self.error_response(request, status, f"bad HTTP request: {why}")
        response.force_close()
        return response


class _Server(web.Server):
    handler_class: type[RequestHandler] = QuietErrorHandler

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections use `handler_class` (a QuietErrorHandler) to answer
    protocol-level errors."""

    handler_class: type[QuietErrorHandler] = QuietErrorHandler

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        made = _Server(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **server._kwargs,
        )
        made.handler_class = self.handler_class
        return made
