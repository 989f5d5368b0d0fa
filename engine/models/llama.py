"""One Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

The forward takes a flattened batch: the tokens of many sequences laid end to end, no
padding. Sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its KV lives in the
blocks of ``block_tables[i]``. Weights are plain tensors (no nn.Module): the hot loop is a
handful of kernels per layer with q/k/v and gate/up fused into one matmul each.

With a quantization plan (``engine/models/quant_weights.py``: GGUF blocks per matmul weight)
every layer matmul and the LM head run on the blocks (``ops.pack_quant``/``ops.quant_linear``);
the embedding, norms and biases stay fp32 (the embedding is read one row per token). Where the
op table has it (``Ops.decoder_stack``: compiled CPU kernels and quantized weights), a step of
up to ``Ops.stack_max_tokens`` tokens runs the layers in one compiled call that makes the same
kernel calls as the loop below (``kernels/cpu/decoder_stack.py``; bit for bit the same result).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig
from engine.kv_cache.storage import layer_kv
from kernels.ops import Ops
from kernels.rotary import build_cos_sin_cache

if TYPE_CHECKING:
    from kernels.quant import QuantRows


@dataclass(slots=True)
class AttentionMetadata:
    """Where each scheduled token's KV goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int


class DecoderLayer:
    """One layer's weights: the matmul weights as the backend's prepared handles of the
    transposed [in, out] weight (``ops.pack_linear``), q/k/v and gate/up fused."""

    __slots__ = ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight",
                 "input_norm", "post_attention_norm")

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, ops: Ops,
                 plan: Mapping[str, QuantRows] | None = None) -> None:
        def w(name: str) -> torch.Tensor:
            return weights[f"{prefix}.{name}"]

        def pack(*names: str) -> Any:  # the backend's packed weight (Ops.pack_linear / pack_quant)
            if plan is None:
                return ops.pack_linear(torch.cat([w(n) for n in names]).t())
            from kernels.quant import cat_rows

            return ops.pack_quant(cat_rows([plan[f"{prefix}.{n}"] for n in names]))

        self.qkv_weight = pack("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                               "self_attn.v_proj.weight")
        bias_names = [f"{prefix}.self_attn.{p}_proj.bias" for p in "qkv"]
        self.qkv_bias = (torch.cat([weights[n] for n in bias_names])
                         if all(n in weights for n in bias_names) else None)
        self.o_weight = pack("self_attn.o_proj.weight")
        self.gate_up_weight = pack("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down_weight = pack("mlp.down_proj.weight")
        self.input_norm = w("input_layernorm.weight")
        self.post_attention_norm = w("post_attention_layernorm.weight")


def _rotary_then_store(ops: Ops) -> Any:
    """``Ops.rotary_store_kv``'s contract from the two ops, for a backend without the fused one."""
    def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        ops.rotary(q, k, positions, cos_sin_cache)
        ops.store_kv(k, v, key_cache, value_cache, slot_mapping)
    return rotary_store_kv


def _step_weight_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of weights one forward step reads: all but the embedding (one row per token),
    plus the LM head once (the tied embedding, read again as the head, when there is no lm_head)."""
    total = sum(t.numel() * t.element_size() for name, t in weights.items()
                if name != "model.embed_tokens.weight")
    if "lm_head.weight" not in weights:
        embed = weights["model.embed_tokens.weight"]
        total += embed.numel() * embed.element_size()
    return total


class LlamaForCausalLM:
    """The model. ``forward`` returns final hidden states; ``compute_logits`` maps the rows
    that need a next-token distribution to fp32 logits."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], ops: Ops,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 quant_plan: Mapping[str, QuantRows] | None = None) -> None:
        """``quant_plan``: name -> GGUF blocks of every layer matmul weight and of
        ``lm_head.weight`` (``quant_weights.plan_quantized``); None serves ``weights``. A plan
        needs float32 activations (ValueError otherwise)."""
        self.config = config
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        if quant_plan is not None and dtype != torch.float32:
            raise ValueError(f"quantized weights need float32 activations, got dtype {dtype}")
        self.quantized = quant_plan is not None
        # the fp32 weights this model reads: with a plan, not the matmul weights it replaces (a
        # LazyWeights never dequantizes those)
        weights = {name: weights[name].to(device=self.device, dtype=dtype) for name in weights
                   if quant_plan is None or name not in quant_plan}
        self.embed_tokens = weights["model.embed_tokens.weight"]
        # fused rms_norm + matmul (Ops.norm_linear, Ops.norm_quant_linear) and silu_and_mul +
        # matmul (Ops.silu_and_mul_linear), or None: the separate ops
        self.norm_linear: Any = None
        self.silu_and_mul_linear: Any = None
        if quant_plan is None:
            self.weight_bytes = _step_weight_bytes(weights)
            # Tied embeddings: the LM head is the embedding transposed (a copy where the backend
            # packs [in, out]; read once per step).
            self.lm_head = ops.pack_linear(weights.get("lm_head.weight", self.embed_tokens).t())
            self.linear = ops.linear
            self.norm_linear = ops.norm_linear
            self.silu_and_mul_linear = ops.silu_and_mul_linear
        else:
            from engine.models.quant_weights import HEAD, plan_bytes

            self.lm_head = ops.pack_quant(quant_plan[HEAD])
            self.linear = ops.quant_linear
            self.norm_linear = ops.norm_quant_linear
            fp32_bytes = sum(t.numel() * t.element_size() for name, t in weights.items()
                             if name != "model.embed_tokens.weight")
            self.weight_bytes = plan_bytes(quant_plan) + fp32_bytes
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer(weights, f"model.layers.{i}", ops, quant_plan)
                       for i in range(config.num_layers)]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self._kv_views: tuple[torch.Tensor, int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.cos_sin_cache = build_cos_sin_cache(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
        ).to(self.device)
        self.rotary_store_kv = ops.rotary_store_kv or _rotary_then_store(ops)
        # The layers as one compiled call for short steps (kernels.cpu.decoder_stack), or None.
        self.stack: Any = ops.decoder_stack(self) if ops.decoder_stack is not None else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata, kv_cache: torch.Tensor,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, L, 2, block_size, Hkv, D].

        Returns hidden states [T, hidden] after the final norm. ``num_layers`` runs only the
        first layers (layer-skip self-speculation shares those layers' KV)."""
        cfg, ops = self.config, self.ops
        mm = self.linear
        num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens[input_ids]
        if (self.stack is not None and num_tokens <= ops.stack_max_tokens
                and attn.max_seqlen_q <= self.stack.max_query_len):
            out: torch.Tensor = self.stack.forward(hidden, positions, attn, kv_cache, num_layers)
            return out
        residual = None
        kv_views = self._layer_kv_views(kv_cache)
        # a decode step (one query per sequence) over a cache of the model's dtype takes the
        # fused rotary + store + attention
        fused = (ops.rotary_store_attention
                 if attn.max_seqlen_q == 1 and num_tokens == attn.block_tables.shape[0]
                 and kv_cache.dtype == self.dtype else None)
        for i, layer in enumerate(self.layers[:num_layers]):
            qkv, residual = self._norm_matmul(hidden, residual, layer.input_norm, layer.qkv_weight)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            key_cache, value_cache = kv_views[i]
            if fused is not None:
                out = fused(q, k, v, positions, self.cos_sin_cache, key_cache, value_cache,
                            attn.slot_mapping, attn.block_tables, attn.seq_lens, attn.cu_seqlens_q,
                            self.scale)
            else:
                self.rotary_store_kv(q, k, v, positions, self.cos_sin_cache, key_cache, value_cache,
                                     attn.slot_mapping)
                out = ops.paged_attention(q, key_cache, value_cache, attn.block_tables, attn.seq_lens,
                                          attn.cu_seqlens_q, attn.max_seqlen_q, self.scale)
            hidden = mm(out.reshape(num_tokens, self.q_size), layer.o_weight)
            gate_up, residual = self._norm_matmul(hidden, residual, layer.post_attention_norm,
                                                  layer.gate_up_weight)
            if self.silu_and_mul_linear is not None:
                hidden = self.silu_and_mul_linear(gate_up, layer.down_weight)
            else:
                hidden = mm(ops.silu_and_mul(gate_up), layer.down_weight)
        normed: torch.Tensor
        normed, _ = ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return normed

    def _norm_matmul(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                     weight: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(hidden + residual) @ weight, hidden + residual); residual None: no add.
        One fused call where the backend has it (``Ops.norm_linear``, ``Ops.norm_quant_linear``)."""
        eps = self.config.rms_norm_eps
        if residual is None:
            return self.linear(self.ops.rms_norm(hidden, norm, eps), weight), hidden
        if self.norm_linear is not None:
            out: tuple[torch.Tensor, torch.Tensor] = self.norm_linear(hidden, norm, eps, residual, weight)
            return out
        x, residual = self.ops.rms_norm(hidden, norm, eps, residual)
        return self.linear(x, weight), residual

    def _layer_kv_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (key, value) views of ``kv_cache``, built once per cache tensor: a
        step would otherwise build 2 x num_layers views (a few microseconds each at batch 1)."""
        cached = self._kv_views
        if cached is None or cached[0] is not kv_cache or cached[1] != kv_cache.data_ptr():
            cached = (kv_cache, kv_cache.data_ptr(),
                      [layer_kv(kv_cache, i) for i in range(self.config.num_layers)])
            self._kv_views = cached
        return cached[2]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        return self.linear(hidden, self.lm_head).float()
