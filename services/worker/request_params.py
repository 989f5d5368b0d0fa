"""A worker's sampling parameters from the wire, checked once for every RPC that takes them."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.structured.errors import StructuredOutputError
from services.common.async_engine import AsyncEngine
from services.common.errors import InvalidArgument
from services.common.pb import generate_pb2
from services.common.wire import params_from_proto


def one_sample_params(proto: generate_pb2.SamplingParams, rpc: str) -> SamplingParams:
    """``proto`` as SamplingParams for one sample; InvalidArgument naming ``rpc`` for a bad
    value or n > 1 (the router sends n samples as n requests)."""
    try:
        params = params_from_proto(proto)
    except ValueError as exc:
        raise InvalidArgument(f"{rpc}: {exc}") from exc
    if params.n != 1:
        raise InvalidArgument(f"{rpc}: n={params.n}; a worker request carries one sample, the "
                              "router sends n > 1 as n requests")
    return params


async def compile_constraint(engine: AsyncEngine, params: SamplingParams, rpc: str) -> None:
    """Compile ``params``' structured-output constraint off the engine loop
    (``AsyncEngine.compile_constraint``); InvalidArgument naming ``rpc`` and the request field
    when it is malformed, does not compile, or does not compile in time."""
    try:
        await engine.compile_constraint(params)
    except ValueError as exc:
        raise invalid_argument(rpc, exc) from exc


def invalid_argument(rpc: str, exc: ValueError) -> InvalidArgument:
    """The engine's verdict on bad input as InvalidArgument naming ``rpc``; a refused
    structured-output constraint (StructuredOutputError) also names its request field as the
    ``param`` (sent as trailing metadata, so the router's 400 names it without reading text)."""
    param = exc.field if isinstance(exc, StructuredOutputError) else ""
    return InvalidArgument(f"{rpc}: {exc}", param=param)
