"""DecodeService: reserve blocks for a prompt's KV, wait for it to land, stream the rest.

    ReserveBlocks     core.reserve_remote -> block ids + lease (RESOURCE_EXHAUSTED when full);
                      the leading num_cached_blocks come from this worker's prefix cache and
                      are not written: the prefill worker sends only the rest (delta transfer)
    RenewReservation  the prefill job is still at work: hold the blocks one lease longer
    Decode            claim the reservation, wait (until its lease runs out) for every block
                      to land, then finish_remote_kv(first token) and stream tokens until the
                      request finishes
    DecodeMany        many Decode and Generate calls on one stream, their outputs batched
                      per message (``decode_many.py``: what a router uses)
    ReleaseBlocks     give a reservation back (prefill failed or was cancelled)
    Generate          a whole request here, prefill included (conditional disaggregation: the
                      router's choice when the uncached part of the prompt is short); the
                      stream starts with the first token (``generate_local.py``)

Who frees a reservation's blocks: the engine, once the Decode call handed the request over
(a client cancel aborts it); before that ReleaseBlocks, the lease, or — for a Decode call that
ended while KV was still arriving — the end of the writes (see reservations.py). A
ReserveBlocks call whose caller gives up while the engine reserves still gets its blocks
freed: the reservation is undone once the engine made it; and one whose caller's ReleaseBlocks
(naming its attempt_id) was served first is refused (reservations.EarlyReleases).
Decode writes with ``context.write`` from a coroutine (not an async generator), so a cancel
runs its ``finally`` at once rather than when the generator is garbage collected.
Landing is detected here, on the event loop, by draining every receiver's notifications
(NIXL and gRPC) every 2 ms while some reservation still waits for KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from engine.config import Role
from engine.kv_transfer.base import KVReceiver
from engine.mathutils import cdiv
from engine.stats import RemoteReservation
from services.common.async_engine import EngineDead
from services.common.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.common.grpc_server import AddServicer
from services.common.pb import kv_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.wire import (
    DECODE_SERVICE_NAME,
    KV_SERVICE_NAME,
    params_from_proto,
)
from services.decode.decode_many import serve_decode_many
from services.decode.generate_local import generate_local
from services.decode.kv_grpc_receiver import GrpcKVReceiver
from services.decode.kv_guard import GuardedKVTransferServicer
from services.decode.output_stream import OutputStream, Writer
from services.decode.receivers import make_receivers
from services.decode.reservations import EarlyReleases, LeaseState, Reservation, ReservationTable
from services.worker.admission import QueueLimit
from services.worker.request_params import invalid_argument
from services.worker.server import RoleHandler, WorkerRuntime
from services.worker.stats import PrefixCounters, TransferCounters

if TYPE_CHECKING:
    from engine.scheduler.output import RequestOutput

log = logging.getLogger(__name__)
PUSH_DRAIN_TIMEOUT_S = 10.0  # a release waits this long for gRPC pushes in progress
# notification polling while KV is expected; at rest, housekeeping sleeps until a reservation is
# made or a lease can run out, waking at least every MAX_IDLE_S (it polled every 20 ms: ~1.3% of
# a core for an idle decode worker)
BUSY_POLL_S, MAX_IDLE_S = 0.002, 1.0


class DecodeWorker(RoleHandler, worker_pb2_grpc.DecodeServiceServicer):
    service_names = (DECODE_SERVICE_NAME, KV_SERVICE_NAME)

    def __init__(self, runtime: WorkerRuntime) -> None:
        if runtime.role is not Role.DECODE:
            raise ValueError(f"DecodeWorker needs an engine in the decode role, got {runtime.role}")
        self.runtime = runtime
        self.engine = runtime.engine
        if runtime.args.reservation_lease_ms <= 0:
            raise ValueError(f"--reservation-lease-ms must be positive, got "
                             f"{runtime.args.reservation_lease_ms}")
        self.lease_s = runtime.args.reservation_lease_ms / 1000
        self.reservations = ReservationTable(self.lease_s)
        self.queue_limit = QueueLimit.from_args(runtime.engine, runtime.args, runtime.worker_id)
        self.transfer_counters = TransferCounters()
        self.prefix_counters = PrefixCounters()
        self.receivers: tuple[KVReceiver, ...] = ()
        self._housekeeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # ReserveBlocks calls in the engine now -> whether a ReleaseBlocks came for them meanwhile
        self._reserving: dict[str, bool] = {}
        self._early_releases = EarlyReleases()  # ReleaseBlocks that came before their ReserveBlocks

    async def start(self) -> list[AddServicer]:
        self.receivers = make_receivers(self.runtime.args.transfer, self.runtime.model_name,
                                        self.engine.kv_cache,
                                        self.runtime.args.kv_shared_memory == "auto")
        grpc_receiver = next(r for r in self.receivers if isinstance(r, GrpcKVReceiver))
        kv_servicer = GuardedKVTransferServicer(grpc_receiver, self.receivers[-1], self.reservations)
        self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep())
        return [(worker_pb2_grpc.add_DecodeServiceServicer_to_server, self),
                (kv_pb2_grpc.add_KVTransferServiceServicer_to_server, kv_servicer)]

    async def close(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
        for receiver in self.receivers:
            receiver.close()

    # ---- RPCs ------------------------------------------------------------------------

    async def ReserveBlocks(self, request: worker_pb2.ReserveBlocksRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.ReserveBlocksResponse:
        reservation_id = request.request_id
        prompt = list(request.prompt_token_ids)
        if not reservation_id:
            raise InvalidArgument("ReserveBlocks: request_id is empty")
        if request.attempt_id and self._early_releases.take(request.attempt_id):
            log.info("reservation %s: released before its ReserveBlocks call was served; refused",
                     reservation_id)
            await context.abort(grpc.StatusCode.CANCELLED, f"ReserveBlocks: {reservation_id!r} "
                                f"(attempt {request.attempt_id!r}) was released before it was served")
        if reservation_id in self.reservations:
            raise AlreadyExists(f"ReserveBlocks: {reservation_id!r} is already reserved")
        pending = self.queue_limit.admit("ReserveBlocks")
        # From here until the engine answered, a ReleaseBlocks for it is recorded here (with no
        # await before this line, EarlyReleases covers the time before).
        self._reserving[reservation_id] = False
        reserving: asyncio.Future[RemoteReservation | None] | None = None
        try:
            try:
                params = params_from_proto(request.sampling_params)  # bad words come tokenized
                self.engine.prefetch_prefix(prompt, params)  # the kvstore answers while we wait
                await self.engine.compile_constraint(params)  # off the engine loop, before reserving
                reserving = asyncio.ensure_future(
                    self.engine.call(lambda c: c.reserve_remote(reservation_id, prompt, params)))
                reserved = await asyncio.shield(reserving)
            except asyncio.CancelledError:  # the caller gave up (deadline, cancel): undo
                if reserving is not None:
                    self._spawn(self._undo_reserve(reserving, reservation_id))
                raise
            finally:
                released_meanwhile = self._reserving.pop(reservation_id, False)
            if released_meanwhile:  # the caller gave up and said so before its cancel got here
                assert reserving is not None  # it answered: reserved is set
                self._spawn(self._undo_reserve(reserving, reservation_id))
                await context.abort(grpc.StatusCode.CANCELLED,
                                    f"ReserveBlocks: {reservation_id!r} was released while reserving")
        except ValueError as exc:
            raise invalid_argument("ReserveBlocks", exc) from exc
        except EngineDead as exc:
            raise Unavailable(str(exc)) from exc
        finally:
            pending.done()
        if reserved is None:
            block_size = self.engine.config.cache.block_size
            raise ResourceExhausted(
                f"decode worker {self.runtime.worker_id} has {self.engine.stats().num_free_blocks} free "
                f"KV blocks; a {len(prompt)}-token prompt needs {cdiv(len(prompt), block_size)}",
                kv_full=True)
        self.transfer_counters.num_blocks_skipped_cached += reserved.num_cached_blocks
        self.prefix_counters.add(len(prompt),
                                 reserved.num_cached_blocks * self.engine.config.cache.block_size)
        # Only the blocks after the cached prefix are written (and awaited); the cached ones
        # are shared with the prefix cache, so no push may touch them.
        self.reservations.add(reservation_id, prompt, params,
                              reserved.block_ids[reserved.num_cached_blocks:],
                              reserved.num_cached_blocks)
        return worker_pb2.ReserveBlocksResponse(reservation=worker_pb2.BlockReservation(
            reservation_id=reservation_id, decode_worker_id=self.runtime.worker_id,
            block_ids=reserved.block_ids, num_cached_blocks=reserved.num_cached_blocks,
            lease_ms=int(self.lease_s * 1000)))

    async def ReleaseBlocks(self, request: worker_pb2.ReleaseBlocksRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseBlocksResponse:
        reservation = self.reservations.get(request.reservation_id)
        if request.reservation_id in self._reserving:  # undone when the engine has reserved
            self._reserving[request.reservation_id] = True
        elif reservation is None and request.attempt_id:  # its ReserveBlocks may not have started
            self._early_releases.note(request.attempt_id)
        if reservation is None or reservation.state is LeaseState.RELEASED:
            return worker_pb2.ReleaseBlocksResponse(num_blocks_freed=0)
        was_claimed = reservation.state is LeaseState.CLAIMED
        self.reservations.mark_released(request.reservation_id)
        if not was_claimed:  # a claimed one is freed by the Decode call that waits on it
            await asyncio.shield(self._free(reservation))
        return worker_pb2.ReleaseBlocksResponse(
            num_blocks_freed=reservation.num_cached_blocks + len(reservation.block_ids))

    async def RenewReservation(self, request: worker_pb2.RenewReservationRequest,
                               context: grpc.aio.ServicerContext) -> worker_pb2.RenewReservationResponse:
        if not request.reservation_id:
            raise InvalidArgument("RenewReservation: reservation_id is empty")
        if self.reservations.renew(request.reservation_id) is None:
            raise NotFound(f"RenewReservation: no live reservation {request.reservation_id!r} "
                           f"on {self.runtime.worker_id} (never made, lease of "
                           f"{self.lease_s:g} s ran out, released, or its KV already "
                           "landed and decoding started)")
        return worker_pb2.RenewReservationResponse(lease_ms=int(self.lease_s * 1000))

    async def Generate(self, request: worker_pb2.GenerateLocalRequest,
                       context: grpc.aio.ServicerContext) -> None:
        await self.generate(request, context)

    async def generate(self, request: worker_pb2.GenerateLocalRequest, context: Writer) -> None:
        """One Generate call, its responses written to ``context`` (a call's, or a DecodeMany
        stream's: decode_many.py)."""
        pending = self.queue_limit.admit("Generate")
        try:
            await generate_local(self.engine, self.prefix_counters, request, context, pending.done)
        finally:
            pending.done()

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> None:
        await self.decode(request, context)

    async def DecodeMany(self, requests: AsyncIterator[worker_pb2.DecodeManyRequest],
                         context: grpc.aio.ServicerContext) -> None:
        await serve_decode_many(requests, context, self.decode, self.generate)

    async def decode(self, request: worker_pb2.DecodeRequest, context: Writer) -> None:
        """One Decode call, its responses written to ``context`` (a call's, or a DecodeMany
        stream's outbox); raises ServiceErrors."""
        try:
            reservation = self.reservations.claim(request.reservation_id)
        except KeyError:
            raise NotFound(f"Decode: no reservation {request.reservation_id!r} on "
                           f"{self.runtime.worker_id} (never made, lease expired after "
                           f"{self.lease_s:g} s, released, or already claimed)") from None
        request_id = reservation.reservation_id
        handed_over = False
        stream: OutputStream | None = None
        timer = self.runtime.metrics.request()
        try:
            vocab_size = self.engine.config.model.vocab_size
            first_token = request.first_token_id
            if first_token >= vocab_size:
                raise InvalidArgument(
                    f"Decode: first_token_id must be in [0, {vocab_size}), got {first_token}")
            claimed_at = time.monotonic()
            await self._wait_landed(reservation)
            log.debug("request %s: KV landed %.3f s after the Decode call arrived", request_id,
                      time.monotonic() - claimed_at)
            self.reservations.pop(request_id)  # consumed: the engine request owns the blocks now
            handed_over = True
            queue = self.engine.subscribe(request_id)
            await self.engine.call(lambda core: core.finish_remote_kv(request_id, first_token))
            timer.on_scheduled()
            stream = OutputStream(self.engine, request_id, queue, num_streamed=1)  # the first token: prefill's

            def on_output(output: RequestOutput, _: worker_pb2.DecodeResponse) -> None:
                timer.on_output(len(output.new_token_ids))
                if output.finished:
                    timer.on_finished(output.finish_reason)

            await stream.write_all(context, on_output)
        except EngineDead as exc:
            raise Unavailable(str(exc)) from exc
        finally:
            self.engine.unsubscribe(request_id)
            if handed_over and (stream is None or not stream.finished):
                await asyncio.shield(self._abort(request_id))
            elif not handed_over:
                self._give_up(reservation)

    # ---- helpers ---------------------------------------------------------------------

    async def _wait_landed(self, reservation: Reservation) -> None:
        """Until every reserved block has landed; raises Aborted on release, DeadlineExceeded
        when the lease (renewed by the prefill worker while it works) runs out; both name the
        prefill side as the failed peer, so the router migrates the request."""
        while True:
            reservation.changed.clear()
            if reservation.state is LeaseState.RELEASED:
                raise Aborted(f"Decode: reservation {reservation.reservation_id!r} was released "
                              "(the prefill side failed or was cancelled)", failed_peer="prefill")
            if reservation.is_landed:
                return
            remaining = reservation.expires_at - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"Decode: KV of {reservation.reservation_id!r} did not land before its lease "
                    f"ran out ({self.lease_s:g} s after the claim or the prefill worker's last "
                    f"renewal; {len(reservation.landed_block_ids)} of "
                    f"{len(reservation.block_ids)} blocks)", failed_peer="prefill")
            try:  # not wait_for: on 3.11 it drops a cancel that lands as the KV lands
                async with asyncio.timeout(remaining):
                    await reservation.changed.wait()
            except TimeoutError:
                pass

    def _give_up(self, reservation: Reservation) -> None:
        """A Decode call ends before handing its reservation to the engine: free the blocks
        now if no write can still arrive, else leave them ABANDONED (reservations.py)."""
        if reservation.state is LeaseState.RELEASED or reservation.is_landed:
            self.reservations.mark_released(reservation.reservation_id)
            self._spawn(self._free(reservation))
        else:
            self.reservations.abandon(reservation.reservation_id)

    async def _free(self, reservation: Reservation) -> None:
        """Wait for gRPC pushes into it to end (bounded), then free its blocks in the engine."""
        deadline = time.monotonic() + PUSH_DRAIN_TIMEOUT_S
        while reservation.num_active_pushes > 0 and time.monotonic() < deadline:
            reservation.changed.clear()
            try:
                await asyncio.wait_for(reservation.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        try:
            await self._abort(reservation.reservation_id)
        finally:
            self.reservations.pop(reservation.reservation_id)

    async def _undo_reserve(self, reserving: asyncio.Future[RemoteReservation | None],
                            request_id: str) -> None:
        """A ReserveBlocks caller left while the engine reserved: free what it reserved."""
        try:
            reserved = await reserving
        except (ValueError, EngineDead):
            return
        if reserved is not None:
            log.info("reservation %s: its ReserveBlocks call was cancelled; freeing %d blocks",
                     request_id, len(reserved.block_ids))
            await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.call(lambda core: core.abort_request(request_id))
        except EngineDead:
            pass

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _housekeep(self) -> None:
        """Count landed blocks; release reservations whose lease ran out."""
        while True:
            for receiver in self.receivers:
                try:
                    notes = receiver.completed_requests()
                except Exception:  # noqa: BLE001 - a broken transport must not stop the others
                    log.exception("draining KV notifications failed")
                    continue
                for note in notes:
                    landed = self.reservations.on_landed(note)
                    if landed is not None and landed.state is LeaseState.ABANDONED:
                        self.reservations.mark_released(landed.reservation_id)
                        self._spawn(self._free(landed))
            for reservation in self.reservations.expired():
                log.warning("reservation %s: lease of %g s ran out (%s); releasing %d blocks",
                            reservation.reservation_id, self.lease_s, reservation.state.value,
                            len(reservation.block_ids))
                self.reservations.mark_released(reservation.reservation_id)
                self._spawn(self._free(reservation))
            delay = self.reservations.poll_delay(BUSY_POLL_S, MAX_IDLE_S)
            if delay <= BUSY_POLL_S:
                await asyncio.sleep(delay)
            else:
                self.reservations.added.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.reservations.added.wait(), delay)
