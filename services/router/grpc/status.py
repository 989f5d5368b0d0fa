"""The router's errors (services/router/errors.py) as the services' typed errors
(services/common/errors.py), so the one gRPC mapper (services/common/grpc_errors.py) ends the
call with their status and trailing metadata:

    ModelNotFound     NotFound            NOT_FOUND (as generate.proto documents)
    ValueError        InvalidArgument     INVALID_ARGUMENT; an InvalidRequest's field in the trailing
                                          metadata ``pdserve-invalid-param``
    Unavailable       Unavailable         UNAVAILABLE
    Overloaded        ResourceExhausted   RESOURCE_EXHAUSTED, trailing metadata ``retry-after``
                                          (whole seconds >= 1)
    RequestTimeout    DeadlineExceeded    DEADLINE_EXCEEDED
    BackendError      Internal            INTERNAL

``abort_with(context, error)`` ends the call with the error's status; it never returns.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from services.common import errors, grpc_errors
from services.router.errors import (
    BackendError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestTimeout,
    Unavailable,
)

# What a handler may abort with (anything else is a bug: grpc answers UNKNOWN and logs it).
MAPPED = (ValueError, Overloaded, BackendError)


def service_error(error: Exception) -> errors.ServiceError:
    """The services' error ``error`` stands for (module docstring)."""
    message = str(error)
    if isinstance(error, ModelNotFound):
        return errors.NotFound(message)
    if isinstance(error, ValueError):
        param = error.param if isinstance(error, InvalidRequest) else None
        return errors.InvalidArgument(message, param=param or "")
    if isinstance(error, Unavailable):
        return errors.Unavailable(message)
    if isinstance(error, Overloaded):
        return errors.ResourceExhausted(message, retry_after_s=max(error.retry_after_s, 1.0))
    if isinstance(error, RequestTimeout):
        return errors.DeadlineExceeded(message)
    if isinstance(error, BackendError):
        return errors.Internal(message)
    raise TypeError(f"no gRPC status for {type(error).__name__}: {error}") from error


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    await grpc_errors.abort_with(context, service_error(error))
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker
