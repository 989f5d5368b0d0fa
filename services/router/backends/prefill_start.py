"""The remote path's first step: open a Prefill call on a (prefill, decode) pair that accepts it.

    started = await start_prefill(sample, plan, placement, settings)
    started.prefill, started.decode, started.call, started.first   # the pair, the call, event 1

The plan's workers are tried first, then the load policy's picks. A worker that is full
(RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) before the first event is excluded and the
next pair tried; the error's ``FAILED_PEER_KEY`` says which side failed (a full decode worker
is passed on by the prefill worker). When no decode worker is left and the last one lacked
free KV blocks (``KV_FULL_KEY``) while some healthy decode worker could hold the prompt when
empty, the sample waits for blocks to free up (``KVFullWait``: 50 ms doubling to 1 s, for at
most ``kv_full_wait_s`` and the request's deadline) and tries every decode worker again, as a
colocated engine queues a request until its blocks fit. Other errors end the sample
(worker_errors.py, before its first event).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.mathutils import cdiv
from services.common.pb import worker_pb2
from services.router.backends.placement import Placement
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import (
    RETRYABLE,
    failed_peer,
    is_kv_full,
    mark_if_unavailable,
    worker_error,
)
from services.router.deadline import remaining_s
from services.router.errors import BackendError, Overloaded
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_pool import InFlight, Worker


@dataclass(frozen=True)
class PrefillSettings:
    transfer_method: worker_pb2.KVTransferMethod
    timeout_s: float = 300.0  # the call's deadline unless the request's is nearer
    kv_full_wait_s: float = 60.0  # 0: refuse at once when every decode worker lacks KV blocks


@dataclass(frozen=True)
class StartedPrefill:
    prefill: Worker
    decode: Worker
    call: grpc.aio.UnaryStreamCall
    first: worker_pb2.PrefillResponse  # the call's first event
    # the sample's share of each worker's load (worker_pool.py), begun before the call was sent
    on_prefill: InFlight
    on_decode: InFlight


class KVFullWait:
    """Backoff for a sample waiting for free decode KV blocks: ``sleep`` waits 50 ms, doubling to
    1 s, and answers False (without sleeping) once ``budget_s`` from the first call is spent."""

    def __init__(self, budget_s: float, on_wait: Callable[[], None] = lambda: None) -> None:
        self.budget_s = budget_s
        self.on_wait = on_wait  # after each sleep (the backend counts them)
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
        self.on_wait()
        return True


async def start_prefill(sample: Sample, plan: RoutePlan | None, placement: Placement,
                        settings: PrefillSettings, kv_wait: KVFullWait) -> StartedPrefill:
    """The first pair that accepts the sample (module docstring); Overloaded or Unavailable
    when none does, ValueError for bad input, BackendError for other failures."""
    excluded: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    last_error: grpc.aio.AioRpcError | None = None
    prompt = sample.prompt
    while True:
        prefill = placement.planned("prefill", plan, excluded["prefill"]) or placement.pick(
            "prefill", prompt, excluded["prefill"], last_error)
        try:
            decode = placement.planned("decode", plan, excluded["decode"]) or placement.pick(
                "decode", prompt, excluded["decode"], last_error)
        except Overloaded:
            if (settings.kv_full_wait_s <= 0 or last_error is None or not is_kv_full(last_error)
                    or not placement.fits_some_decode(len(prompt)) or not await kv_wait.sleep()):
                raise
            excluded["decode"].clear()
            last_error = None
            continue
        # begun before the workers can see the sample, so a load poll never holds it uncounted
        shares = (prefill.begin(prefill_tokens=len(prompt), blocks=cdiv(len(prompt), prefill.block_size)),
                  decode.begin(blocks=cdiv(len(prompt), decode.block_size)))
        call = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=sample.request_id, prompt_token_ids=prompt, sampling_params=sample.wire_params,
            decode=worker_pb2.DecodeTarget(worker_id=decode.worker_id, address=decode.address),
            transfer_method=settings.transfer_method), timeout=remaining_s(settings.timeout_s))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            _end(shares)
            code, last_error = exc.code(), exc
            if code not in RETRYABLE:
                raise worker_error(prefill, exc, is_started=False) from exc
            peer = failed_peer(exc)
            if peer == "decode" or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and peer != "prefill"):
                mark_if_unavailable(decode, exc)
                excluded["decode"].add(decode.address)
            else:
                mark_if_unavailable(prefill, exc)
                excluded["prefill"].add(prefill.address)
            continue
        except BaseException:  # cancelled
            _end(shares)
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            _end(shares)
            raise BackendError(f"prefill worker {prefill.address} ended {sample.request_id!r} "
                               "without any event")
        return StartedPrefill(prefill, decode, call, first, *shares)


def _end(shares: tuple[InFlight, ...]) -> None:
    for share in shares:
        share.end()
