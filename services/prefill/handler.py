"""PrefillService.Prefill: reserve on the decode worker, compute the prompt, push its KV.

One call, as the router sees it (a server stream)::

    reservation   blocks held on the decode worker (skipped when max_tokens == 1)
    transfer*     progress while chunks compute and after (cumulative, confirmed blocks)
    first_token   as soon as it is sampled: the router streams it at once (TTFT)
    transfer      ... the last one has done = true; the call then ends OK

Steps: ReserveBlocks on the target (deadline; RESOURCE_EXHAUSTED passes through) -> renew its
lease every lease / 3 from now until the call ends (lease.py: a slow prefill is not a
failure) -> add the request (PREFILL role: it stops after its first token and its blocks are
*held*) -> after every engine step push the blocks that became final -> first token -> push
the partial last block -> wait for every push -> release the held blocks (they stay in the
prefix cache).

Failure (client cancel, push failed, reservation lost or not renewable in time, engine
error): in-flight pushes are waited for (bounded) while the lease is still renewed, the
request is aborted or its held blocks released, then renewal stops and the decode worker is
told to ReleaseBlocks — in that order, so no write lands in released blocks. Every block the
call holds is freed on both workers, whatever the request's state in the engine (queued,
running, preempted, held, or still being added when the call was cancelled). Errors that
concern the decode worker carry trailing metadata ``pdserve-failed-peer: decode`` so the
router can pick another one (``failed_peer``; the errors are services/common/errors.py's, sent
as soon as they are raised, before the cleanup: ``grpc_errors.status_first``).

Prefill writes with ``context.write`` from a coroutine (not an async generator), so a cancel
runs its cleanup at once rather than when the generator is garbage collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import NoReturn

import grpc

from engine.config import Role
from engine.kv_transfer.base import KVTransferError
from engine.sampling_params import SamplingParams
from engine.scheduler.output import RequestOutput
from engine.structured.compiler import DEFAULT_TIMEOUT_S as COMPILE_TIMEOUT_S
from services.common.async_engine import EngineDead, OutputQueue
from services.common.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Unavailable,
)
from services.common.faults import faults
from services.common.grpc_errors import service_error_of, status_first
from services.common.grpc_server import AddServicer
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import (
    METHOD_NAMES,
    PREFILL_SERVICE_NAME,
    finish_to_proto,
    logprobs_list_to_proto,
    logprobs_to_proto,
    transfer_methods,
    ttft_stages_to_proto,
)
from services.prefill.decode_peers import DecodePeer, DecodePeers
from services.prefill.lease import LeaseKeeper, LeaseLost
from services.prefill.pusher import KVPusher, sender_factories
from services.prefill.transfer import RequestTransfer, TransferFailed
from services.prefill.ttft_clock import TtftClock
from services.worker.admission import Pending, QueueLimit
from services.worker.request_params import compile_constraint, invalid_argument, one_sample_params
from services.worker.server import RoleHandler, WorkerRuntime
from services.worker.stats import PrefixCounters, TransferCounters

log = logging.getLogger(__name__)
RESERVE_TIMEOUT_S = 5.0  # plus, for a constrained request, the decode worker's compile limit
RELEASE_TIMEOUT_S = 2.0
SETTLE_TIMEOUT_S = 10.0


class PrefillWorker(RoleHandler, worker_pb2_grpc.PrefillServiceServicer):
    service_names = (PREFILL_SERVICE_NAME,)

    def __init__(self, runtime: WorkerRuntime) -> None:
        if runtime.role is not Role.PREFILL:
            raise ValueError(f"PrefillWorker needs an engine in the prefill role, got {runtime.role}")
        self.runtime = runtime
        self.engine = runtime.engine
        self.pushers: dict[int, KVPusher] = {}
        self.peers = DecodePeers()
        self.default_method = transfer_methods(runtime.args.transfer)[0]
        self.transfer_counters = TransferCounters()
        self.prefix_counters = PrefixCounters()
        kv_cache = runtime.engine.kv_cache
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.queue_limit = QueueLimit.from_args(runtime.engine, runtime.args, runtime.worker_id)

    async def start(self) -> list[AddServicer]:
        kv_cache = self.runtime.engine.kv_cache
        shared_memory = self.runtime.args.kv_shared_memory == "auto"
        for method, factory in sender_factories(self.runtime.args.transfer, self.runtime.model_name,
                                                shared_memory).items():
            self.pushers[method] = await KVPusher.create(factory, kv_cache)
        return [(worker_pb2_grpc.add_PrefillServiceServicer_to_server, self)]

    async def close(self) -> None:
        for pusher in self.pushers.values():
            await pusher.close()
        await self.peers.close()

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> None:
        job = pending = None
        try:
            async with status_first(context):  # the router may retry while cleanup runs
                pending = self.queue_limit.admit("Prefill", failed_peer="prefill")
                job = _PrefillJob(self, request, pending)
                async with contextlib.aclosing(job.run()) as responses:
                    async for response in responses:
                        await context.write(response)
        finally:
            if pending is not None:
                pending.done()
            if job is not None:
                await asyncio.shield(job.cleanup())


class _PrefillJob:
    """The state of one Prefill call; ``cleanup`` undoes whatever ``run`` got to."""

    def __init__(self, worker: PrefillWorker, request: worker_pb2.PrefillRequest,
                 pending: Pending | None = None) -> None:
        self.worker = worker
        self.pending = pending  # the worker's queue place until the engine took the request
        self.engine = worker.engine
        self.request_id = request.request_id
        self.prompt = list(request.prompt_token_ids)
        self.target = request.decode
        self.proto_params = request.sampling_params
        if not self.request_id:
            raise InvalidArgument("Prefill: request_id is empty")
        self.params: SamplingParams = one_sample_params(request.sampling_params, "Prefill")
        self.method = request.transfer_method or worker.default_method
        if self.method not in worker.pushers:
            raise FailedPrecondition(
                f"Prefill: transfer method {METHOD_NAMES.get(self.method, self.method)} is not "
                f"enabled on {worker.runtime.worker_id} (started with --transfer "
                f"{worker.runtime.args.transfer})")
        self.peer: DecodePeer | None = None
        self.reservation: worker_pb2.BlockReservation | None = None
        self.reserve_unanswered = False  # ReserveBlocks cancelled or timed out: it may have reserved
        self.attempt_id = uuid.uuid4().hex  # names this call's ReserveBlocks in its ReleaseBlocks
        self.lease: LeaseKeeper | None = None
        self.transfer: RequestTransfer | None = None
        # add_request as queued on the engine thread: it is applied even if this call is
        # cancelled while waiting for it, so cleanup waits for it before dropping the request.
        self.adding: asyncio.Future[list[str]] | None = None
        self.subscribed = self.handed_off = False
        self.ends_request = False  # the first token finished the request (stop or length)
        self.transfer_started_at: float | None = None  # the first chunk push (transfer metrics)
        self.timer = worker.runtime.metrics.request()
        self.ttft = TtftClock()

    async def run(self) -> AsyncGenerator[worker_pb2.PrefillResponse, None]:
        """The call's responses, in the order of the module docstring."""
        # the kvstore's answer for this prompt comes while the decode worker reserves
        self.engine.prefetch_prefix(self.prompt, self.params)
        await compile_constraint(self.engine, self.params, "Prefill")  # before the decode worker reserves
        if self.params.max_tokens != 1:  # 1: the first token ends the request, no decode worker
            reservation = await self._reserve()
            self.ttft.on_reserved()
            yield worker_pb2.PrefillResponse(request_id=self.request_id, reservation=reservation)
        queue = await self._add_request()
        async for response in self._compute(queue):
            yield response
        async for response in self._hand_off():
            yield response

    async def _add_request(self) -> OutputQueue:
        """Subscribe to the request's outputs and add it to the engine; its output queue."""
        self.ttft.on_queued()
        try:
            queue = self.engine.subscribe(self.request_id)
        except ValueError as exc:
            raise AlreadyExists(f"Prefill: {exc}") from exc
        self.subscribed = True
        self.adding = asyncio.ensure_future(self.engine.call(
            lambda core: core.add_request(self.request_id, self.prompt, self.params)))
        try:
            await asyncio.shield(self.adding)
        except ValueError as exc:
            raise invalid_argument("Prefill", exc) from exc
        finally:
            if self.pending is not None:
                self.pending.done()
        self.timer.on_scheduled()
        self.ttft.on_taken()
        return queue

    async def _compute(self, queue: OutputQueue) -> AsyncIterator[worker_pb2.PrefillResponse]:
        """Until the engine finishes the request: the first token, and the progress of the
        blocks pushed after each step."""
        while True:
            output = await self._next_output(queue)
            self.timer.on_output(len(output.new_token_ids))
            if output.finish_reason in ("abort", "error"):
                raise Internal(f"Prefill: the engine ended the request ({output.finish_reason}"
                               f"{': ' + output.error if output.error else ''})")
            if output.new_token_ids:
                yield self._first_token(output)
            if self.transfer is not None and not self.ends_request:
                if await self._push_timed(self.transfer, output.num_computed_tokens):
                    yield self._progress()
            if output.finished:
                break
        self.timer.on_finished("prefilled" if not self.ends_request else output.finish_reason,
                               len(self.prompt))

    def _first_token(self, output: RequestOutput) -> worker_pb2.PrefillResponse:
        """The FirstToken response of the output that carries it, with the TTFT stages."""
        self.ends_request = output.finish_reason in ("stop", "length")
        reason = output.finish_reason if self.ends_request else None
        first = worker_pb2.FirstToken(
            token_id=output.new_token_ids[0], finish_reason=finish_to_proto(reason),
            num_cached_prompt_tokens=output.num_cached_tokens,
            prompt_logprobs=logprobs_list_to_proto(output.prompt_logprobs))
        if output.new_logprobs:
            first.logprobs.CopyFrom(logprobs_to_proto(output.new_logprobs[0]))
        if isinstance(output.stop_reason, int):
            first.stop_token_id = output.stop_reason
        first.stages.CopyFrom(ttft_stages_to_proto(self.ttft.on_first_token(self.transfer is not None)))
        self.worker.prefix_counters.add(len(self.prompt), output.num_cached_tokens)
        faults().before_first_token()  # PDSERVE_FAULTS only
        return worker_pb2.PrefillResponse(request_id=self.request_id, first_token=first)

    async def _push_timed(self, transfer: RequestTransfer, num_computed_tokens: int) -> bool:
        """``_push``, timing it as the transfer's share of TTFT until the first token."""
        push_started = time.monotonic()
        if self.transfer_started_at is None:
            self.transfer_started_at = push_started
        has_progress = await self._push(transfer, num_computed_tokens)
        self.ttft.on_pushed(time.monotonic() - push_started)
        return has_progress

    async def _hand_off(self) -> AsyncIterator[worker_pb2.PrefillResponse]:
        """Wait for every push to be confirmed (progress meanwhile), then the last response
        (done); from then on the decode worker owns the reservation."""
        transfer = self.transfer
        if transfer is None or self.ends_request:
            yield self._progress(done=True)
            return
        try:
            async for _ in transfer.wait_all():
                if not transfer.is_done:
                    yield self._progress()
        except TransferFailed as exc:
            self._fail_transfer(exc)
        now = time.monotonic()
        self.worker.runtime.metrics.transfer.done(
            METHOD_NAMES[self.method], now - (self.transfer_started_at or now),
            transfer.num_blocks_sent * self.worker.block_bytes)
        first_token_at = self.ttft.first_token_at or now
        log.debug("request %s: %d prompt tokens, first token after %.3f s, %d blocks pushed "
                  "(%s) %.3f s later", self.request_id, len(self.prompt),
                  first_token_at - self.ttft.started_at, transfer.num_blocks_total,
                  METHOD_NAMES[self.method], now - first_token_at)
        yield self._progress(done=True)
        # Written: the router has the last event and releases the reservation itself if it
        # leaves before the Decode call claimed it. Cancelled before this point, it cannot know
        # the transfer ended, so cleanup releases it.
        self.handed_off = True

    async def _reserve(self) -> worker_pb2.BlockReservation:
        worker = self.worker
        if not self.target.address:
            raise InvalidArgument("Prefill: decode.address is empty")
        self.peer = worker.peers.get(self.target.address)
        pusher = worker.pushers[self.method]
        try:
            remote = await self.peer.remote(self.method, pusher)
            sent_at = time.monotonic()
            self.reserve_unanswered = True
            reply: worker_pb2.ReserveBlocksResponse = await self.peer.decode.ReserveBlocks(
                worker_pb2.ReserveBlocksRequest(request_id=self.request_id, prompt_token_ids=self.prompt,
                                                sampling_params=self.proto_params,
                                                attempt_id=self.attempt_id), timeout=RESERVE_TIMEOUT_S + (
                    COMPILE_TIMEOUT_S if self.params.structured_outputs is not None else 0.0))
            self.reserve_unanswered = False
        except KVTransferError as exc:
            raise FailedPrecondition(str(exc), failed_peer="decode") from exc
        except grpc.aio.AioRpcError as exc:  # passed on as the same kind
            # refused (full, bad input, a duplicate id): nothing was reserved for this call;
            # cancelled or past its deadline, the decode worker may have reserved (cleanup releases)
            self.reserve_unanswered = exc.code() in (grpc.StatusCode.CANCELLED,
                                                     grpc.StatusCode.DEADLINE_EXCEEDED)
            raise service_error_of(exc, f"decode worker {self.target.address}: {exc.details()}",
                                   failed_peer="decode") from exc
        self.reservation = reservation = reply.reservation
        if reservation.lease_ms == 0:
            raise FailedPrecondition(f"decode worker {self.target.address} granted reservation "
                                     f"{reservation.reservation_id!r} a lease of 0 ms",
                                     failed_peer="decode")
        self.lease = LeaseKeeper(self.peer.decode, reservation.reservation_id,
                                 reservation.lease_ms / 1000, sent_at, self.target.address)
        self.lease.start()
        try:
            self.transfer = RequestTransfer(pusher, remote, self.request_id,
                                            list(reservation.block_ids),
                                            self.engine.config.cache.block_size,
                                            len(self.prompt), self.lease,
                                            reservation.num_cached_blocks)
        except TransferFailed as exc:
            raise FailedPrecondition(str(exc), failed_peer="decode") from exc
        return reservation

    async def _next_output(self, queue: OutputQueue) -> RequestOutput:
        """The request's next engine output; while a reservation waits for its KV, only as
        long as the reservation's lease (renewed meanwhile) allows."""
        try:
            if self.lease is None:
                return await self.engine.next_output(queue)
            return await self.lease.hold_while(self.engine.next_output(queue))
        except LeaseLost as exc:
            if exc.expired:
                raise DeadlineExceeded(f"Prefill: {exc}", failed_peer="decode") from exc
            self._fail_transfer(exc)
        except EngineDead as exc:
            raise Unavailable(str(exc)) from exc

    async def _push(self, transfer: RequestTransfer, num_computed_tokens: int) -> bool:
        """Push newly final blocks; True if more blocks were confirmed since the last call."""
        try:
            changed = transfer.collect()
            # Read the live request (a preemption frees blocks and resets its progress).
            live = self.engine.sendable(self.request_id)
            if live is None:
                return changed
            if live.was_preempted and transfer.num_blocks_queued > transfer.num_cached_blocks:
                raise TransferFailed("the prefill worker ran out of KV blocks and preempted the "
                                     "request while its KV was being pushed; retry it")
            num_computed = min(num_computed_tokens, live.num_computed_tokens)
            await transfer.push(live.block_ids, num_computed)
            return changed
        except TransferFailed as exc:
            self._fail_transfer(exc)

    def _fail_transfer(self, exc: TransferFailed) -> NoReturn:
        self.worker.runtime.metrics.transfer.failed(METHOD_NAMES[self.method])
        assert self.peer is not None  # a transfer or lease exists: _reserve chose the peer
        self.peer.forget(self.method)
        log.warning("request %s: %s", self.request_id, exc)
        raise Unavailable(f"Prefill: KV transfer to decode worker {self.target.address} failed: "
                          f"{exc}", failed_peer="decode") from exc

    def _progress(self, done: bool = False) -> worker_pb2.PrefillResponse:
        transfer = self.transfer
        return worker_pb2.PrefillResponse(request_id=self.request_id, transfer=worker_pb2.TransferProgress(
            num_blocks_sent=transfer.num_blocks_sent if transfer else 0,
            num_blocks_total=transfer.num_blocks_total if transfer else 0, done=done))

    async def cleanup(self) -> None:
        """Free everything this call still holds, in a safe order (see the module docstring)."""
        if self.transfer is not None:
            await self.transfer.settle(SETTLE_TIMEOUT_S)
            self._count_transfer(self.transfer)
        if self.adding is not None and await self._was_added(self.adding):
            request_id = self.request_id
            try:
                await self.engine.call(lambda core: core.drop(request_id))
            except EngineDead:
                pass
        if self.subscribed:  # after the drop: until then no other call may use this id
            self.engine.unsubscribe(self.request_id)
        if self.lease is not None:
            await self.lease.stop()
        if (self.reservation is not None or self.reserve_unanswered) and not self.handed_off:
            reservation_id = self.reservation.reservation_id if self.reservation else self.request_id
            assert self.peer is not None  # set before ReserveBlocks was sent
            try:
                await self.peer.decode.ReleaseBlocks(worker_pb2.ReleaseBlocksRequest(
                    reservation_id=reservation_id,
                    attempt_id=self.attempt_id if self.reserve_unanswered else ""),
                    timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:  # its lease frees them if it is alive
                log.warning("request %s: ReleaseBlocks on %s failed: %s", self.request_id,
                            self.target.address, exc.details())

    def _count_transfer(self, transfer: RequestTransfer) -> None:
        counters = self.worker.transfer_counters
        transfer.collect_quietly()
        counters.num_blocks_sent += transfer.num_blocks_sent
        counters.num_bytes_sent += transfer.num_blocks_sent * self.worker.block_bytes
        counters.num_blocks_skipped_cached += transfer.num_cached_blocks
        counters.num_bytes_skipped_cached += transfer.num_cached_blocks * self.worker.block_bytes

    async def _was_added(self, adding: asyncio.Future[list[str]]) -> bool:
        """Wait (one engine step at most) until add_request was applied; did it succeed?"""
        try:
            await adding
        except (ValueError, EngineDead):
            return False
        return True
