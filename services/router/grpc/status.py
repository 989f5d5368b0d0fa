"""The router's errors (services/router/errors.py) as gRPC status codes, in one place.

    ModelNotFound     NOT_FOUND (as generate.proto documents)
    ValueError        INVALID_ARGUMENT; an InvalidRequest's field in the trailing metadata
                      ``pdserve-invalid-param``
    Unavailable       UNAVAILABLE
    Overloaded        RESOURCE_EXHAUSTED, trailing metadata ``retry-after`` (whole seconds >= 1)
    RequestTimeout    DEADLINE_EXCEEDED
    BackendError      INTERNAL

``abort_with(context, error)`` ends the call with the error's status; it never returns.
"""

from __future__ import annotations

import math
from typing import NoReturn

import grpc

from services.common.wire import INVALID_PARAM_KEY  # trailing metadata: the field an INVALID_ARGUMENT names
from services.router.errors import (
    BackendError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestTimeout,
    Unavailable,
)

RETRY_AFTER_KEY = "retry-after"  # trailing metadata of RESOURCE_EXHAUSTED: whole seconds

# What a handler may abort with (anything else is a bug: grpc answers UNKNOWN and logs it).
MAPPED = (ValueError, Overloaded, BackendError)


def status_of(error: Exception) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code and trailing metadata ``error`` maps to (module docstring)."""
    if isinstance(error, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, ()
    if isinstance(error, ValueError):
        param = error.param if isinstance(error, InvalidRequest) else None
        return grpc.StatusCode.INVALID_ARGUMENT, ((INVALID_PARAM_KEY, param),) if param else ()
    if isinstance(error, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, ()
    if isinstance(error, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            (RETRY_AFTER_KEY, str(max(math.ceil(error.retry_after_s), 1))),)
    if isinstance(error, RequestTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, ()
    if isinstance(error, BackendError):
        return grpc.StatusCode.INTERNAL, ()
    raise TypeError(f"no gRPC status for {type(error).__name__}: {error}") from error


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    code, trailing = status_of(error)
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(code, str(error))
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker
