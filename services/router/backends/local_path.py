"""The local path of conditional disaggregation: one sample runs wholly on a decode worker
(a Generate call, on the router's DecodeMany stream to it: prefill there, then decode), no
prefill worker, no KV transfer.

If the decode worker is full or unreachable before the first event, the sample falls back to
the remote path (the load policy picks both workers; counted as ``remote/retry``). Bad input
it refuses before the first event is the client's (ValueError). After the first event a lost
worker raises WorkerLost and the sample migrates (migration.py); other failures end it with
BackendError (worker_errors.py). Closing the iterator cancels the call: the worker aborts
the request and frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import grpc

from engine.mathutils import cdiv
from services.common.pb import worker_pb2
from services.common.wire import ttft_stages_from_proto
from services.router.backends.backend import TokenEvent
from services.router.backends.decode_stream import DecodeStream
from services.router.backends.remote_path import RemotePath
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import RETRYABLE, mark_if_unavailable, worker_error
from services.router.deadline import remaining_s
from services.router.routing.route_decisions import RouteDecisions
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_pool import Worker


class LocalPath:
    """See the module docstring; ``remote`` is the fallback, ``decisions`` counts it."""

    def __init__(self, remote: RemotePath, decisions: RouteDecisions, decode_timeout_s: float = 3600.0) -> None:
        self.remote = remote
        self.decisions = decisions
        self.decode_timeout_s = decode_timeout_s

    async def run(self, sample: Sample, decode: Worker, plan: RoutePlan) -> AsyncGenerator[TokenEvent, None]:
        """Token events of ``sample`` served by ``decode`` alone (module docstring)."""
        # the decode worker computes only what it does not hold (the plan's index view); begun
        # before the call is made, so a load poll never holds the sample uncounted
        num_prompt_tokens = len(sample.prompt)
        in_flight = decode.begin(prefill_tokens=num_prompt_tokens - plan.num_decode_cached_tokens,
                                 blocks=cdiv(num_prompt_tokens, decode.block_size))
        call = self.remote.muxes.start(decode, worker_pb2.GenerateLocalRequest(
            request_id=sample.request_id, prompt_token_ids=sample.prompt,
            sampling_params=sample.wire_params), remaining_s(self.decode_timeout_s))
        stream = DecodeStream(call, decode, sample, in_flight)
        try:
            try:
                first: worker_pb2.DecodeResponse | None = await stream.open()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    is_bad_input = exc.code() is grpc.StatusCode.INVALID_ARGUMENT
                    raise worker_error(decode, exc, is_started=not is_bad_input) from exc
                mark_if_unavailable(decode, exc)
                first = None
            if first is None:
                await stream.close()
                self.decisions.record("remote/retry")
                fallback = self.remote.run(sample, None)
                try:
                    async for event in fallback:
                        yield event
                finally:
                    await fallback.aclose()
                return
            is_first = True
            async for event in stream.events():
                if is_first:
                    event.num_prompt_tokens = num_prompt_tokens
                    event.num_cached_tokens = first.num_cached_prompt_tokens
                    event.route = plan.key
                    event.ttft_stages = ttft_stages_from_proto(first.stages)
                    is_first = False
                yield event
        finally:
            await stream.close()
