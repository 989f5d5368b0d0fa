"""Which block format serves each matmul weight, for ``--weight-format auto|fp32|q8_0|q4``.

    plan = plan_quantized(config, weights, stored, "q4")   # name -> QuantRows, or None for fp32

``stored`` holds the GGUF file's own blocks (``gguf_loader.gguf_blocks``: Q8_0, Q4_0/Q4_1,
Q5_0/Q5_1, Q4_K, Q6_K tensors, HF-named, Q/K rows in HF order); ``weights`` the same model
dequantized to fp32. The plan covers every layer matmul weight and the LM head (``HEAD``; the
embedding's blocks when the embedding is tied). Formats:

    fp32   no plan: the fp32 weights, as before
    q8_0   every weight in Q8_0: stored Q8_0 blocks as they are, the rest quantized from fp32
    q4     layer weights 4-bit: stored Q4_0/Q4_1/Q4_K blocks as they are, the rest quantized to
           Q4_1; the head keeps stored blocks of any format (a Q4_1 file's Q8_0 head, as
           llama.cpp reads it), else Q8_0
    auto   the file's own blocks where it has them (others quantized to Q8_0); fp32 when the
           model has no blocks at all (an HF directory, an F32/F16 file) or the activations
           are not float32 (the kernels compute in fp32)

The model fuses q/k/v and gate/up into one matmul each, which needs one kernel layout per group
(``kernels.quant.kernel_format``: Q4_0 and Q4_1 share one, Q5_0 and Q5_1 another). A group whose stored blocks differ
(a Q4_K_M file's Q6_K v beside Q4_K q and k) is quantized from fp32 as a whole, to the
format's target (Q4_1 for q4, else Q8_0). Under q4 a Q5 or Q6_K layer weight is quantized to
Q4_1 (q4 means 4-bit layers); the head keeps any stored format.

Quantizing from fp32 rounds as llama.cpp's reference quantizer does (``kernels.quant.quantize``);
a weight taken as stored keeps the file's exact values, so q4 on a Q4_1 file computes with the
very values HF's GGUF loader dequantizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from engine.config import WEIGHT_FORMATS, ModelConfig
from kernels.quant import QuantRows, kernel_format, quantize

log = logging.getLogger(__name__)

HEAD = "lm_head.weight"
_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def linear_weight_names(config: ModelConfig) -> list[str]:
    """Every layer's matmul weights (HF names), in layer order."""
    return [f"model.layers.{i}.{name}.weight" for i in range(config.num_layers) for name in _LAYER_LINEARS]


def plan_quantized(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                   stored: Mapping[str, QuantRows], weight_format: str,
                   dtype: str = "float32") -> dict[str, QuantRows] | None:
    """name -> blocks for every layer matmul and ``HEAD``, or None to serve fp32 weights.
    ValueError for an unknown format, or q8_0/q4 with a ``dtype`` other than float32."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {'|'.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format in ("q8_0", "q4") and dtype != "float32":
        raise ValueError(f"weight_format {weight_format} needs dtype float32, got {dtype}")
    if weight_format == "fp32" or (weight_format == "auto" and (not stored or dtype != "float32")):
        return None
    head_source = HEAD if HEAD in weights else "model.embed_tokens.weight"
    plan: dict[str, QuantRows] = {}
    requantized = []
    for name in [*linear_weight_names(config), HEAD]:
        source = head_source if name == HEAD else name
        rows = stored.get(source)
        keep = _keeps(weight_format, rows, is_head=name == HEAD)
        if rows is not None and keep:
            plan[name] = rows
            continue
        plan[name] = quantize(weights[source], _target(weight_format, name))
        requantized.append(name)
    for i in range(config.num_layers):
        for group in _FUSED:
            names = [f"model.layers.{i}.{part}.weight" for part in group]
            if len({kernel_format(plan[n].format) for n in names}) > 1:
                for n in names:
                    plan[n] = quantize(weights[n], _target(weight_format, n))
                    requantized.append(n)
    if requantized:
        log.info("weight format %s: %d of %d matmul weights quantized from fp32 (e.g. %s)",
                 weight_format, len(set(requantized)), len(plan), requantized[0])
    return plan


def _target(weight_format: str, name: str) -> str:
    """The format a weight without usable stored blocks is quantized to."""
    return "q4_1" if weight_format == "q4" and name != HEAD else "q8_0"


def _keeps(weight_format: str, rows: QuantRows | None, is_head: bool) -> bool:
    """Whether stored blocks ``rows`` serve as they are under ``weight_format``."""
    if rows is None:
        return False
    if weight_format == "auto" or (weight_format == "q4" and is_head):
        return True
    if weight_format == "q8_0":
        return rows.format == "q8_0"
    return rows.format in ("q4_0", "q4_1", "q4_k")


def plan_bytes(plan: Mapping[str, QuantRows]) -> int:
    """Bytes of the planned blocks: what one forward step streams for its matmuls."""
    return sum(rows.nbytes for rows in plan.values())
