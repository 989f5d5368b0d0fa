"""The router's gRPC frontend: GenerateService.Generate over the shared Frontend pipeline.

Status codes: INVALID_ARGUMENT for bad input (the message names the field, and so does the
trailing metadata ``pdserve-invalid-param``), NOT_FOUND for an unknown model (as
generate.proto documents), RESOURCE_EXHAUSTED when the router's queue or every worker is full
(trailing metadata ``retry-after``: seconds), UNAVAILABLE while starting or draining or with
no healthy worker, DEADLINE_EXCEEDED when the call's deadline passes, INTERNAL when the
backend fails mid-request. The call's deadline is the request's: worker calls carry the time
left. A client's cancel or an expired deadline cancels the handler, which closes the
Generation and so aborts the request in the backend. Requests arrive as bytes
(``add_generate_servicer``) so that one protobuf cannot parse (a string that is not UTF-8) is
INVALID_ARGUMENT too, not grpc's generic INTERNAL "Exception deserializing request!". In
colocated mode the router also serves WorkerService.GetStats (block pool and queue sizes of
its engine, and its engine settings).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import finish_to_proto, logprobs_list_to_proto, params_from_proto
from services.router.backend import BackendError, Overloaded, Unavailable
from services.router.errors import InvalidRequest, RequestTimeout
from services.router.frontend import Frontend, RouterState, SampleDelta, debug_headers

log = logging.getLogger(__name__)
INVALID_PARAM_KEY = "pdserve-invalid-param"  # trailing metadata: the field an INVALID_ARGUMENT names
RETRY_AFTER_KEY = "retry-after"  # trailing metadata of RESOURCE_EXHAUSTED: whole seconds


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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid GenerateRequest ({error}); strings "
                                "must be UTF-8")
        async for response in self.Generate(request, context):
            yield response

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        arrived_at = time.monotonic()
        frontend = self.state.frontend
        if frontend is None or self.state.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is starting up or shutting down")
        if request.model and request.model != frontend.model.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} does not exist; "
                                f"this server serves {frontend.model.name!r}")
        time_left = context.time_remaining()
        deadline = None if time_left is None else arrived_at + time_left
        generation = None
        try:
            prompt_ids = _tokenize(frontend, request)
            params = frontend.check(prompt_ids, params_from_proto(request.sampling_params),
                                    "messages" if request.WhichOneof("input") == "chat" else "prompt")
            generation = frontend.generate(prompt_ids, params, arrived_at=arrived_at, deadline=deadline)
            await generation.start()
        except ValueError as error:  # InvalidRequest, or the backend's verdict
            self.state.metrics.reject("invalid", was_counted=not isinstance(error, InvalidRequest))
            if isinstance(error, InvalidRequest) and error.param:
                context.set_trailing_metadata(((INVALID_PARAM_KEY, error.param),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Unavailable as error:
            self.state.metrics.reject("overload", was_counted=generation is not None)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except Overloaded as error:
            self.state.metrics.reject("overload", was_counted=generation is not None)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(math.ceil(error.retry_after_s), 1))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except RequestTimeout as error:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
        except BackendError as error:
            await context.abort(grpc.StatusCode.INTERNAL, str(error))

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
        except RequestTimeout as error:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
        except BackendError as error:
            log.warning("request %s failed in the backend: %s", request_id, error)
            await context.abort(grpc.StatusCode.INTERNAL, str(error))
        finally:  # also on cancel / deadline: abort the request in the backend
            await generation.aclose()


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
