"""Migration: a sample whose worker died (or drained past its grace) goes on elsewhere, and the
client sees one unbroken stream.

    events = migration.run(sample, first_attempt)

``first_attempt`` is the sample's usual path (remote or local). When it raises ``WorkerLost``:

* no token streamed yet (a prefill worker died before the first token): the sample starts
  over on the remote path, with a fresh request id (the dead attempt's reservation on a decode
  worker is left to its lease);
* tokens streamed: a decode worker prefills prompt + those tokens itself and continues
  (a Generate call with ``resumed_output_token_ids``, on the router's DecodeMany stream to that
  worker). The engine counts them as output, so max_tokens, penalties and a seeded generator
  (keyed by output position) go on exactly; greedy and seeded streams equal the unbroken run's.
  The pipeline's detokenizer and stop strings never notice: the resumed events are plain
  continuation events.

At most ``max_migrations`` times per sample, then BackendError. Each migration's id is
``<request_id>~m<k>``. Errors that are the request's own fault (INVALID_ARGUMENT, a deadline)
never migrate: only the codes in ``worker_errors.LOST_CODES`` and a stream that ends without a
finish reason.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import grpc

from services.common.pb import worker_pb2
from services.router.backends.backend import TokenEvent
from services.router.backends.decode_stream import DecodeStream
from services.router.backends.placement import Placement
from services.router.backends.remote_path import RemotePath
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import (
    LOST_CODES,
    WorkerLost,
    mark_if_unavailable,
    worker_error,
)
from services.router.deadline import remaining_s
from services.router.errors import BackendError
from services.router.routing.worker_pool import Worker

log = logging.getLogger(__name__)
DEFAULT_MAX_MIGRATIONS = 3
# Before a resumed stream's first event: the next decode worker may take it.
_TRY_NEXT = (grpc.StatusCode.RESOURCE_EXHAUSTED, *LOST_CODES)


class Migration:
    """See the module docstring. ``num_migrations`` counts the samples moved since start."""

    def __init__(self, remote: RemotePath, placement: Placement,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, decode_timeout_s: float = 3600.0) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self.remote = remote
        self.placement = placement
        self.max_migrations = max_migrations
        self.decode_timeout_s = decode_timeout_s
        self.num_migrations = 0

    async def run(self, sample: Sample, first_attempt: AsyncGenerator[TokenEvent, None]
                  ) -> AsyncGenerator[TokenEvent, None]:
        """The sample's events, migrated on WorkerLost (module docstring). Closing this iterator
        closes the attempt in progress (which cancels its calls)."""
        streamed: list[int] = []
        source = first_attempt
        for num_migrations in range(self.max_migrations + 1):
            try:
                async for event in source:
                    streamed += event.token_ids
                    yield event
                return
            except WorkerLost as exc:
                lost = exc
            finally:
                await source.aclose()
            if num_migrations == self.max_migrations:
                break
            attempt = sample.renamed(f"{sample.request_id}~m{num_migrations + 1}")
            log.warning("migrating %s after %d tokens as %s: %s", sample.request_id, len(streamed),
                        attempt.request_id, lost)
            self.num_migrations += 1
            avoid = None if lost.is_peer_at_fault else lost.worker
            source = self.resume(attempt, streamed, avoid) if streamed else self.remote.run(attempt, None)
        raise BackendError(f"request {sample.request_id!r} failed after {self.max_migrations} "
                           f"migrations: {lost}") from lost

    async def resume(self, sample: Sample, streamed: list[int],
                     lost: Worker | None) -> AsyncGenerator[TokenEvent, None]:
        """Continue ``sample`` after ``streamed`` on a healthy decode worker (not ``lost``): each
        one that is full or unreachable before its first event is skipped. Raises Overloaded
        when none is left, WorkerLost when the new one fails mid-stream too."""
        request = worker_pb2.GenerateLocalRequest(
            request_id=sample.request_id, prompt_token_ids=sample.prompt,
            resumed_output_token_ids=streamed, sampling_params=sample.resumed_wire_params())
        excluded = {lost.address} if lost is not None and lost.role == "decode" else set()
        last_error: grpc.aio.AioRpcError | None = None
        prompt = sample.prompt + streamed
        for _ in range(len(self.placement.pool.workers["decode"])):
            decode = self.placement.pick("decode", prompt, excluded, last_error)
            excluded.add(decode.address)
            in_flight = decode.begin(prefill_tokens=len(prompt))  # before the worker sees it
            call = self.remote.muxes.start(decode, request, remaining_s(self.decode_timeout_s))
            stream = DecodeStream(call, decode, sample, in_flight)
            try:
                try:
                    await stream.open()
                except grpc.aio.AioRpcError as exc:
                    mark_if_unavailable(decode, exc)
                    if exc.code() not in _TRY_NEXT:
                        raise worker_error(decode, exc, is_started=True) from exc
                    last_error = exc
                    continue
                async for event in stream.events():
                    yield event
                return
            finally:
                await stream.close()
        self.placement.pick("decode", sample.prompt, excluded, last_error)  # raises: none left
        raise BackendError(f"no decode worker could resume {sample.request_id!r}")  # unreachable
