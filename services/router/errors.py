"""The router's request-level exceptions and what each frontend answers for them.

    InvalidRequest   bad input, before any worker is touched     HTTP ``status`` (400, 413, 431)
                                                                  / gRPC INVALID_ARGUMENT
    RequestTimeout   the request's deadline passed                HTTP 504 before the stream, an
                                                                  error event after / gRPC
                                                                  DEADLINE_EXCEEDED
    backend.Overloaded / backend.Unavailable (full: 429 / RESOURCE_EXHAUSTED; not ready or no
    healthy worker: 503 / UNAVAILABLE) live next to the Backend interface that raises them.

Messages name the field and the limit; they never carry a stack trace or a file path.
"""

from __future__ import annotations

from services.router.backend import BackendError, Unavailable


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


class RequestTimeout(BackendError):
    """The request's deadline (``timeout`` field, gRPC deadline) passed before it finished;
    everything it held in the cluster is being released."""


class NotServing(Unavailable):
    """The router itself is starting up or draining (HTTP 503 / UNAVAILABLE)."""
