"""DecodeService.Generate: one whole request on the decode worker, prefill included.

The router's conditional disaggregation sends a request here when the part of its prompt this
worker has not cached is short (or it holds most of the prompt and has room): computing that
part locally is cheaper than a remote prefill plus a KV transfer. The DECODE-role engine admits
such a request like a colocated one. The router also resumes a request here after the decode
worker serving it died (``resumed_output_token_ids``: ``EngineCore.add_request``). The stream
is ``DecodeResponse``s, the first carrying the first (new) token, ``num_cached_prompt_tokens``
and its TTFT stages (queue, compute); the last has a finish reason.

Bad input (empty id, bad params, n > 1, a prompt that cannot fit) raises InvalidArgument
before any response; a duplicate id AlreadyExists (services/common/errors.py). A cancelled
call aborts the request in the engine, which frees its blocks. Writes go through
``context.write`` from a coroutine, so a cancel runs the cleanup at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.async_engine import AsyncEngine, EngineDead
from services.common.errors import AlreadyExists, InvalidArgument, Unavailable
from services.common.pb import worker_pb2
from services.common.wire import ttft_stages_to_proto
from services.decode.output_stream import OutputStream, Writer
from services.worker.request_params import compile_constraint, invalid_argument, one_sample_params
from services.worker.stats import PrefixCounters

if TYPE_CHECKING:
    from engine.scheduler.output import RequestOutput


async def generate_local(engine: AsyncEngine, counters: PrefixCounters,
                         request: worker_pb2.GenerateLocalRequest, context: Writer,
                         on_added: Callable[[], None] | None = None) -> None:
    """Serve one Generate call (module docstring), its responses written to ``context`` (the
    call's, or a DecodeMany stream's). ``on_added()`` runs once the engine took the request (or
    refused it): the worker's queue bound stops counting it as pending."""
    arrived_at = time.monotonic()
    request_id = request.request_id
    prompt = list(request.prompt_token_ids)
    resumed = list(request.resumed_output_token_ids)
    if not request_id:
        raise InvalidArgument("Generate: request_id is empty")
    if not prompt:
        raise InvalidArgument("Generate: prompt_token_ids is empty: give at least one token")
    params = one_sample_params(request.sampling_params, "Generate")
    engine.prefetch_prefix(prompt, params)  # the kvstore's answer comes while we compile and queue
    try:
        await compile_constraint(engine, params, "Generate")  # off the engine loop
    except InvalidArgument:
        if on_added is not None:
            on_added()  # refused: no longer pending
        raise
    try:
        queue = engine.subscribe(request_id)
    except ValueError as exc:
        raise AlreadyExists(f"Generate: {exc}") from exc
    stream = OutputStream(engine, request_id, queue)
    # add_request as queued on the engine thread: applied even if this call is cancelled while
    # waiting, so the cleanup waits for it before aborting.
    adding = asyncio.ensure_future(
        engine.call(lambda core: core.add_request(request_id, prompt, params, resumed)))
    try:
        try:
            await asyncio.shield(adding)
        except ValueError as exc:
            raise invalid_argument("Generate", exc) from exc
        finally:
            if on_added is not None:
                on_added()
        taken_at = time.monotonic()
        is_first = True

        def on_output(output: RequestOutput, response: worker_pb2.DecodeResponse) -> None:
            nonlocal is_first  # the first response with a token (or the end) carries the TTFT stages
            if is_first and (output.new_token_ids or output.finished):
                response.num_cached_prompt_tokens = output.num_cached_tokens
                response.stages.CopyFrom(ttft_stages_to_proto({
                    "prefill_queue": taken_at - arrived_at,
                    "prefill_compute": time.monotonic() - taken_at}))
                counters.add(len(prompt), output.num_cached_tokens)
                is_first = False

        await stream.write_all(context, on_output)
    except EngineDead as exc:
        raise Unavailable(str(exc)) from exc
    finally:
        engine.unsubscribe(request_id)
        if not stream.finished:
            task = asyncio.ensure_future(_abort_when_added(engine, adding, request_id))
            _CLEANUPS.add(task)
            task.add_done_callback(_CLEANUPS.discard)


_CLEANUPS: set[asyncio.Future[None]] = set()  # strong references until each cleanup ran


async def _abort_when_added(engine: AsyncEngine, adding: asyncio.Future[list[str]],
                            request_id: str) -> None:
    """Abort ``request_id`` once its add_request went through (no-op if it failed)."""
    try:
        await adding
        if engine.is_alive:
            await engine.call(lambda core: core.abort_request(request_id))
    except (ValueError, EngineDead):
        pass
