"""API-key check for the router's OpenAI HTTP server (an aiohttp middleware).

    app = web.Application(middlewares=[require_api_key(HttpAuth(keys, metrics_auth=False)), ...])

With keys configured, every route except ``GET /health`` (and ``GET /metrics`` unless
``metrics_auth``) needs ``Authorization: Bearer <key>``; anything else gets 401 with OpenAI's
error body (``{"error": {"message", "type": "invalid_request_error", "param": null,
"code": "invalid_api_key"}}``) and ``WWW-Authenticate: Bearer``, before the body is read or
a handler runs. Unknown paths need the key too (so a 404 tells a stranger nothing). No keys:
every route is open, as before. The message never echoes what was sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Middleware

from services.common.auth import KeySet, bearer_token
from services.router.http.protocol import error_body
from services.router.http.responses import dumps

OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class HttpAuth:
    """Accepted keys (empty: open) and whether ``/metrics`` needs one too."""

    keys: KeySet = field(default_factory=KeySet)
    metrics_auth: bool = False

    def is_open(self, path: str) -> bool:
        return (not self.keys.is_enabled or path in OPEN_PATHS
                or (path == METRICS_PATH and not self.metrics_auth))


OPEN = HttpAuth()  # no keys: every route open


def unauthorized(message: str) -> web.Response:
    body = error_body(message, None, "invalid_api_key", "invalid_request_error")
    return web.json_response(body, status=401, dumps=dumps,
                             headers={"WWW-Authenticate": 'Bearer realm="pdserve"'})


def require_api_key(auth: HttpAuth) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if auth.is_open(request.path):
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is None:
            return unauthorized("You didn't provide an API key. Send it in the Authorization "
                                "header as 'Bearer YOUR_KEY'.")
        if not auth.keys.matches(bearer_token(header)):
            return unauthorized("Incorrect API key provided.")
        return await handler(request)

    return check
