"""The router's errors (services/router/errors.py) as OpenAI-shaped HTTP answers, in one place.

    InvalidRequest      its ``status`` (400; 404 model_not_found; 413; 431), param and code
    ValueError          400 (a backend's verdict on bad input)
    Unavailable         503 unavailable
    Overloaded          429 rate_limit_exceeded, with Retry-After (whole seconds >= 1)
    RequestTimeout      504 deadline_exceeded
    BackendError        500
    an HTTPException    its own status (404 for an unknown path, 405, ...)
    anything else       500 naming only the exception's type (a bug: the log has the rest)

``openai_errors`` answers them before a response started; ``stream_error`` is the ``error``
event of a stream that already started. ``count_rejections`` counts the requests refused
before a Generation started. No error body carries a stack trace or a file path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from services.router.errors import (
    BackendError,
    InvalidRequest,
    NotServing,
    Overloaded,
    RefusedByBackend,
    RequestTimeout,
    Unavailable,
)
from services.router.http.protocol import error_body
from services.router.http.responses import dumps
from services.router.metrics import RouterMetrics
from services.router.pipeline.admission import QueueFull

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           error_type: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, param, code, error_type), status=status,
                             dumps=dumps, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Exceptions raised before a response started -> OpenAI-shaped error responses."""
    try:
        return await handler(request)
    except InvalidRequest as error:
        return _error(error.status, error.message, error.param, error.code)
    except ValueError as error:  # the backend's verdict on bad input
        return _error(400, str(error))
    except Unavailable as error:
        return _error(503, str(error), code="unavailable", error_type="service_unavailable")
    except Overloaded as error:
        retry_after = str(max(math.ceil(error.retry_after_s), 1))
        return _error(429, str(error), code="rate_limit_exceeded", error_type="requests",
                      headers={"Retry-After": retry_after})
    except RequestTimeout as error:
        return _error(504, str(error), "timeout", "deadline_exceeded", "timeout_error")
    except BackendError as error:
        log.warning("request failed in the backend: %s", error)
        return _error(500, str(error), error_type="internal_server_error")
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error(error.status, f"{error.reason}: {request.method} {request.path}",
                      code=error.reason.lower().replace(" ", "_"))
    except Exception as error:  # noqa: BLE001 - a bug; the client still gets JSON
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"internal error ({type(error).__name__}); the router's log has the "
                           "details", error_type="internal_server_error")


def stream_error(error: Exception) -> dict[str, Any]:
    """The ``error`` event that ends a stream already started."""
    if isinstance(error, RequestTimeout):
        return error_body(str(error), "timeout", "deadline_exceeded", "timeout_error")
    return error_body(str(error), error_type="internal_server_error")


def count_rejections(metrics: RouterMetrics) -> Middleware:
    """Count requests refused with a 4xx/503 before a Generation started (bad input, not ready):
    ``pdserve_rejected_requests_total`` and an ``error`` in ``dynamo_frontend_requests_total``.
    A backend's ValueError was already counted by its Generation."""
    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidRequest as error:
            metrics.reject("invalid", was_counted=isinstance(error, RefusedByBackend))
            raise
        except ValueError:
            metrics.reject("invalid", was_counted=True)
            raise
        except Overloaded as error:
            # A Generation counted it unless the router refused it itself (queue full, not ready).
            was_counted = not isinstance(error, (QueueFull, NotServing))
            metrics.reject("overload", was_counted=was_counted)
            raise

    return count
