"""The wire: every protobuf <-> engine conversion, the gRPC service names and metadata keys, once.

Torch-free at import (the router uses it). ``None`` and "unset" line up with generate.proto's
``optional`` fields: an unset ``max_tokens`` is ``None`` (until the context is full), an unset
``n`` is 1, and so on; an empty ``allowed_token_ids`` / ``bad_words`` /
``bad_words_token_ids`` is ``None``.

Floats travel as proto ``float`` (32 bits). They are read back as the shortest decimal that
rounds to the same float32 — the number the user wrote (0.1 stays 0.1, not 0.10000000149) —
so a worker samples exactly as an offline engine given the same parameters.

Logprobs: a :class:`PositionLogprobs` becomes ``PositionLogprobs{sampled, top}`` with ranks
1.. for the top entries; a ``None`` entry (prompt position 0, which nothing predicts) is sent
as an empty message (no ``sampled``) and read back as ``None``.

A structured-output constraint travels as ``StructuredOutputs`` (a schema as JSON text), with
the request field it came from, so a worker's refusal names the field the client wrote.

The KV handshake (:class:`KVHandshake`) travels as kv.proto's ``KVHandshake``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from google.protobuf.descriptor import FileDescriptor

from engine.kv_cache.events import Tier
from engine.kv_transfer.base import KVCompat, KVHandshake, KVRegion
from engine.sampling_params import SamplingParams
from engine.stats import TierStats
from engine.structured.params import StructuredOutputsParams
from services.common.pb import generate_pb2, kv_pb2, worker_pb2

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not at import
    from engine.sampling.logprobs import PositionLogprobs
    from engine.scheduler.output import RequestOutput


def _service(file_descriptor: FileDescriptor, name: str) -> str:
    full_name: str = file_descriptor.services_by_name[name].full_name
    return full_name


GENERATE_SERVICE_NAME = _service(generate_pb2.DESCRIPTOR, "GenerateService")
PREFILL_SERVICE_NAME = _service(worker_pb2.DESCRIPTOR, "PrefillService")
DECODE_SERVICE_NAME = _service(worker_pb2.DESCRIPTOR, "DecodeService")
WORKER_SERVICE_NAME = _service(worker_pb2.DESCRIPTOR, "WorkerService")
KV_SERVICE_NAME = _service(kv_pb2.DESCRIPTOR, "KVTransferService")
# Trailing metadata of a Prefill error that the decode worker caused (value: "decode"), so the
# router picks another decode worker.
FAILED_PEER_KEY = "pdserve-failed-peer"
# Trailing metadata of a RESOURCE_EXHAUSTED that means "no free KV blocks right now" (value "1"),
# as opposed to a full request queue: blocks free up as running requests finish, so the router
# waits and retries instead of refusing (a prefill worker passes it on from ReserveBlocks).
KV_FULL_KEY = "pdserve-kv-full"
# Trailing metadata of a RESOURCE_EXHAUSTED that says when to try again (whole seconds >= 1), as
# HTTP's Retry-After header: the router's answer to a client when it is full.
RETRY_AFTER_KEY = "retry-after"
# Trailing metadata of an INVALID_ARGUMENT that names the client's request field at fault (value:
# the field, e.g. "response_format.json_schema"): the router's 400 names it as its ``param``.
INVALID_PARAM_KEY = "pdserve-invalid-param"

# --transfer names <-> KVTransferMethod
NIXL = worker_pb2.KV_TRANSFER_METHOD_NIXL
GRPC = worker_pb2.KV_TRANSFER_METHOD_GRPC
TRANSFER_METHODS = {"nixl": NIXL, "grpc": GRPC}
TRANSFERS = tuple(TRANSFER_METHODS)  # --transfer's choices: the KV transport between workers
METHOD_NAMES = {value: name for name, value in TRANSFER_METHODS.items()}


def transfer_methods(transfer: str) -> list[worker_pb2.KVTransferMethod]:
    """The methods a worker started with ``--transfer`` serves, preferred first."""
    return [NIXL, GRPC] if transfer == "nixl" else [GRPC]


_MASK64 = (1 << 64) - 1
_FINISH_TO_PROTO = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
    "error": generate_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, str | None] = {
    generate_pb2.FINISH_REASON_UNSPECIFIED: None,
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}
# optional fields whose names match SamplingParams
_OPTIONAL_SCALARS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                     "cache_salt")
_FLOATS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty"}
_FLOAT32 = struct.Struct("<f")
_MEM_TYPES = {"DRAM": kv_pb2.MEMORY_TYPE_DRAM, "VRAM": kv_pb2.MEMORY_TYPE_VRAM}
_MEM_NAMES = {v: k for k, v in _MEM_TYPES.items()}


def shortest_float32(value: float) -> float:
    """The shortest decimal (as a Python float) that rounds to the same float32 as ``value``."""
    target = _FLOAT32.pack(value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        candidate = float(f"{value:.{digits}g}")
        if _FLOAT32.pack(candidate) == target:
            return candidate
    return value


# ---- sampling params -----------------------------------------------------------------------

def params_to_proto(params: SamplingParams) -> generate_pb2.SamplingParams:
    """Every field the engine uses; ``logprobs_mode`` other than 'processed' is not on the wire
    yet (ValueError rather than a silent change)."""
    if params.logprobs_mode != "processed":
        raise ValueError(f"logprobs_mode={params.logprobs_mode!r} cannot be sent to a worker yet")
    msg = generate_pb2.SamplingParams(
        n=params.n, min_tokens=params.min_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos)
    for name in (*_OPTIONAL_SCALARS, "max_tokens", "logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    if params.seed is not None:
        msg.seed = params.seed & _MASK64  # negative seeds: same 64 bits, as the sampler masks
    if params.logit_bias:
        msg.logit_bias.update({int(k): float(v) for k, v in params.logit_bias.items()})
    if params.allowed_token_ids is not None:
        msg.allowed_token_ids.extend(params.allowed_token_ids)
    if params.bad_words:
        msg.bad_words.extend(params.bad_words)
    for sequence in params.bad_words_token_ids or ():
        msg.bad_words_token_ids.add(ids=sequence)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    return msg


def params_from_proto(msg: generate_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; values are checked later by the engine (ValueError).
    ``spaces_between_special_tokens`` is accepted and ignored (the tokenizer has no such
    switch)."""
    kwargs: dict[str, Any] = {  # SamplingParams' keyword arguments
        "n": msg.n if msg.HasField("n") else 1,
        "max_tokens": msg.max_tokens if msg.HasField("max_tokens") else None,
        "min_tokens": msg.min_tokens,
        "stop": list(msg.stop),
        "stop_token_ids": list(msg.stop_token_ids),
        "include_stop_str_in_output": msg.include_stop_str_in_output,
        "ignore_eos": msg.ignore_eos,
        "logit_bias": {k: shortest_float32(v) for k, v in msg.logit_bias.items()} or None,
        "allowed_token_ids": list(msg.allowed_token_ids) or None,
        "bad_words": list(msg.bad_words) or None,
        "bad_words_token_ids": [list(s.ids) for s in msg.bad_words_token_ids] or None,
    }
    for name in (*_OPTIONAL_SCALARS, "seed", "logprobs", "prompt_logprobs"):
        if msg.HasField(name):
            value = getattr(msg, name)
            kwargs[name] = shortest_float32(value) if name in _FLOATS else value
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    return SamplingParams(**kwargs)


