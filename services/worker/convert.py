"""Protobuf <-> engine dataclasses for the worker RPCs (worker.proto), converted once at the edge.

Torch-free: the router imports it too. ``None`` and "unset" line up with generate.proto's
``optional`` fields: an unset ``max_tokens`` is ``None`` (until the context is full), an unset
``n`` is 1, and so on; an empty ``allowed_token_ids`` / ``bad_words`` is ``None``.

Floats travel as proto ``float`` (32 bits). They are read back as the shortest decimal that
rounds to the same float32 — the number the user wrote (0.1 stays 0.1, not 0.10000000149) —
so a worker samples exactly as an offline engine given the same parameters.

Logprobs: a :class:`PositionLogprobs` becomes ``PositionLogprobs{sampled, top}`` with ranks
1.. for the top entries; a ``None`` entry (prompt position 0, which nothing predicts) is sent
as an empty message (no ``sampled``) and read back as ``None``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not at import
    from engine.sampling.logprobs import PositionLogprobs

_MASK64 = (1 << 64) - 1
_FINISH_TO_PROTO = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
    "error": generate_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {
    generate_pb2.FINISH_REASON_UNSPECIFIED: None,
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}
# optional scalar fields whose names match SamplingParams
_OPTIONAL_SCALARS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "skip_special_tokens")
_FLOATS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty"}
_FLOAT32 = struct.Struct("<f")


def shortest_float32(value: float) -> float:
    """The shortest decimal (as a Python float) that rounds to the same float32 as ``value``."""
    target = _FLOAT32.pack(value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        candidate = float(f"{value:.{digits}g}")
        if _FLOAT32.pack(candidate) == target:
            return candidate
    return value


def params_to_proto(params: SamplingParams) -> generate_pb2.SamplingParams:
    """Every field the engine uses; ``logprobs_mode`` other than 'processed' is not on the
    wire yet (ValueError rather than a silent change)."""
    if params.logprobs_mode != "processed":
        raise ValueError(f"logprobs_mode={params.logprobs_mode!r} cannot be sent to a worker yet")
    msg = generate_pb2.SamplingParams(
        n=params.n, min_tokens=params.min_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos)
    for name in _OPTIONAL_SCALARS:
        setattr(msg, name, getattr(params, name))
    for name in ("max_tokens", "logprobs", "prompt_logprobs"):
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
    return msg


def params_from_proto(msg: generate_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; values are checked later by the engine (ValueError)."""
    kwargs: dict[str, object] = {
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
    }
    for name in (*_OPTIONAL_SCALARS, "seed", "logprobs", "prompt_logprobs"):
        if msg.HasField(name):
            value = getattr(msg, name)
            kwargs[name] = shortest_float32(value) if name in _FLOATS else value
    return SamplingParams(**kwargs)


def logprobs_to_proto(entry: PositionLogprobs | None) -> generate_pb2.PositionLogprobs:
    if entry is None:
        return generate_pb2.PositionLogprobs()
    return generate_pb2.PositionLogprobs(
        sampled=generate_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob,
                                          rank=entry.rank),
        top=[generate_pb2.TokenLogprob(token_id=t, logprob=lp, rank=i + 1)
             for i, (t, lp) in enumerate(entry.top)])


def logprobs_from_proto(msg: generate_pb2.PositionLogprobs) -> PositionLogprobs | None:
    if not msg.HasField("sampled"):
        return None
    from engine.sampling.logprobs import PositionLogprobs  # only when logprobs were asked for
    return PositionLogprobs(msg.sampled.token_id, msg.sampled.logprob, msg.sampled.rank,
                            [(t.token_id, t.logprob) for t in msg.top])


def logprobs_list_to_proto(entries: Sequence[PositionLogprobs | None] | None
                           ) -> list[generate_pb2.PositionLogprobs]:
    return [logprobs_to_proto(e) for e in entries or ()]


def logprobs_list_from_proto(msgs: Sequence[generate_pb2.PositionLogprobs]
                             ) -> list[PositionLogprobs | None] | None:
    """None for an empty list (nothing was asked for)."""
    return [logprobs_from_proto(m) for m in msgs] or None


def finish_to_proto(reason: str | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PROTO.get(value, "abort")
