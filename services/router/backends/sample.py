"""One sample of a request, as every path of the disaggregated backend sends it.

    sample = Sample.create(request_id, prompt, params.for_sample(i), i)   # params -> protobuf once
    PrefillRequest(sampling_params=sample.wire_params, ...)               # remote path
    GenerateLocalRequest(sampling_params=sample.wire_params, ...)         # local path
    GenerateLocalRequest(sampling_params=sample.resumed_wire_params(), ...)  # a migration's resume

The SamplingParams stay beside their protobuf for what the router itself reads (the prefix
hash's extra keys, whether prompt logprobs were asked for); nothing converts them again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2
from services.common.wire import params_to_proto


@dataclass(frozen=True, slots=True)
class Sample:
    """``params`` are this sample's own (n = 1, seed + index); ``wire_params`` their protobuf.
    ``index`` is the sample's place among the request's n (its TokenEvents carry it)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    index: int
    wire_params: generate_pb2.SamplingParams

    @classmethod
    def create(cls, request_id: str, prompt: list[int], params: SamplingParams, index: int) -> Sample:
        """ValueError when ``params`` cannot be sent to a worker (services/common/wire.py)."""
        return cls(request_id, prompt, params, index, params_to_proto(params))

    def renamed(self, request_id: str) -> Sample:
        """The same sample under another id (a migration's attempt: ``<id>~m<k>``)."""
        return dataclasses.replace(self, request_id=request_id)

    def resumed_wire_params(self) -> generate_pb2.SamplingParams:
        """``wire_params`` for resuming after streamed tokens: without prompt logprobs (the
        client had them with the first token)."""
        params = generate_pb2.SamplingParams()
        params.CopyFrom(self.wire_params)
        params.ClearField("prompt_logprobs")
        return params

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