def structured_to_proto(so: StructuredOutputsParams) -> generate_pb2.StructuredOutputs:
    """The constraint as sent to a worker: a schema as its compact JSON text (``so.source``,
    properties in their order), the request field it came from so the worker's errors name it.
    ValueError (StructuredOutputError) for a constraint with no kind or a schema that is not JSON."""
    so.validate()
    msg = generate_pb2.StructuredOutputs(strict=so.strict, field=so.field or "")
    kind = so.kind
    if kind == "json":
        msg.json = so.source
    elif kind == "choice":
        msg.choice.choices.extend(so.choice or ())
    else:
        setattr(msg, kind, getattr(so, kind))
    return msg


def structured_from_proto(msg: generate_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """No kind set reads as a constraint with none, which the engine refuses naming the field."""
    kind = msg.WhichOneof("kind")
    kwargs: dict[str, Any] = {"strict": msg.strict if msg.HasField("strict") else True,
                                 "field": msg.field or None}
    if kind == "choice":
        kwargs["choice"] = list(msg.choice.choices)
    elif kind is not None:
        kwargs[kind] = getattr(msg, kind)
    return StructuredOutputsParams(**kwargs)


# ---- finish reasons and logprobs -----------------------------------------------------------

def finish_to_proto(reason: str | None) -> generate_pb2.FinishReason:
    """'error' travels as ABORT (the wire has no separate code)."""
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> str | None:
    """An unknown code reads as 'abort'."""
    return _FINISH_FROM_PROTO.get(value, "abort")


def logprobs_to_proto(entry: PositionLogprobs | None,
                      decode: Callable[[int], str] | None = None) -> generate_pb2.PositionLogprobs:
    """``decode(token_id)`` fills ``TokenLogprob.token`` (the public API); None leaves it empty."""
    if entry is None:
        return generate_pb2.PositionLogprobs()

    def token(token_id: int, logprob: float, rank: int) -> generate_pb2.TokenLogprob:
        return generate_pb2.TokenLogprob(token_id=token_id, logprob=logprob, rank=rank,
                                         token=decode(token_id) if decode is not None else "")

    return generate_pb2.PositionLogprobs(
        sampled=token(entry.token_id, entry.logprob, entry.rank),
        top=[token(t, lp, rank) for rank, (t, lp) in enumerate(entry.top, 1)])


def logprobs_from_proto(msg: generate_pb2.PositionLogprobs) -> PositionLogprobs | None:
    if not msg.HasField("sampled"):
        return None
    from engine.sampling.logprobs import PositionLogprobs  # only when logprobs were asked for
    return PositionLogprobs(msg.sampled.token_id, msg.sampled.logprob, msg.sampled.rank,
                            [(t.token_id, t.logprob) for t in msg.top])


def logprobs_list_to_proto(entries: Sequence[PositionLogprobs | None] | None,
                           decode: Callable[[int], str] | None = None
                           ) -> list[generate_pb2.PositionLogprobs]:
    return [logprobs_to_proto(e, decode) for e in entries or ()]


def logprobs_list_from_proto(msgs: Sequence[generate_pb2.PositionLogprobs]
                             ) -> list[PositionLogprobs | None] | None:
    """None for an empty list (nothing was asked for)."""
    return [logprobs_from_proto(m) for m in msgs] or None


# ---- the KV handshake ----------------------------------------------------------------------

def compat_to_proto(c: KVCompat) -> kv_pb2.KVCompat:
    return kv_pb2.KVCompat(model_name=c.model_name, dtype=c.dtype, block_size=c.block_size,
                           num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, layout_version=c.layout_version)


def compat_from_proto(c: kv_pb2.KVCompat) -> KVCompat:
    return KVCompat(model_name=c.model_name, dtype=c.dtype, block_size=c.block_size,
                    num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                    layout_version=c.layout_version)


def handshake_to_proto(h: KVHandshake) -> kv_pb2.KVHandshake:
    c, r = h.compat, h.region
    return kv_pb2.KVHandshake(
        wire_version=h.wire_version,
        compat=kv_pb2.KVCompat(model_name=c.model_name, dtype=c.dtype, block_size=c.block_size,
                               num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, layout_version=c.layout_version),
        compat_hash=c.hash, agent_name=h.agent_name, agent_metadata=h.agent_metadata,
        region=kv_pb2.KVRegion(mem_type=_MEM_TYPES[r.mem_type], base_addr=r.base_addr,
                               device_id=r.device_id, num_blocks=r.num_blocks,
                               block_bytes=r.block_bytes),
        shm_probe=h.shm_probe)


def handshake_from_proto(msg: kv_pb2.KVHandshake) -> KVHandshake:
    c, r = msg.compat, msg.region
    return KVHandshake(
        wire_version=msg.wire_version,
        compat=KVCompat(model_name=c.model_name, dtype=c.dtype, block_size=c.block_size,
                        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim, layout_version=c.layout_version),
        agent_name=msg.agent_name, agent_metadata=msg.agent_metadata,
        region=KVRegion(mem_type=_MEM_NAMES.get(r.mem_type, "DRAM"), base_addr=r.base_addr,
                        device_id=r.device_id, num_blocks=r.num_blocks,
                        block_bytes=r.block_bytes),
        shm_probe=msg.shm_probe)


# ---- prefix-cache tiers in WorkerStats ------------------------------------------------------

_TIER_FIELDS = ("num_blocks", "num_cached_blocks", "num_queried_blocks", "num_hit_blocks", "num_hit_tokens",
                "num_stored_blocks", "num_evicted_blocks", "num_load_failures", "num_loaded_bytes",
                "num_offloaded_bytes")


def tier_stats_to_proto(tiers: Sequence[TierStats]) -> list[worker_pb2.TierStats]:
    """``EngineStats.tiers`` as ``WorkerStats.tiers`` (CacheTier values equal ``Tier``'s)."""
    # cast: protoc's .pyi types an enum field as its enum class; on the wire it is the int itself
    return [worker_pb2.TierStats(tier=cast(worker_pb2.CacheTier, int(t.tier)),
                                 **{f: getattr(t, f) for f in _TIER_FIELDS}) for t in tiers]


def tier_stats_from_proto(tiers: Sequence[worker_pb2.TierStats]) -> list[TierStats]:
    """``WorkerStats.tiers`` back as ``TierStats``; ValueError for an unknown tier."""
    out = []
    for t in tiers:
        try:
            tier = Tier(t.tier)
        except ValueError:
            raise ValueError(f"WorkerStats.tiers: unknown tier {t.tier}") from None
        if tier not in (Tier.DEVICE, Tier.HOST, Tier.KVSTORE):
            raise ValueError(f"WorkerStats.tiers: tier must be one of DEVICE, HOST, KVSTORE, got {t.tier}")
        out.append(TierStats(tier, *(getattr(t, f) for f in _TIER_FIELDS)))
    return out


def decode_response(request_id: str, output: RequestOutput) -> worker_pb2.DecodeResponse:
    """One engine output of a decode worker's request as the DecodeResponse the router reads."""
    response = worker_pb2.DecodeResponse(
        request_id=request_id, token_ids=output.new_token_ids,
        logprobs=logprobs_list_to_proto(output.new_logprobs),
        finish_reason=finish_to_proto(output.finish_reason))
    if isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason
    return response


# ---- TTFT stages (pdserve_ttft_stage_seconds) -----------------------------------------------

# stage name (services/router/metrics.py STAGES) <-> TtftStages field: the worker's stages
TTFT_STAGE_FIELDS = {"decode_admit": "decode_admit_s", "prefill_queue": "prefill_queue_s",
                     "prefill_compute": "prefill_compute_s", "kv_transfer": "kv_transfer_s"}


def ttft_stages_to_proto(stages: dict[str, float]) -> worker_pb2.TtftStages:
    """``{stage: seconds}`` of the stages a request passed on a worker; ValueError for a stage
    a worker does not time."""
    unknown = set(stages) - TTFT_STAGE_FIELDS.keys()
    if unknown:
        raise ValueError(f"TtftStages: {sorted(unknown)} are not worker stages {sorted(TTFT_STAGE_FIELDS)}")
    return worker_pb2.TtftStages(**{TTFT_STAGE_FIELDS[s]: max(v, 0.0) for s, v in stages.items()})


def ttft_stages_from_proto(msg: worker_pb2.TtftStages) -> dict[str, float]:
    """The stages set in ``msg`` (an unset field: a stage the request did not pass)."""
    return {stage: getattr(msg, f) for stage, f in TTFT_STAGE_FIELDS.items() if msg.HasField(f)}
