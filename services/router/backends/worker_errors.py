"""A failed worker call, as the router's errors (services/router/errors.py): the one map from a
worker's gRPC status to what the disaggregated backend raises, and the worker health it implies.

    worker_error(worker, exc, is_started=False)   before a sample's first event
    worker_error(worker, exc, is_started=True)    after it (the client may hold tokens)

Before the first event bad input (INVALID_ARGUMENT) is the client's (ValueError; RefusedByBackend
naming the request field when the worker's trailing metadata names one) and a full
worker (RESOURCE_EXHAUSTED) is pressure (Overloaded). After it, a worker lost mid-stream
(``LOST_CODES``, or a decode worker whose prefill peer failed it) is ``WorkerLost``: the
sample migrates (migration.py). Anything else is a BackendError naming the worker. An
UNAVAILABLE worker is marked unhealthy until a health poll passes again (unless the error
names its peer as the one that failed).
"""

from __future__ import annotations

import grpc

from services.common.grpc_errors import invalid_param
from services.common.wire import FAILED_PEER_KEY, KV_FULL_KEY
from services.router.errors import BackendError, Overloaded, RefusedByBackend
from services.router.routing.worker_pool import Worker

# A worker gone (UNAVAILABLE: connection refused / reset), or a stream the server cancelled
# (a drain past --drain-grace-s) or broke: the request itself is fine, another worker can go on.
# A decode worker whose prefill peer failed it (its KV never landed) says so in trailing metadata
# (FAILED_PEER_KEY = "prefill"), whatever the code.
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED)
# Before the first event: another worker may succeed (full, down, or slow to answer), and a
# call the server cancelled (CANCELLED: a worker that began to drain cancels every call it had
# not started yet; the router's own cancels are asyncio.CancelledError, never this).
RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class WorkerLost(BackendError):
    """A worker stopped serving a request mid-stream; the request may go on elsewhere."""

    def __init__(self, worker: Worker, detail: str, is_peer_at_fault: bool = False) -> None:
        super().__init__(f"{worker.role} worker {worker.address} lost the request: {detail}")
        self.worker = worker
        self.is_peer_at_fault = is_peer_at_fault  # the worker is fine; its peer failed it


def failed_peer(exc: grpc.aio.AioRpcError) -> str:
    """The role a worker blames for its failure (``FAILED_PEER_KEY``), or ""."""
    for key, value in exc.trailing_metadata() or ():
        if key == FAILED_PEER_KEY:
            return str(value)
    return ""


def is_kv_full(exc: grpc.aio.AioRpcError) -> bool:
    """A decode worker refused for lack of free KV blocks (not a full queue)."""
    return exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and any(
        key == KV_FULL_KEY for key, _ in exc.trailing_metadata() or ())


def mark_if_unavailable(worker: Worker, exc: grpc.aio.AioRpcError) -> None:
    """An unreachable worker leaves routing until a health poll passes (a full one stays)."""
    if exc.code() is grpc.StatusCode.UNAVAILABLE:
        worker.mark_unhealthy(exc.details() or "UNAVAILABLE")


def worker_error(worker: Worker, exc: grpc.aio.AioRpcError, is_started: bool) -> Exception:
    """The router's exception for ``worker``'s failed call (module docstring)."""
    code, details = exc.code(), exc.details()
    peer = failed_peer(exc)
    if code is grpc.StatusCode.INVALID_ARGUMENT and not is_started:
        param = invalid_param(exc)
        return RefusedByBackend(details, param) if param else ValueError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not is_started:
        return Overloaded(details)
    if code is grpc.StatusCode.UNAVAILABLE and peer != "decode":
        worker.mark_unhealthy(details)
    if is_started and worker.role == "decode" and peer == "prefill":
        return WorkerLost(worker, f"{code.name}: {details}", is_peer_at_fault=True)
    if is_started and code in LOST_CODES:
        return WorkerLost(worker, f"{code.name}: {details}")
    return BackendError(f"{worker.role} worker {worker.address} failed: {code.name}: {details}")
