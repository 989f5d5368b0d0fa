"""Why a service call failed, typed where it is found; each protocol maps these once.

    raise InvalidArgument(f"Generate: n={n}; the router sends n > 1 as n requests")
    raise ResourceExhausted("ReserveBlocks: 3 free KV blocks, 5 needed", kv_full=True)
    raise Unavailable("KV transfer to decode worker 10.0.0.2:7001 failed", failed_peer="decode")

A handler raises one and returns; it never writes a status itself. gRPC servers map them in
``services/common/grpc_errors.py`` (installed by ``start_grpc_server`` on every server), so
the status codes live in one table. Each message says what went wrong and, where the caller can
act, what to change; it is sent to the caller as is. ``failed_peer`` names the worker role that
caused the failure when it is not this one ("decode", "prefill"): the router then retries on
another worker of that role. Exceptions that are not ServiceErrors are bugs and reach the caller
as gRPC's UNKNOWN.

No grpc import here: the same errors can be mapped to HTTP statuses.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A failure the caller is told about; subclasses say which kind."""

    def __init__(self, message: str, *, failed_peer: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.failed_peer = failed_peer


class InvalidArgument(ServiceError):
    """The request itself is wrong (empty id, bad parameters, a prompt that cannot fit).
    ``param``: the client's request field at fault, when one is (a structured-output
    constraint's ``response_format.json_schema``), so the router can name it."""

    def __init__(self, message: str, *, failed_peer: str = "", param: str = "") -> None:
        super().__init__(message, failed_peer=failed_peer)
        self.param = param


class NotFound(ServiceError):
    """What the request names (a reservation, a block) is not here."""


class AlreadyExists(ServiceError):
    """The request's id is already in use on this worker."""


class ResourceExhausted(ServiceError):
    """This worker is full: try another one or later. ``kv_full``: no free KV blocks (the
    router tells that apart from a full queue). ``retry_after_s``: when to try again, where the
    server can estimate it (the router's own admission control; 0: not said)."""

    def __init__(self, message: str, *, failed_peer: str = "", kv_full: bool = False,
                 retry_after_s: float = 0.0) -> None:
        super().__init__(message, failed_peer=failed_peer)
        self.kv_full = kv_full
        self.retry_after_s = retry_after_s


class FailedPrecondition(ServiceError):
    """The request is well formed but this system is not in a state to serve it (mismatched
    peers, a transport not enabled, a reservation no longer writable)."""


class Aborted(ServiceError):
    """Another party ended what this call depended on (a released reservation)."""


class Unavailable(ServiceError):
    """A dependency is down or failed for now (the engine thread, a peer, a transport)."""


class Cancelled(ServiceError):
    """The operation was cancelled on purpose."""


class DeadlineExceeded(ServiceError):
    """Something this call waited for did not happen in time (a lease, a transfer)."""


class Unauthenticated(ServiceError):
    """The caller did not prove who it is (missing or wrong token or key)."""


class DataLoss(ServiceError):
    """Bytes arrived corrupted."""


class Internal(ServiceError):
    """An invariant of this service broke; the message says which."""
