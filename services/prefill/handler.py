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
router can pick another one.

Prefill writes with ``context.write`` from a coroutine (not an async generator), so a cancel
runs its cleanup at once rather than when the generator is garbage collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from engine.config import Role
from engine.kv_transfer.base import KVTransferError
from engine.sampling_params import SamplingParams
from services.common.async_engine import EngineDead
from services.common.faults import faults
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import (
    FAILED_PEER_KEY,
    KV_FULL_KEY,
    METHOD_NAMES,
    PREFILL_SERVICE_NAME,
    finish_to_proto,
    logprobs_list_to_proto,
    logprobs_to_proto,
    params_from_proto,
    transfer_methods,
    ttft_stages_to_proto,
)
from services.prefill.decode_peers import DecodePeer, DecodePeers
from services.prefill.lease import LeaseKeeper, LeaseLost
from services.prefill.pusher import KVPusher, sender_factories
from services.prefill.transfer import RequestTransfer, TransferFailed
from services.worker.admission import Pending, QueueLimit, WorkerFull
from services.worker.server import RoleHandler, WorkerRuntime
from services.worker.stats import PrefixCounters, TransferCounters

log = logging.getLogger(__name__)
RESERVE_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 2.0
SETTLE_TIMEOUT_S = 10.0


class PrefillAbort(Exception):
    """End the RPC with ``code``; ``peer`` = 'decode' when the decode worker is the cause;
    ``kv_full``: the decode worker had no free KV blocks (wire.KV_FULL_KEY)."""

    def __init__(self, code: grpc.StatusCode, message: str, peer: str = "",
                 kv_full: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.peer, self.kv_full = code, message, peer, kv_full


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

    async def start(self):
        kv_cache = self.runtime.engine.kv_cache
        for method, factory in sender_factories(self.runtime.args.transfer,
                                                self.runtime.model_name).items():
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
            try:
                pending = self.queue_limit.admit()
            except WorkerFull as exc:
                raise PrefillAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Prefill: {exc}", "prefill") from exc
            job = _PrefillJob(self, request, pending)
            async with contextlib.aclosing(job.run()) as responses:
                async for response in responses:
                    await context.write(response)
        except PrefillAbort as exc:
            metadata = ((FAILED_PEER_KEY, exc.peer),) if exc.peer else ()
            if exc.kv_full:
                metadata += ((KV_FULL_KEY, "1"),)
            if metadata:
                context.set_trailing_metadata(metadata)
            await context.abort(exc.code, exc.message)
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
            raise PrefillAbort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill: request_id is empty")
        try:
            self.params: SamplingParams = params_from_proto(request.sampling_params)
        except ValueError as exc:
            raise PrefillAbort(grpc.StatusCode.INVALID_ARGUMENT, f"Prefill: {exc}") from exc
        if self.params.n != 1:
            raise PrefillAbort(grpc.StatusCode.INVALID_ARGUMENT,
                               f"Prefill: n={self.params.n}; a prefill carries one sample, the "
                               "router sends n > 1 as n requests")
        self.method = request.transfer_method or worker.default_method
        if self.method not in worker.pushers:
            raise PrefillAbort(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Prefill: transfer method {METHOD_NAMES.get(self.method, self.method)} "
                               f"is not enabled on {worker.runtime.worker_id} (started with "
                               f"--transfer {worker.runtime.args.transfer})")
        self.peer: DecodePeer | None = None
        self.reservation: worker_pb2.BlockReservation | None = None
        self.reserve_unanswered = False  # ReserveBlocks cancelled or timed out: it may have reserved
        self.lease: LeaseKeeper | None = None
        self.transfer: RequestTransfer | None = None
        # add_request as queued on the engine thread: it is applied even if this call is
        # cancelled while waiting for it, so cleanup waits for it before dropping the request.
        self.adding: asyncio.Future | None = None
        self.subscribed = self.handed_off = False
        self.transfer_started_at: float | None = None  # the first chunk push (transfer metrics)
        self.timer = worker.runtime.metrics.request()

    async def run(self):
        started = time.monotonic()
        # max_tokens == 1: the first token ends the request, no decode worker is involved.
        stages: dict[str, float] = {}  # this worker's TTFT stages (FirstToken.stages), seconds
        if self.params.max_tokens != 1:
            reservation = await self._reserve()
            stages["decode_admit"] = time.monotonic() - started
            yield worker_pb2.PrefillResponse(request_id=self.request_id, reservation=reservation)
        queued_at = time.monotonic()
        try:
            queue = self.engine.subscribe(self.request_id)
        except ValueError as exc:
            raise PrefillAbort(grpc.StatusCode.ALREADY_EXISTS, f"Prefill: {exc}") from exc
        self.subscribed = True
        self.adding = asyncio.ensure_future(self.engine.call(
            lambda core: core.add_request(self.request_id, self.prompt, self.params)))
        try:
            await asyncio.shield(self.adding)
        except ValueError as exc:
            raise PrefillAbort(grpc.StatusCode.INVALID_ARGUMENT, f"Prefill: {exc}") from exc
        finally:
            if self.pending is not None:
                self.pending.done()
        self.timer.on_scheduled()
        taken_at = time.monotonic()
        push_s = 0.0  # pushing chunks before the first token: the transfer's share of TTFT
        ends_request = False
        first_token_at: float | None = None
        while True:
            output = await self._next_output(queue)
            self.timer.on_output(len(output.new_token_ids))
            if output.finish_reason in ("abort", "error"):
                raise PrefillAbort(grpc.StatusCode.INTERNAL,
                                   f"Prefill: the engine ended the request ({output.finish_reason}"
                                   f"{': ' + output.error if output.error else ''})")
            if output.new_token_ids:
                token_id = output.new_token_ids[0]
                ends_request = output.finish_reason in ("stop", "length")
                reason = output.finish_reason if ends_request else None
                stop_token_id = output.stop_reason if isinstance(output.stop_reason, int) else None
                first = worker_pb2.FirstToken(
                    token_id=token_id, finish_reason=finish_to_proto(reason),
                    num_cached_prompt_tokens=output.num_cached_tokens,
                    prompt_logprobs=logprobs_list_to_proto(output.prompt_logprobs))
                if output.new_logprobs:
                    first.logprobs.CopyFrom(logprobs_to_proto(output.new_logprobs[0]))
                if stop_token_id is not None:
                    first.stop_token_id = stop_token_id
                first_token_at = time.monotonic()
                stages["prefill_queue"] = taken_at - queued_at
                stages["prefill_compute"] = first_token_at - taken_at - push_s
                if self.transfer is not None:
                    stages["kv_transfer"] = push_s
                first.stages.CopyFrom(ttft_stages_to_proto(stages))
                self.worker.prefix_counters.add(len(self.prompt), output.num_cached_tokens)
                faults().before_first_token()  # PDSERVE_FAULTS only
                yield worker_pb2.PrefillResponse(request_id=self.request_id, first_token=first)
            if self.transfer is not None and not ends_request:
                push_started = time.monotonic()
                if self.transfer_started_at is None:
                    self.transfer_started_at = push_started
                has_progress = await self._push(output.num_computed_tokens)
                if first_token_at is None:
                    push_s += time.monotonic() - push_started
                if has_progress:
                    yield self._progress()
            if output.finished:
                break
        self.timer.on_finished("prefilled" if not ends_request else output.finish_reason, len(self.prompt))
        if self.transfer is None or ends_request:
            yield self._progress(done=True)
            return
        try:
            async for _ in self.transfer.wait_all():
                if not self.transfer.is_done:
                    yield self._progress()
        except TransferFailed as exc:
            self._fail_transfer(exc)
        self.worker.runtime.metrics.transfer.done(
            METHOD_NAMES[self.method], time.monotonic() - (self.transfer_started_at or time.monotonic()),
            self.transfer.num_blocks_sent * self.worker.block_bytes)
        log.debug("request %s: %d prompt tokens, first token after %.3f s, %d blocks pushed "
                  "(%s) %.3f s later", self.request_id, len(self.prompt), first_token_at - started,
                  self.transfer.num_blocks_total, METHOD_NAMES[self.method],
                  time.monotonic() - first_token_at)
        yield self._progress(done=True)
        # Written: the router has the last event and releases the reservation itself if it
        # leaves before the Decode call claimed it. Cancelled before this point, it cannot know
        # the transfer ended, so cleanup releases it.
        self.handed_off = True

    async def _reserve(self) -> worker_pb2.BlockReservation:
        worker = self.worker
        if not self.target.address:
            raise PrefillAbort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill: decode.address is empty")
        self.peer = worker.peers.get(self.target.address)
        pusher = worker.pushers[self.method]
        try:
            remote = await self.peer.remote(self.method, pusher)
            sent_at = time.monotonic()
            self.reserve_unanswered = True
            reply = await self.peer.decode.ReserveBlocks(worker_pb2.ReserveBlocksRequest(
                request_id=self.request_id, prompt_token_ids=self.prompt,
                sampling_params=self.proto_params), timeout=RESERVE_TIMEOUT_S)
            self.reserve_unanswered = False
        except KVTransferError as exc:
            raise PrefillAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc), "decode") from exc
        except grpc.aio.AioRpcError as exc:
            # refused (full, bad input, a duplicate id): nothing was reserved for this call
            self.reserve_unanswered = exc.code() in (grpc.StatusCode.CANCELLED,
                                                     grpc.StatusCode.DEADLINE_EXCEEDED)
            kv_full = any(key == KV_FULL_KEY for key, _ in exc.trailing_metadata() or ())
            raise PrefillAbort(exc.code(), f"decode worker {self.target.address}: {exc.details()}",
                               "decode", kv_full) from exc
        self.reservation = reservation = reply.reservation
        if reservation.lease_ms == 0:
            raise PrefillAbort(grpc.StatusCode.FAILED_PRECONDITION,
                               f"decode worker {self.target.address} granted reservation "
                               f"{reservation.reservation_id!r} a lease of 0 ms", "decode")
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
            raise PrefillAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc), "decode") from exc
        return reservation

    async def _next_output(self, queue: asyncio.Queue):
        """The request's next engine output; while a reservation waits for its KV, only as
        long as the reservation's lease (renewed meanwhile) allows."""
        try:
            if self.lease is None:
                return await self.engine.next_output(queue)
            return await self.lease.hold_while(self.engine.next_output(queue))
        except LeaseLost as exc:
            if exc.expired:
                raise PrefillAbort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Prefill: {exc}",
                                   "decode") from exc
            self._fail_transfer(exc)
        except EngineDead as exc:
            raise PrefillAbort(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc

    async def _push(self, num_computed_tokens: int) -> bool:
        """Push newly final blocks; True if more blocks were confirmed since the last call."""
        transfer = self.transfer
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

    def _fail_transfer(self, exc: TransferFailed) -> None:
        self.worker.runtime.metrics.transfer.failed(METHOD_NAMES[self.method])
        self.peer.forget(self.method)
        log.warning("request %s: %s", self.request_id, exc)
        raise PrefillAbort(grpc.StatusCode.UNAVAILABLE,
                           f"Prefill: KV transfer to decode worker {self.target.address} failed: {exc}",
                           "decode") from exc

    def _progress(self, done: bool = False) -> worker_pb2.PrefillResponse:
        transfer = self.transfer
        return worker_pb2.PrefillResponse(request_id=self.request_id, transfer=worker_pb2.TransferProgress(
            num_blocks_sent=transfer.num_blocks_sent if transfer else 0,
            num_blocks_total=transfer.num_blocks_total if transfer else 0, done=done))

    async def cleanup(self) -> None:
        """Free everything this call still holds, in a safe order (see the module docstring)."""
        if self.transfer is not None:
            await self.transfer.settle(SETTLE_TIMEOUT_S)
            self._count_transfer()
        if self.adding is not None and await self._was_added():
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
            try:
                await self.peer.decode.ReleaseBlocks(worker_pb2.ReleaseBlocksRequest(
                    reservation_id=reservation_id), timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:  # its lease frees them if it is alive
                log.warning("request %s: ReleaseBlocks on %s failed: %s", self.request_id,
                            self.target.address, exc.details())


    def _count_transfer(self) -> None:
        transfer, counters = self.transfer, self.worker.transfer_counters
        transfer.collect_quietly()
        counters.num_blocks_sent += transfer.num_blocks_sent
        counters.num_bytes_sent += transfer.num_blocks_sent * self.worker.block_bytes
        counters.num_blocks_skipped_cached += transfer.num_cached_blocks
        counters.num_bytes_skipped_cached += transfer.num_cached_blocks * self.worker.block_bytes

    async def _was_added(self) -> bool:
        """Wait (one engine step at most) until add_request was applied; did it succeed?"""
        try:
            await self.adding
        except (ValueError, EngineDead):
            return False
        return True
