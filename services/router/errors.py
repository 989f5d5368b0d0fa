"""The router's errors, raised where they arise and mapped once per protocol (HTTP:
services/router/http/errors.py; gRPC: services/router/grpc/status.py).

    InvalidRequest   bad input, before any worker is touched     HTTP ``status`` (400, 413, 431)
                                                                  / gRPC INVALID_ARGUMENT
    RefusedByBackend bad input a worker's engine found, naming    HTTP 400 / INVALID_ARGUMENT
                     the field (a constraint that won't compile)
    ModelNotFound    the ``model`` field names another model      HTTP 404 model_not_found
                                                                  / gRPC NOT_FOUND
    Overloaded       full: every worker, or the router's queue    HTTP 429 + Retry-After
                                                                  / gRPC RESOURCE_EXHAUSTED
    Unavailable      not ready: starting, draining, no healthy    HTTP 503 / gRPC UNAVAILABLE
    (NotServing)     worker of a role (NotServing: the router itself)
    RequestTimeout   the request's deadline passed                HTTP 504 before the stream, an
                                                                  error event after / gRPC
                                                                  DEADLINE_EXCEEDED
    BackendError     a request failed after it was accepted       HTTP 500 / gRPC INTERNAL

A plain ValueError from a backend is its verdict on bad input (400 / INVALID_ARGUMENT).
Messages name the field and the limit; they never carry a stack trace or a file path.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input: maps to HTTP ``status`` (400 unless a size limit says 413 / 431) and gRPC
    INVALID_ARGUMENT. ``param`` names the offending field, ``code`` is OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class RefusedByBackend(InvalidRequest):
    """A backend's verdict on bad input that names the request field at fault (a structured-output
    constraint that does not compile on the worker): HTTP 400 / INVALID_ARGUMENT with that
    ``param``. Its Generation already counted the request (as a plain ValueError's does)."""


class ModelNotFound(InvalidRequest):
    """The request names a model this router does not serve: HTTP 404 with OpenAI's
    ``model_not_found`` (the official client raises ``openai.NotFoundError``), gRPC NOT_FOUND."""

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(f"model {requested!r} does not exist; this server serves {served!r}",
                         "model", "model_not_found", status=404)


class BackendError(RuntimeError):
    """A request failed after it was accepted (worker died, transfer failed)."""


class Overloaded(RuntimeError):
    """Full: every worker (or the router's own queue) is at its limit now. Maps to HTTP 429 /
    RESOURCE_EXHAUSTED with ``Retry-After: retry_after_s`` (an estimate, whole seconds >= 1).
    Expected pressure, not a failure: the client should come back later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Overloaded):
    """Not ready: the router is starting or draining, or no worker of a role is healthy. Maps
    to HTTP 503 / UNAVAILABLE (a subclass of Overloaded, so callers that only retry still do)."""


class NotServing(Unavailable):
    """The router itself is starting up or draining (HTTP 503 / UNAVAILABLE)."""


class RequestTimeout(BackendError):
    """The request's deadline (``timeout`` field, gRPC deadline) passed before it finished;
    everything it held in the cluster is being released."""
