"""The remote path: a prefill worker computes the first token and the KV, a decode worker
streams the rest::

    start_prefill picks (prefill P, decode D)  (prefill_start.py: retries, the KV-full wait)
    P.Prefill(decode=D) ──▶ reservation ──▶ first_token ──▶ TokenEvent (TTFT) ──┐
                              │ transfer progress … done (read in the background)   │
    D.Decode(first token, reservation) ◀──────────────────────────────────────────┘
        ──▶ TokenEvents until a finish reason (DecodeStream)

* The Decode call is a call on the router's DecodeMany stream to D (decode_mux.py): one
  message per batch of outputs of all its calls, not one per token per call; each call keeps
  its own deadline, cancellation and status.

* The first token ends the sample (EOS, stop token, max_tokens=1): no Decode call; the
  prefill worker gives the reservation back itself.
* Closing the iterator (stop string, client gone) cancels the Decode call. The prefill call is
  cancelled too while it computes; after the first token only pushes are left, so the router
  reads it to its end (for at most PUSHES_DRAIN_TIMEOUT_S, then cancels). Each worker frees what
  it holds. If the prefill call had finished (all KV pushed: its ``done`` progress event read,
  or its status OK) the prefill worker handed the reservation over, so the router sends
  ReleaseBlocks, for a Decode call that may never have reached the decode worker. (Cancelling
  it at that point left a window: the prefill worker had written ``done`` and handed over, the
  router had not read it and saw only its own CANCELLED, and nobody released the blocks until
  the lease ran out.)
* A failure of the prefill call while the decode stream runs ends the decode stream with it.
  Every call carries a deadline: the request's time left (services/router/deadline.py) when
  it has one, else the call's default.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc

from services.common.pb import worker_pb2
from services.common.wire import (
    finish_from_proto,
    logprobs_from_proto,
    logprobs_list_from_proto,
    ttft_stages_from_proto,
)
from services.router.backends.backend import TokenEvent
from services.router.backends.decode_mux import DecodeMuxes
from services.router.backends.decode_stream import DecodeStream
from services.router.backends.placement import Placement
from services.router.backends.prefill_start import KVFullWait, PrefillSettings, start_prefill
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import WorkerLost, worker_error
from services.router.deadline import remaining_s
from services.router.errors import BackendError
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_pool import InFlight, Worker

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not at import
    from engine.sampling.logprobs import PositionLogprobs

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 2.0
PUSHES_DRAIN_TIMEOUT_S = 10.0  # an abandoned sample's prefill call: its last pushes, then cancelled


class RemotePath:
    """See the module docstring. ``num_kv_full_waits`` counts the retries after every decode
    worker lacked free KV blocks."""

    def __init__(self, placement: Placement, prefill: PrefillSettings,
                 decode_timeout_s: float = 3600.0) -> None:
        self.placement = placement
        self.prefill_settings = prefill
        self.decode_timeout_s = decode_timeout_s
        self.num_kv_full_waits = 0
        self._background: set[asyncio.Future[Any]] = set()
        self.muxes = DecodeMuxes()  # Decode calls, many per stream (decode_mux.py)

    async def run(self, sample: Sample, plan: RoutePlan | None) -> AsyncGenerator[TokenEvent, None]:
        """The sample's events (module docstring); ``plan`` None: the load policy picks."""
        kv_wait = KVFullWait(remaining_s(self.prefill_settings.kv_full_wait_s), self._count_kv_wait)
        started = await start_prefill(sample, plan, self.placement, self.prefill_settings, kv_wait)
        prefill, decode, call = started.prefill, started.decode, started.call
        on_prefill, on_decode = started.on_prefill, started.on_decode
        reservation_id: str | None = None
        transfer = TransferSeen()
        prefill_rest: asyncio.Future[None] | None = None
        stream: DecodeStream | None = None
        finished = False
        try:
            response = started.first
            while response.WhichOneof("event") != "first_token":
                if response.WhichOneof("event") == "reservation":
                    reservation_id = response.reservation.reservation_id
                response = await _read(call, prefill)
                if response is grpc.aio.EOF:
                    raise WorkerLost(prefill, f"it ended {sample.request_id!r} without a first token")
            on_prefill.end_prefill()
            first = response.first_token
            yield _first_event(sample, first, plan)
            if finish_from_proto(first.finish_reason) is not None:
                finished = True
                return
            if reservation_id is None:
                raise BackendError(f"prefill worker {prefill.address} sent no reservation for "
                                   f"{sample.request_id!r}")
            prefill_rest = asyncio.ensure_future(_drain(call, prefill, transfer))
            stream = DecodeStream(self.muxes.start(decode, worker_pb2.DecodeRequest(
                request_id=sample.request_id, reservation_id=reservation_id,
                first_token_id=first.token_id), remaining_s(self.decode_timeout_s)),
                decode, sample, on_decode, alongside=prefill_rest)
            async for event in stream.events():
                yield event
        finally:
            finished = finished or (stream is not None and stream.is_finished)
            await self._settle(call, prefill, decode, (on_prefill, on_decode), stream,
                               prefill_rest, reservation_id, finished, transfer)

    async def _settle(self, call: grpc.aio.UnaryStreamCall, prefill: Worker,
                      decode: Worker, in_flight: tuple[InFlight, ...], stream: DecodeStream | None,
                      prefill_rest: asyncio.Future[None] | None, reservation_id: str | None,
                      finished: bool, transfer: TransferSeen) -> None:
        """After the sample ended (any way): free what it holds on both workers."""
        for share in in_flight:
            share.end()
        if stream is not None:
            await stream.close()
        if finished:
            if not call.done():
                # let the prefill worker finish its stream (dropping the call would cancel it)
                self._spawn(prefill_rest if prefill_rest is not None else _drain(call, prefill))
        elif prefill_rest is not None:  # computed: let its pushes end (module docstring)
            assert reservation_id is not None  # prefill_rest starts once a reservation was read
            self._spawn(prefill_rest)  # owned: close() cancels it, _forget reads its error
            self._spawn(_drain_then_release(call, prefill_rest, decode, reservation_id, transfer))
        else:
            if not call.done():
                call.cancel()
            if reservation_id is not None:
                self._spawn(_release_after(call, decode, reservation_id, transfer))

    def _count_kv_wait(self) -> None:
        self.num_kv_full_waits += 1

    def _spawn(self, work: asyncio.Future[Any] | Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("background call ended with %r", task.exception())

    async def close(self) -> None:
        """Cancel the background calls (prefill streams draining, releases) and the Decode
        streams."""
        for task in list(self._background):
            task.cancel()
        await self.muxes.close()


def _first_event(sample: Sample, first: worker_pb2.FirstToken, plan: RoutePlan | None) -> TokenEvent:
    return TokenEvent(
        index=sample.index, token_ids=[first.token_id],
        # cast: a generated token's logprobs always carry it (sampled), so the entry is not None
        logprobs=([cast("PositionLogprobs", logprobs_from_proto(first.logprobs))]
                  if first.HasField("logprobs") else None),
        prompt_logprobs=logprobs_list_from_proto(first.prompt_logprobs) if sample.index == 0 else None,
        finish_reason=finish_from_proto(first.finish_reason),
        stop_token_id=first.stop_token_id if first.HasField("stop_token_id") else None,
        num_prompt_tokens=len(sample.prompt), num_cached_tokens=first.num_cached_prompt_tokens,
        route=plan.key if plan is not None else "remote/load",
        ttft_stages=ttft_stages_from_proto(first.stages))


async def _read(call: grpc.aio.UnaryStreamCall, worker: Worker) -> Any:
    try:
        return await call.read()
    except grpc.aio.AioRpcError as exc:
        raise worker_error(worker, exc, is_started=True) from exc


@dataclass
class TransferSeen:
    """Whether the router read the prefill worker's ``done`` progress event: every push landed."""

    done: bool = False


async def _drain(call: grpc.aio.UnaryStreamCall, worker: Worker, transfer: TransferSeen | None = None) -> None:
    """Read the rest of a Prefill stream (transfer progress) until it ends OK."""
    while (response := await _read(call, worker)) is not grpc.aio.EOF:
        if transfer is not None and response.WhichOneof("event") == "transfer" and response.transfer.done:
            transfer.done = True


async def _release_after(call: grpc.aio.UnaryStreamCall, decode: Worker, reservation_id: str,
                         transfer: TransferSeen) -> None:
    """After an early exit: if the Prefill call had finished (its ``done`` event read, or its
    status OK), the prefill worker handed the reservation over, and only a Decode call would free
    it: release it here (a claimed one the decode worker leaves to its Decode call). Had it not
    finished, the prefill worker releases it once its pushes have settled."""
    try:
        code = grpc.StatusCode.OK if transfer.done else await asyncio.wait_for(call.code(), RELEASE_TIMEOUT_S)
        if code is grpc.StatusCode.OK:
            await decode.decode.ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(reservation_id=reservation_id), timeout=RELEASE_TIMEOUT_S)
    except (TimeoutError, grpc.aio.AioRpcError) as exc:
        log.info("releasing reservation %s on %s: %r", reservation_id, decode.address, exc)


async def _drain_then_release(call: grpc.aio.UnaryStreamCall, rest: asyncio.Future[None], decode: Worker,
                              reservation_id: str, transfer: TransferSeen,
                              timeout_s: float = PUSHES_DRAIN_TIMEOUT_S) -> None:
    """An abandoned sample whose prompt was computed: read the prefill stream (``rest``) to its
    end, cancelling it after ``timeout_s``; then release the reservation as ``_release_after``
    says (the stream's failure is the prefill worker's to clean up, not this task's)."""
    await asyncio.wait({rest}, timeout=timeout_s)
    if not rest.done():
        rest.cancel()
        call.cancel()
    await _release_after(call, decode, reservation_id, transfer)
