"""The current request's deadline, for the worker calls made on its behalf.

The frontend sets it once per request (``timeout`` field, or the gRPC call's own deadline);
a backend reads it wherever it starts a worker call, so that the worker sees the time the
client has left and frees what it holds when that runs out, even if the router cannot tell it:

    with request_deadline(time.monotonic() + 5.0):         # the frontend, per request
        ...
    call = stub.Prefill(request, timeout=remaining_s(300.0))  # a backend: min(default, left)

A ``ContextVar``: each request runs in its own task, and tasks a backend spawns for the
request (one per sample) copy it at creation. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

MIN_CALL_TIMEOUT_S = 0.001  # a call made after the deadline still gets a (failing) deadline

_deadline: ContextVar[float | None] = ContextVar("pdserve_request_deadline", default=None)


def set_request_deadline(deadline: float | None) -> None:
    """Set the deadline of the request the current task serves (None: no deadline)."""
    _deadline.set(deadline)


@contextlib.contextmanager
def request_deadline(deadline: float | None) -> Iterator[None]:
    """Within the block, worker calls are bounded by ``deadline`` (monotonic s; None: none)."""
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def current_deadline() -> float | None:
    return _deadline.get()


def remaining_s(default_s: float) -> float:
    """Seconds a worker call may take: ``default_s``, or less when the request's deadline is
    nearer (never below MIN_CALL_TIMEOUT_S, so an expired request fails fast, not never)."""
    deadline = _deadline.get()
    if deadline is None:
        return default_s
    return max(min(default_s, deadline - time.monotonic()), MIN_CALL_TIMEOUT_S)
