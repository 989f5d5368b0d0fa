"""The OpenAI-compatible HTTP server (aiohttp).

    POST /v1/completions        POST /v1/chat/completions     (SSE with "stream": true)
    GET  /v1/models             GET  /health                  (200 healthy, 503 otherwise)
    GET  /metrics               Prometheus text format (services/router/metrics.py)

Errors use OpenAI's shape (http/errors.py maps each of the router's errors once): 400 for bad
input, 404 for an unknown model, 413 / 431 for a body / headers beyond the router's
RequestLimits, 429 with ``Retry-After`` when the router's queue or every worker is full, 503
when not ready (starting, draining, no healthy worker), 504 when the request's ``timeout``
passed, 500 when the backend fails. Once a stream has started a failure is sent as an
``error`` event followed by ``data: [DONE]``. A client that disconnects
cancels its handler (``handler_cancellation``), which closes the request's Generation and so
aborts it in the backend.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.common.metrics import CONTENT_TYPE, render
from services.router.errors import BackendError, InvalidRequest, NotServing, Overloaded, RequestTimeout
from services.router.http.auth import OPEN, HttpAuth, require_api_key
from services.router.http.errors import count_rejections, openai_errors, stream_error
from services.router.http.protocol import (
    OpenAIRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from services.router.http.responses import ResponseRenderer, dumps
from services.router.pipeline.debug_route import debug_headers
from services.router.pipeline.frontend import Frontend, RouterState
from services.router.pipeline.generation import Generation

log = logging.getLogger(__name__)
# aiohttp's own per-line ceiling, this many times max_header_bytes: a header line between the
# two reaches the router's check (431, OpenAI-shaped); one beyond gets aiohttp's plain 400.
PARSER_HEADER_CEILING = 8
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


@dataclass
class HttpServer:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening, wait for in-flight handlers up to the runner's shutdown timeout."""
        await self.runner.cleanup()


async def start_http_server(state: RouterState, host: str = "127.0.0.1", port: int = 0,
                            drain_grace_s: float = 10.0, auth: HttpAuth = OPEN) -> HttpServer:
    """Bind ``host:port`` (0: any free port, see ``.port``) and serve. OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot bind HTTP server to {host}:{port} ({error}); is the port in use?") from error
    ceiling = state.limits.max_header_bytes * PARSER_HEADER_CEILING
    runner = web.AppRunner(build_app(state, auth), handler_cancellation=True,
                           shutdown_timeout=drain_grace_s, access_log=None,
                           max_line_size=ceiling, max_field_size=ceiling)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return HttpServer(runner, host, sock.getsockname()[1])


def build_app(state: RouterState, auth: HttpAuth = OPEN) -> web.Application:
    """The routes; ``auth``: API keys (http/auth.py), checked before anything else."""
    handlers = _Handlers(state)
    app = web.Application(middlewares=[require_api_key(auth), openai_errors, count_rejections(state.metrics),
                                       _check_size(state)],
                          client_max_size=state.limits.max_body_bytes)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    return app


def _check_size(state: RouterState) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Headers beyond ``max_header_bytes`` (431) and a declared body beyond ``max_body_bytes``
    (413) are refused before the body is read; a chunked body is cut off while reading (413)."""
    limits = state.limits

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        header_bytes = sum(len(name) + len(value) + 4 for name, value in request.raw_headers)
        if header_bytes > limits.max_header_bytes:
            raise InvalidRequest(f"the request headers are {header_bytes} bytes; at most "
                                 f"{limits.max_header_bytes} are allowed", None,
                                 "request_header_fields_too_large", status=431)
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            raise _body_too_large(request.content_length, limits.max_body_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            raise _body_too_large(None, limits.max_body_bytes) from None

    return check


def _body_too_large(num_bytes: int | None, limit: int) -> InvalidRequest:
    size = f"is {num_bytes} bytes" if num_bytes is not None else "is too large"
    return InvalidRequest(f"the request body {size}; at most {limit} bytes are allowed", None,
                          "request_too_large", status=413)


class _Handlers:
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def health(self, request: web.Request) -> web.Response:
        if await self.state.is_healthy():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = render(self.state.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        model = self._frontend().model
        return web.json_response({"object": "list", "data": [{
            "id": model.name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": model.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request)

    def _frontend(self) -> Frontend:
        frontend = self.state.frontend
        if frontend is None or self.state.is_draining:
            raise NotServing("the router is not serving (starting up or shutting down)")
        return frontend

    async def _generate(self, request: web.Request,
                        parse: Callable[[dict[str, Any]], OpenAIRequest]) -> web.StreamResponse:
        arrived_at = time.monotonic()
        frontend = self._frontend()
        api = parse(parse_json_body(await request.read()))
        frontend.check_model(api.model)
        prompt_ids = frontend.tokenize(api.prompt, api.messages, api.add_generation_prompt)
        params = frontend.check(prompt_ids, api.params, "messages" if api.is_chat else "prompt")
        await frontend.check_constraint(params)
        deadline = None if api.timeout_s is None else arrived_at + api.timeout_s
        async with frontend.generate(prompt_ids, params, is_stream=api.stream, arrived_at=arrived_at,
                                     deadline=deadline) as generation:
            render = ResponseRenderer(api, frontend, generation)
            headers = dict(debug_headers(generation)) if self.state.debug_route else {}
            if api.stream:
                return await _stream(request, api, generation, render, headers)
            async for delta in generation:
                render.add(delta)
            return web.json_response(render.response(), dumps=dumps, headers=headers)


async def _stream(request: web.Request, api: OpenAIRequest, generation: Generation,
                  render: ResponseRenderer, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request)

    async def send(data: dict[str, Any]) -> None:
        await response.write(f"data: {dumps(data)}\n\n".encode())

    try:
        try:
            for chunk in render.opening_chunks():
                await send(chunk)
            async for delta in generation:
                delta_json = render.chunk_json(delta)
                if delta_json is not None:
                    await response.write(f"data: {delta_json}\n\n".encode())
            if api.include_usage:
                await send(render.usage_chunk())
        except (BackendError, Overloaded, ValueError) as error:  # RequestTimeout is a BackendError
            log.log(logging.INFO if isinstance(error, RequestTimeout) else logging.WARNING,
                    "stream %s failed: %s", generation.request_id, error)
            await send(stream_error(error))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("client left stream %s; aborting it", generation.request_id)
    return response
