"""The local path of conditional disaggregation: one sample runs wholly on a decode worker
(``DecodeService.Generate``: prefill there, then decode), no prefill worker, no KV transfer.

If the decode worker is full or unreachable before the first event, the sample falls back to
the remote path (the load policy picks both workers; counted as ``remote/retry``). After the
first event a lost worker (migration.LOST_CODES) raises WorkerLost, and the sample migrates
(services/router/migration.py); other failures end it with BackendError. Closing the
iterator cancels the call: the worker aborts the request and frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from engine.mathutils import cdiv
from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2
from services.common.wire import (
    finish_from_proto,
    logprobs_list_from_proto,
    params_to_proto,
    ttft_stages_from_proto,
)
from services.router.backend import BackendError, TokenEvent
from services.router.deadline import remaining_s
from services.router.migration import LOST_CODES, WorkerLost
from services.router.route_plan import RoutePlan
from services.router.worker_pool import Worker

if TYPE_CHECKING:
    from services.router.disaggregated import DisaggregatedBackend

_RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


async def run_local(backend: DisaggregatedBackend, decode: Worker, request_id: str,
                    prompt: list[int], params: SamplingParams, index: int,
                    plan: RoutePlan) -> AsyncIterator[TokenEvent]:
    """Token events of one sample served by ``decode`` alone (module docstring)."""
    call = decode.decode.Generate(worker_pb2.GenerateLocalRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=params_to_proto(params)),
        timeout=remaining_s(backend.decode_timeout_s))
    # the decode worker computes only what it does not hold (the plan's index view)
    in_flight = decode.begin(prefill_tokens=len(prompt) - plan.num_decode_cached_tokens,
                             blocks=cdiv(len(prompt), decode.stats.block_size or 16))
    finished = False
    is_first = True
    try:
        while not finished:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as exc:
                if is_first and exc.code() in _RETRYABLE:
                    if exc.code() is grpc.StatusCode.UNAVAILABLE:
                        decode.mark_unhealthy(exc.details())
                    in_flight.end()
                    backend.route_decisions.record("remote/retry")
                    remote = backend._remote(request_id, prompt, params, index, None)
                    try:
                        async for event in remote:
                            yield event
                    finally:
                        await remote.aclose()
                    finished = True
                    return
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT and is_first:
                    raise ValueError(exc.details()) from exc
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    decode.mark_unhealthy(exc.details())
                if exc.code() in LOST_CODES:
                    raise WorkerLost(decode, f"{exc.code().name}: {exc.details()}") from exc
                raise BackendError(f"decode worker {decode.address} failed: {exc.code().name}: "
                                   f"{exc.details()}") from exc
            if response is grpc.aio.EOF:
                raise WorkerLost(decode, f"it ended {request_id!r} without a finish reason")
            finish = finish_from_proto(response.finish_reason)
            finished = finish is not None
            event = TokenEvent(
                index=index, token_ids=list(response.token_ids),
                logprobs=logprobs_list_from_proto(response.logprobs), finish_reason=finish,
                stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None)
            if is_first:
                in_flight.end_prefill()
                event.num_prompt_tokens = len(prompt)
                event.num_cached_tokens = response.num_cached_prompt_tokens
                event.route = plan.key
                event.ttft_stages = ttft_stages_from_proto(response.stages)
                is_first = False
            yield event
    finally:
        in_flight.end()
        if not finished and not call.done():
            call.cancel()
