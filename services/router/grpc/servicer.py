"""The router's gRPC frontend: GenerateService.Generate over the shared Frontend pipeline.

Status codes (grpc/status.py maps each of the router's errors once): INVALID_ARGUMENT for bad
input (the message names the field, and so does the trailing metadata
``pdserve-invalid-param``), NOT_FOUND for an unknown model (as generate.proto documents),
RESOURCE_EXHAUSTED when the router's queue or every worker is full (trailing metadata
``retry-after``: seconds), UNAVAILABLE while starting or draining or with no healthy worker,
DEADLINE_EXCEEDED when the call's deadline passes, INTERNAL when the backend fails
mid-request. The call's deadline is the request's: worker calls carry the time
left. A client's cancel or an expired deadline cancels the handler, which closes the
Generation and so aborts the request in the backend. Requests arrive as bytes
(``add_generate_servicer``) so that one protobuf cannot parse (a string that is not UTF-8) is
INVALID_ARGUMENT too, not grpc's generic INTERNAL "Exception deserializing request!". In
colocated mode the router also serves WorkerService.GetStats (block pool and queue sizes of
its engine, and its engine settings).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import finish_to_proto, logprobs_list_to_proto, params_from_proto
from services.router.errors import (
    BackendError,
    InvalidRequest,
    ModelNotFound,
    NotServing,
    Overloaded,
    RefusedByBackend,
)
from services.router.grpc.status import MAPPED, abort_with
from services.router.pipeline.debug_route import debug_headers
from services.router.pipeline.frontend import Frontend, RouterState
from services.router.pipeline.generation import Generation, SampleDelta

log = logging.getLogger(__name__)


def add_generate_servicer(servicer: GenerateServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as pdserve.v1.GenerateService, parsing requests itself."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.generate_raw, request_deserializer=None,
        response_serializer=generate_pb2.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "pdserve.v1.GenerateService", {"Generate": handler}),))


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def generate_raw(self, raw: bytes, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """``Generate`` of the serialized request: one that does not parse is INVALID_ARGUMENT."""
        try:
            request = generate_pb2.GenerateRequest.FromString(raw)
        except DecodeError as error:
            self.state.metrics.reject("invalid")
            await abort_with(context, InvalidRequest(f"the request is not a valid GenerateRequest "
                                                     f"({error}); strings must be UTF-8"))
        async for response in self.Generate(request, context):
            yield response

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        arrived_at = time.monotonic()
        frontend = self.state.frontend
        if frontend is None or self.state.is_draining:  # neither is counted as a rejection
            await abort_with(context, NotServing("the router is starting up or shutting down"))
        try:
            frontend.check_model(request.model or None)  # proto3: "" is not given
        except ModelNotFound as error:
            await abort_with(context, error)
        time_left = context.time_remaining()
        deadline = None if time_left is None else arrived_at + time_left
        generation = await self._start(frontend, request, context, arrived_at, deadline)
        request_id = request.request_id or generation.request_id
        if self.state.debug_route:
            context.set_trailing_metadata(debug_headers(generation))
        try:
            async for delta in generation:
                response = _response(request_id, delta, frontend)
                if generation.is_finished:
                    usage = generation.usage
                    response.usage.CopyFrom(generate_pb2.Usage(
                        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                        cached_prompt_tokens=usage.cached_tokens))
                yield response
        except BackendError as error:  # RequestTimeout too
            log.warning("request %s failed in the backend: %s", request_id, error)
            await abort_with(context, error)
        finally:  # also on cancel / deadline: abort the request in the backend
            await generation.aclose()

    async def _start(self, frontend: Frontend, request: generate_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext, arrived_at: float,
                     deadline: float | None) -> Generation:
        """The request, validated and started (its first event back); a refusal aborts the
        call with its status, counted as rejected."""
        generation = None
        try:
            prompt_ids = _tokenize(frontend, request)
            params = frontend.check(prompt_ids, params_from_proto(request.sampling_params),
                                    "messages" if request.WhichOneof("input") == "chat" else "prompt")
            await frontend.check_constraint(params)
            generation = frontend.generate(prompt_ids, params, arrived_at=arrived_at, deadline=deadline)
            await generation.start()
            return generation
        except MAPPED as error:
            if isinstance(error, ValueError):  # InvalidRequest, or the backend's verdict
                self.state.metrics.reject("invalid", was_counted=not isinstance(error, InvalidRequest)
                                          or isinstance(error, RefusedByBackend))
            elif isinstance(error, Overloaded):
                self.state.metrics.reject("overload", was_counted=generation is not None)
            await abort_with(context, error)


def _tokenize(frontend: Frontend, request: generate_pb2.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return frontend.tokenize(prompt=request.prompt)
    if kind == "prompt_token_ids":
        return frontend.tokenize(prompt=list(request.prompt_token_ids.ids))
    if kind == "chat":
        chat = request.chat
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return frontend.tokenize(messages=messages, add_generation_prompt=add_generation_prompt)
    raise InvalidRequest("one of prompt, prompt_token_ids or chat is required", "input")


def _response(request_id: str, delta: SampleDelta, frontend: Frontend) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=request_id, index=delta.index, text=delta.text, token_ids=delta.token_ids,
        finish_reason=finish_to_proto(delta.finish_reason))

    def decode(token_id: int) -> str:
        return frontend.tokenizer.decode([token_id], skip_special_tokens=False)

    response.logprobs.extend(logprobs_list_to_proto(delta.logprobs, decode))
    # Position 0 has no logprobs (nothing predicts it): an empty entry keeps positions aligned.
    response.prompt_logprobs.extend(logprobs_list_to_proto(delta.prompt_logprobs, decode))
    if isinstance(delta.stop_reason, str):
        response.stop_str = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        response.stop_token_id = delta.stop_reason
    return response
