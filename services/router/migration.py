"""Migration: a sample whose worker died (or drained past its grace) goes on elsewhere, and the
client sees one unbroken stream.

    events = migrating(backend, request_id, prompt, params, index, first_attempt)

``first_attempt`` is the sample's usual pipeline (remote or local path). When it raises
``WorkerLost``:

* no token streamed yet (a prefill worker died before the first token): the sample starts
  over on the remote path, with a fresh request id (the dead attempt's reservation on a decode
  worker is left to its lease);
* tokens streamed: a decode worker prefills prompt + those tokens itself and continues
  (``DecodeService.Generate`` with ``resumed_output_token_ids``). The engine counts them as
  output, so max_tokens, penalties and a seeded generator (keyed by output position) go on
  exactly; greedy and seeded streams equal the unbroken run's. The frontend's detokenizer
  and stop strings never notice: the resumed events are plain continuation events.

At most ``max_migrations`` times per sample, then BackendError. Each migration's id is
``<request_id>~m<k>``. Errors that are the request's own fault (INVALID_ARGUMENT, a deadline)
never migrate: only the codes in ``LOST_CODES`` and a stream that ends without a finish reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2
from services.common.wire import finish_from_proto, logprobs_list_from_proto, params_to_proto
from services.router.backend import BackendError, TokenEvent
from services.router.deadline import remaining_s
from services.router.worker_pool import Worker

if TYPE_CHECKING:
    from services.router.disaggregated import DisaggregatedBackend

log = logging.getLogger(__name__)
DEFAULT_MAX_MIGRATIONS = 3
# A worker gone (UNAVAILABLE: connection refused / reset), or a stream the server cancelled
# (a drain past --drain-grace-s) or broke: the request itself is fine, another worker can go on.
# A decode worker whose prefill peer failed it (its KV never landed) says so in trailing metadata
# (FAILED_PEER_KEY = "prefill"), whatever the code.
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED)
_TRY_NEXT = (grpc.StatusCode.RESOURCE_EXHAUSTED, *LOST_CODES)


class WorkerLost(BackendError):
    """A worker stopped serving a request mid-stream; the request may go on elsewhere."""

    def __init__(self, worker: Worker, detail: str, is_peer_at_fault: bool = False) -> None:
        super().__init__(f"{worker.role} worker {worker.address} lost the request: {detail}")
        self.worker = worker
        self.is_peer_at_fault = is_peer_at_fault  # the worker is fine; its peer failed it


async def migrating(backend: DisaggregatedBackend, request_id: str, prompt: list[int],
                    params: SamplingParams, index: int,
                    first_attempt: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    """The sample's events, migrated on WorkerLost (module docstring). Closing this iterator
    closes the attempt in progress (which cancels its calls)."""
    streamed: list[int] = []
    source = first_attempt
    for num_migrations in range(backend.max_migrations + 1):
        try:
            async for event in source:
                streamed += event.token_ids
                yield event
            return
        except WorkerLost as exc:
            lost = exc
        finally:
            await source.aclose()
        if num_migrations == backend.max_migrations:
            break
        migration_id = f"{request_id}~m{num_migrations + 1}"
        log.warning("migrating %s after %d tokens as %s: %s", request_id, len(streamed),
                    migration_id, lost)
        backend.num_migrations += 1
        avoid = None if lost.is_peer_at_fault else lost.worker
        source = (resume(backend, migration_id, prompt, params, index, streamed, avoid)
                  if streamed else backend._remote(migration_id, prompt, params, index, None))
    raise BackendError(f"request {request_id!r} failed after {backend.max_migrations} "
                       f"migrations: {lost}") from lost


async def resume(backend: DisaggregatedBackend, request_id: str, prompt: list[int],
                 params: SamplingParams, index: int, streamed: list[int],
                 lost: Worker | None) -> AsyncIterator[TokenEvent]:
    """Continue a sample after ``streamed`` on a healthy decode worker (not ``lost``): each one
    that is full or unreachable before its first event is skipped. Raises Overloaded when
    none is left, WorkerLost when the new one fails mid-stream too."""
    request = worker_pb2.GenerateLocalRequest(
        request_id=request_id, prompt_token_ids=prompt, resumed_output_token_ids=streamed,
        sampling_params=params_to_proto(dataclasses.replace(params, prompt_logprobs=None)))
    excluded = {lost.address} if lost is not None and lost.role == "decode" else set()
    last_error: grpc.aio.AioRpcError | None = None
    for _ in range(len(backend.pool.workers["decode"])):
        decode = backend._pick("decode", prompt + streamed, excluded, last_error)
        excluded.add(decode.address)
        call = decode.decode.Generate(request, timeout=remaining_s(backend.decode_timeout_s))
        in_flight = decode.begin(prefill_tokens=len(prompt) + len(streamed))
        is_first, finished = True, False
        try:
            while not finished:
                try:
                    response = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.UNAVAILABLE:
                        decode.mark_unhealthy(exc.details())
                    if is_first and exc.code() in _TRY_NEXT:
                        last_error = exc
                        break
                    if exc.code() in LOST_CODES:
                        raise WorkerLost(decode, f"{exc.code().name}: {exc.details()}") from exc
                    raise BackendError(f"decode worker {decode.address} failed resuming "
                                       f"{request_id!r}: {exc.code().name}: {exc.details()}") from exc
                if response is grpc.aio.EOF:
                    raise WorkerLost(decode, "the stream ended without a finish reason")
                if is_first:
                    in_flight.end_prefill()
                    is_first = False
                finish = finish_from_proto(response.finish_reason)
                finished = finish is not None
                yield TokenEvent(
                    index=index, token_ids=list(response.token_ids),
                    logprobs=logprobs_list_from_proto(response.logprobs), finish_reason=finish,
                    stop_token_id=(response.stop_token_id if response.HasField("stop_token_id")
                                   else None))
            if finished:
                return
        finally:
            in_flight.end()
            if not finished and not call.done():
                call.cancel()
    backend._pick("decode", prompt, excluded, last_error)  # raises Overloaded: none left
    raise BackendError(f"no decode worker could resume {request_id!r}")  # unreachable
