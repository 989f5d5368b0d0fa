"""The decoder layers in one compiled call (``csrc/decoder_stack.cpp``), for short steps.

    stack = build(model)          # None unless every layer matmul is a compiled quantized weight
    hidden = stack.forward(embedded, positions, attn, kv_cache, num_layers=None)

``forward`` makes the calls ``engine.models.llama.LlamaForCausalLM.forward`` makes with the
compiled ops (``kernels.cpu.elementwise``, ``kernels.cpu.attention``, ``kernels.quant_cpu``), in
the same order on the same arguments, from C++: the same bits, without ~300 Python calls per
batch-1 decode step. It serves steps whose longest query the compiled attention takes itself
(``kernels.cpu.attention.LONG_QUERY_THRESHOLD``); the model decides which steps it gets
(``Ops.stack_max_tokens``). Importing this module builds the libraries once per machine and
raises ``kernels.cpu.CpuKernelsUnavailable`` if it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.cpu import default_isa, library, namespace
from kernels.cpu.attention import LONG_QUERY_THRESHOLD
from kernels.quant_cpu import PackedQuant

for _name in ("elementwise", "attention", "quant_linear", "decoder_stack"):  # the stack finds their ops
    library(_name)


class DecoderStack:
    """A model's layers, held by the compiled stack (references to its weights, no copy)."""

    max_query_len = LONG_QUERY_THRESHOLD  # longer queries: the Python loop (its attention goes to SDPA)

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._forward: Callable[..., torch.Tensor] = handle.forward

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_cache: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """hidden: the embedding rows [T, hidden]; attn: the step's
        ``engine.models.llama.AttentionMetadata``. Returns the final-norm rows [T, hidden].
        ValueError when a sequence's query is longer than the compiled attention takes."""
        if attn.max_seqlen_q > LONG_QUERY_THRESHOLD:
            raise ValueError(f"the decoder stack takes queries up to {LONG_QUERY_THRESHOLD} tokens, "
                             f"got {attn.max_seqlen_q}")
        return self._forward(hidden, positions, attn.slot_mapping, attn.block_tables, attn.seq_lens,
                             attn.cu_seqlens_q, attn.max_seqlen_q, kv_cache,
                             -1 if num_layers is None else num_layers, LONG_QUERY_THRESHOLD)


def build(model: Any) -> DecoderStack | None:
    """The compiled stack of ``model``'s layers (an ``engine.models.llama.LlamaForCausalLM``,
    read by attribute: kernels/ imports nothing from engine/), or None when a layer matmul weight is not a
    compiled quantized one (``kernels.quant_cpu.PackedQuant``, or a ``DualWeight`` holding one)."""
    # a measured op table's weights hold the compiled handle in .packed (kernels.calibration.DualWeight)
    weights = [getattr(w, "packed", w) for layer in model.layers
               for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)]
    if not weights or not all(isinstance(w, PackedQuant) for w in weights):
        return None
    biases = [layer.qkv_bias for layer in model.layers]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None  # some layers with a bias, some without: not a shape the stack takes
    head = getattr(model.lm_head, "packed", model.lm_head)
    read_after = [head.panels] if isinstance(head, PackedQuant) else []  # prefetched after the last layer
    norms = [n for layer in model.layers for n in (layer.input_norm, layer.post_attention_norm)]
    cfg = model.config
    cls = getattr(torch.classes, namespace(default_isa())).DecoderStack
    handle = cls([w.panels for w in weights], [w.out_features for w in weights],
                 [w.format_id for w in weights], [int(w.exact) for w in weights],
                 [*norms, model.norm], [b for b in biases if b is not None],
                 read_after, model.cos_sin_cache,
                 cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale)
    return DecoderStack(handle)
