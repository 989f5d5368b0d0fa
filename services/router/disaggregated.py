"""DisaggregatedBackend: a prefill worker computes the first token and the KV, a decode worker
streams the rest. The router's frontends use it through the Backend interface.

One sample (a *pipeline*)::

    policy picks (prefill P, decode D)
    P.Prefill(decode=D) ──▶ reservation ──▶ first_token ──▶ TokenEvent (TTFT) ──┐
                              │ transfer progress … done (read in the background)   │
    D.Decode(prompt + first token, reservation) ◀─────────────────────────────────┘
        ──▶ TokenEvents until a finish reason

* The first token ends the request (EOS, stop token, max_tokens=1): no Decode call; the
  prefill worker gives the reservation back itself.
* n > 1 runs n independent pipelines (sample i seeded seed + i, as offline) and merges their
  events; the prompt is prefilled once per sample (the prefill prefix cache softens it).
* A full (RESOURCE_EXHAUSTED) or unreachable decode worker before the first event: the next
  one is tried; an unreachable prefill worker likewise. Nothing left: Overloaded, except when
  the decode workers were full only for lack of free KV blocks (``KV_FULL_KEY``) and one of them
  could hold the prompt when empty: then the sample waits for blocks to free up (running
  requests finish), retrying with backoff (50 ms doubling to 1 s) for at most
  ``kv_full_wait_s`` (and the request's deadline), as a colocated engine queues a request
  until its blocks fit. 0 refuses at once.
* Closing the iterator (stop string, client gone) cancels both calls: each worker frees what
  it holds. If the prefill call had already finished (all KV pushed) the router also sends
  ReleaseBlocks, for a Decode call that may never have reached the decode worker.
* A worker lost mid-stream (gone, reset, or drained past its grace: migration.LOST_CODES)
  is marked unhealthy until a health check passes again, and the sample migrates
  (services/router/migration.py): it starts over when no token was streamed yet, else a decode
  worker resumes it after the streamed tokens; at most ``max_migrations`` times. Other
  failures end the request with BackendError. Every call carries a deadline: the request's
  time left (services/router/deadline.py) when it has one, else the call's default.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from engine.mathutils import cdiv
from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2
from services.common.wire import (
    FAILED_PEER_KEY,
    KV_FULL_KEY,
    TRANSFER_METHODS,
    compat_from_proto,
    finish_from_proto,
    logprobs_from_proto,
    logprobs_list_from_proto,
    params_to_proto,
    ttft_stages_from_proto,
)
from services.router.backend import Backend, BackendError, Overloaded, TokenEvent, Unavailable
from services.router.deadline import remaining_s
from services.router.local_path import run_local
from services.router.metrics import RouterMetrics
from services.router.migration import DEFAULT_MAX_MIGRATIONS, LOST_CODES, WorkerLost, migrating
from services.router.policy import LoadPolicy, RoutingPolicy
from services.router.prefix_aware import PrefixAwarePolicy
from services.router.route_decisions import RouteDecisions
from services.router.route_plan import RoutePlan
from services.router.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 2.0
# Before the first event: another worker may succeed (full, down, or slow to answer).
_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class DisaggregatedBackend(Backend):
    def __init__(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                 transfer: str = "nixl", *, policy: RoutingPolicy | None = None,
                 poll_interval_s: float = 0.5, rpc_timeout_s: float = 1.0,
                 prefill_timeout_s: float = 300.0, decode_timeout_s: float = 3600.0,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, kv_full_wait_s: float = 60.0) -> None:
        if not prefill_addresses or not decode_addresses:
            raise ValueError("a disaggregated router needs at least one prefill and one decode "
                             f"worker; got prefill={list(prefill_addresses)} "
                             f"decode={list(decode_addresses)}")
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        if kv_full_wait_s < 0:
            raise ValueError(f"kv_full_wait_s must be >= 0, got {kv_full_wait_s}")
        if transfer not in TRANSFER_METHODS:
            raise ValueError(f"transfer must be one of {sorted(TRANSFER_METHODS)}, got {transfer!r}")
        self.pool = WorkerPool(prefill_addresses, decode_addresses, poll_interval_s, rpc_timeout_s)
        self.policy = policy or LoadPolicy()
        # decisions per path/reason (route_decisions.py); a load policy counts remote/load only
        self.route_decisions = (self.policy.decisions if isinstance(self.policy, PrefixAwarePolicy)
                                else RouteDecisions())
        self.transfer_method = TRANSFER_METHODS[transfer]
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self.max_migrations = max_migrations
        self.kv_full_wait_s = kv_full_wait_s
        self.num_kv_full_waits = 0  # retries after every decode worker lacked free KV blocks
        self.num_migrations = 0  # samples moved to another worker since start (migration.py)
        self._background: set[asyncio.Task] = set()

    def attach_metrics(self, metrics: RouterMetrics) -> None:
        """Routing decisions and the prefix index's health go to the router's metrics (TTFT
        stages travel on each sample's first TokenEvent: the frontend observes them)."""
        self.route_decisions.listener = metrics.routing.decision
        if isinstance(self.policy, PrefixAwarePolicy):
            self.policy.routing = metrics.routing

    async def start(self) -> None:
        await self.pool.start()
        await self._configure_index()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.pool.close()
        if isinstance(self.policy, PrefixAwarePolicy):
            self.policy.close()

    async def _configure_index(self) -> None:
        """Give a prefix-aware policy the workers' KV compatibility (once any worker answered
        GetStats). Workers that disagree, or an index with other hash settings, raise."""
        policy = self.policy
        if not isinstance(policy, PrefixAwarePolicy) or policy.is_configured:
            return
        compats = {compat_from_proto(w.stats.kv_compat)
                   for ws in self.pool.workers.values() for w in ws
                   if w.stats.HasField("kv_compat") and w.stats.kv_compat.block_size}
        if len(compats) > 1:
            raise ValueError(f"workers report different KV caches, so no one prefix index fits "
                             f"them all: {sorted(map(str, compats))}")
        if compats:
            await asyncio.to_thread(policy.configure, compats.pop())

    async def _plan(self, request_id: str, prompt: list[int],
                    params: SamplingParams) -> RoutePlan | None:
        """The prefix-aware plan of one sample; None (load policy picks) without one."""
        if not isinstance(self.policy, PrefixAwarePolicy):
            self.route_decisions.record("remote/load")
            return None
        if not self.policy.is_configured:
            try:
                await self._configure_index()
            except Exception as exc:  # noqa: BLE001 - logged; the index stays off, load routing
                log.error("prefix index not usable: %s", exc)
        loads = {role: [w.load() for w in self.pool.healthy(role)] for role in ("prefill", "decode")}
        try:
            return await self.policy.plan(request_id, prompt, params, loads["prefill"], loads["decode"])
        except Exception:  # noqa: BLE001 - routing advice must never fail a request
            log.exception("prefix-aware routing of %s failed; routing by load", request_id)
            self.route_decisions.record("remote/plan_error")
            return None

    async def is_healthy(self) -> bool:
        return bool(self.pool.healthy("prefill")) and bool(self.pool.healthy("decode"))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[TokenEvent]:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if params.n == 1:
            pipeline = self._pipeline(request_id, prompt, params, 0)
            try:
                async for event in pipeline:
                    yield event
            finally:  # the frontend closing us must release both workers now, not at GC
                await pipeline.aclose()
            return
        queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(f"{request_id}/{i}", prompt, params.for_sample(i),
                                                  i, queue)) for i in range(params.n)]
        try:
            num_running = len(tasks)
            while num_running:
                item = await queue.get()
                if item is None:
                    num_running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, sample_id: str, prompt: list[int], params: SamplingParams, index: int,
                    queue: asyncio.Queue) -> None:
        try:
            async for event in self._pipeline(sample_id, prompt, params, index):
                await queue.put(event)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)

    # ---- one sample ------------------------------------------------------------------

    async def _pipeline(self, request_id: str, prompt: list[int], params: SamplingParams,
                        index: int) -> AsyncIterator[TokenEvent]:
        planned_at = time.monotonic()
        plan = await self._plan(request_id, prompt, params)
        lookup_s = (time.monotonic() - planned_at) if isinstance(self.policy, PrefixAwarePolicy) else None
        try:
            events = migrating(self, request_id, prompt, params, index,
                               self._first_attempt(request_id, prompt, params, index, plan))
            try:
                async for event in events:
                    yield _with_lookup(event, lookup_s)
            finally:
                await events.aclose()
        finally:
            if isinstance(self.policy, PrefixAwarePolicy):
                self.policy.finish(request_id)

    async def _first_attempt(self, request_id: str, prompt: list[int], params: SamplingParams,
                             index: int, plan: RoutePlan | None) -> AsyncIterator[TokenEvent]:
        """The sample on the path its plan chose (local when planned and possible, else remote)."""
        if plan is not None and plan.path == "local" and params.prompt_logprobs is None:
            decode = next((w for w in self.pool.healthy("decode")
                           if w.address == plan.decode_address), None)
            if decode is not None:
                local = run_local(self, decode, request_id, prompt, params, index, plan)
                try:
                    async for event in local:
                        yield event
                finally:
                    await local.aclose()
                return
        remote = self._remote(request_id, prompt, params, index, plan)
        try:
            async for event in remote:
                yield event
        finally:
            await remote.aclose()

    async def _remote(self, request_id: str, prompt: list[int], params: SamplingParams,
                      index: int, plan: RoutePlan | None) -> AsyncIterator[TokenEvent]:
        proto_params = params_to_proto(params)
        prefill_call = decode_call = prefill_rest = None
        reservation = None
        on_prefill = on_decode = None
        finished = False
        try:
            prefill, decode, prefill_call, response = await self._start_prefill(
                request_id, prompt, proto_params, plan)
            on_prefill = prefill.begin(prefill_tokens=len(prompt),
                                       blocks=cdiv(len(prompt), prefill.stats.block_size or 16))
            on_decode = decode.begin(blocks=cdiv(len(prompt), decode.stats.block_size or 16))
            while response.WhichOneof("event") != "first_token":
                if response.WhichOneof("event") == "reservation":
                    reservation = response.reservation
                response = await self._read(prefill_call, prefill)
                if response is grpc.aio.EOF:
                    raise WorkerLost(prefill, f"it ended {request_id!r} without a first token")
            on_prefill.end_prefill()
            first = response.first_token
            finish = finish_from_proto(first.finish_reason)
            yield TokenEvent(
                index=index, token_ids=[first.token_id],
                logprobs=[logprobs_from_proto(first.logprobs)] if first.HasField("logprobs") else None,
                prompt_logprobs=logprobs_list_from_proto(first.prompt_logprobs) if index == 0 else None,
                finish_reason=finish,
                stop_token_id=first.stop_token_id if first.HasField("stop_token_id") else None,
                num_prompt_tokens=len(prompt), num_cached_tokens=first.num_cached_prompt_tokens,
                route=plan.key if plan is not None else "remote/load",
                ttft_stages=ttft_stages_from_proto(first.stages))
            if finish is not None:
                finished = True
                return
            if reservation is None:
                raise BackendError(f"prefill worker {prefill.address} sent no reservation for "
                                   f"{request_id!r}")
            prefill_rest = asyncio.ensure_future(self._drain(prefill_call, prefill))
            decode_call = decode.decode.Decode(worker_pb2.DecodeRequest(
                request_id=request_id, reservation_id=reservation.reservation_id,
                first_token_id=first.token_id), timeout=remaining_s(self.decode_timeout_s))
            while not finished:
                response = await self._next_decode(decode_call, decode, prefill_rest)
                finish = finish_from_proto(response.finish_reason)
                finished = finish is not None
                yield TokenEvent(
                    index=index, token_ids=list(response.token_ids),
                    logprobs=logprobs_list_from_proto(response.logprobs), finish_reason=finish,
                    stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None)
        finally:
            for in_flight in (on_prefill, on_decode):
                if in_flight is not None:
                    in_flight.end()
            if finished and prefill_call is not None and not prefill_call.done():
                # let the prefill worker finish its stream (dropping the call would cancel it)
                self._spawn(prefill_rest if prefill_rest is not None
                            else self._drain(prefill_call, prefill))
            elif prefill_rest is not None:
                prefill_rest.cancel()
            if not finished:
                for call in (prefill_call, decode_call):
                    if call is not None and not call.done():
                        call.cancel()
                if reservation is not None:
                    self._spawn(self._release_after(prefill_call, decode, reservation.reservation_id))

    async def _start_prefill(self, request_id: str, prompt: list[int], proto_params,
                             plan: RoutePlan | None = None
                             ) -> tuple[Worker, Worker, grpc.aio.UnaryStreamCall, object]:
        """Open a Prefill call and read its first event; on a full or unreachable worker,
        try the next one (the plan's workers first, then the load policy's picks)."""
        excluded = {"prefill": set(), "decode": set()}
        last_error: grpc.aio.AioRpcError | None = None
        kv_wait = _KVFullWait(remaining_s(self.kv_full_wait_s)) if self.kv_full_wait_s > 0 else None
        while True:
            prefill = self._planned("prefill", plan, excluded["prefill"]) or self._pick(
                "prefill", prompt, excluded["prefill"], last_error)
            try:
                decode = self._planned("decode", plan, excluded["decode"]) or self._pick(
                    "decode", prompt, excluded["decode"], last_error)
            except Overloaded:
                if (kv_wait is None or last_error is None or not _is_kv_full(last_error)
                        or not self._fits_some_decode(len(prompt)) or not await kv_wait.sleep()):
                    raise
                self.num_kv_full_waits += 1
                excluded["decode"].clear()
                last_error = None
                continue
            call = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling_params=proto_params,
                decode=worker_pb2.DecodeTarget(worker_id=decode.worker_id, address=decode.address),
                transfer_method=self.transfer_method), timeout=remaining_s(self.prefill_timeout_s))
            try:
                response = await call.read()
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                code, last_error = exc.code(), exc
                if code not in _RETRYABLE:
                    raise _error("prefill", prefill, exc) from exc
                if _failed_peer(exc) == "decode" or (code is grpc.StatusCode.RESOURCE_EXHAUSTED
                                                     and _failed_peer(exc) != "prefill"):
                    if code is grpc.StatusCode.UNAVAILABLE:
                        decode.mark_unhealthy(exc.details())
                    excluded["decode"].add(decode.address)
                    continue
                if code is grpc.StatusCode.UNAVAILABLE:  # full (RESOURCE_EXHAUSTED) is healthy
                    prefill.mark_unhealthy(exc.details())
                excluded["prefill"].add(prefill.address)
                continue
            if response is grpc.aio.EOF:
                raise BackendError(f"prefill worker {prefill.address} ended {request_id!r} "
                                   "without any event")
            return prefill, decode, call, response

    def _fits_some_decode(self, num_prompt_tokens: int) -> bool:
        """Whether an empty pool of some healthy decode worker holds the prompt (else waiting
        for free blocks cannot help)."""
        return any(w.stats.num_total_blocks * (w.stats.block_size or 16) >= num_prompt_tokens + 1
                   for w in self.pool.healthy("decode", set()))

    def _planned(self, role: str, plan: RoutePlan | None, excluded: set[str]) -> Worker | None:
        """The plan's worker of ``role`` while it is healthy and not excluded."""
        if plan is None:
            return None
        address = plan.prefill_address if role == "prefill" else plan.decode_address
        return next((w for w in self.pool.healthy(role, excluded) if w.address == address), None)

    def _pick(self, role: str, prompt: list[int], excluded: set[str],
              last_error: grpc.aio.AioRpcError | None) -> Worker:
        candidates = {w.address: w for w in self.pool.healthy(role, excluded)}
        loads = [w.load() for w in candidates.values()]
        chosen = (self.policy.pick_prefill(loads, prompt) if role == "prefill"
                  else self.policy.pick_decode(loads, prompt))
        if chosen is not None:
            return candidates[chosen.address]
        if last_error is not None and last_error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(f"every {role} worker is full: {last_error.details()}")
        states = ", ".join(f"{w.address}: {w.status}" for w in self.pool.workers[role])
        detail = f"; last error: {last_error.details()}" if last_error is not None else ""
        raise Unavailable(f"no healthy {role} worker ({states}){detail}")

    @staticmethod
    async def _read(call: grpc.aio.UnaryStreamCall, worker: Worker):
        try:
            return await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(worker.role, worker, exc, after_start=True) from exc

    async def _drain(self, call: grpc.aio.UnaryStreamCall, worker: Worker) -> None:
        """Read the rest of a Prefill stream (transfer progress) until it ends OK."""
        while await self._read(call, worker) is not grpc.aio.EOF:
            pass

    async def _next_decode(self, call: grpc.aio.UnaryStreamCall, decode: Worker,
                           prefill_rest: asyncio.Future):
        """The next Decode response; fails early if the prefill side fails meanwhile."""
        read = asyncio.ensure_future(self._read(call, decode))
        try:
            if not prefill_rest.done():
                await asyncio.wait({read, prefill_rest}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_rest.done() and not prefill_rest.cancelled() and prefill_rest.exception():
                raise prefill_rest.exception()
            response = await read
        finally:
            if not read.done():
                read.cancel()
        if response is grpc.aio.EOF:
            raise WorkerLost(decode, "it ended the stream without a finish reason")
        return response

    async def _release_after(self, prefill_call, decode: Worker, reservation_id: str) -> None:
        """After an early exit: if the Prefill call had finished OK, the prefill worker handed
        the reservation over, and only a Decode call would free it: release it here. (Had it
        not finished, the prefill worker releases it once its pushes have settled.)"""
        try:
            code = await asyncio.wait_for(prefill_call.code(), RELEASE_TIMEOUT_S)
            if code is grpc.StatusCode.OK:
                await decode.decode.ReleaseBlocks(
                    worker_pb2.ReleaseBlocksRequest(reservation_id=reservation_id),
                    timeout=RELEASE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            log.info("releasing reservation %s on %s: %r", reservation_id, decode.address, exc)

    def _spawn(self, coro_or_task) -> None:
        task = asyncio.ensure_future(coro_or_task)
        self._background.add(task)
        task.add_done_callback(_forget_task(self._background))


def _forget_task(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("background call ended with %r", task.exception())
    return done


def _with_lookup(event: TokenEvent, lookup_s: float | None) -> TokenEvent:
    """A sample's first event gains the ``index_lookup`` stage (the prefix-aware plan's time)."""
    if lookup_s is not None and event.ttft_stages is not None:
        event.ttft_stages["index_lookup"] = lookup_s
    return event


def _is_kv_full(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and any(
        key == KV_FULL_KEY for key, _ in exc.trailing_metadata() or ())


class _KVFullWait:
    """Backoff for a sample waiting for free decode KV blocks: ``sleep`` waits 50 ms, doubling to
    1 s, and answers False (without sleeping) once ``budget_s`` from the first call is spent."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.deadline: float | None = None
        self.delay_s = 0.05

    async def sleep(self) -> bool:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.budget_s
        if now + self.delay_s > self.deadline:
            return False
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, 1.0)
        return True


def _failed_peer(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == FAILED_PEER_KEY:
            return value
    return ""


def _error(role: str, worker: Worker, exc: grpc.aio.AioRpcError,
           after_start: bool = False) -> Exception:
    """The Backend exception for a failed worker call (bad input only before any event)."""
    code, details = exc.code(), exc.details()
    if code is grpc.StatusCode.INVALID_ARGUMENT and not after_start:
        return ValueError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not after_start:
        return Overloaded(details)
    if code is grpc.StatusCode.UNAVAILABLE and _failed_peer(exc) != "decode":
        worker.mark_unhealthy(details)
    if after_start and worker.role == "decode" and _failed_peer(exc) == "prefill":
        return WorkerLost(worker, f"{code.name}: {details}", is_peer_at_fault=True)
    if after_start and code in LOST_CODES:
        return WorkerLost(worker, f"{code.name}: {details}")
    return BackendError(f"{role} worker {worker.address} failed: {code.name}: {details}")
