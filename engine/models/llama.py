"""One Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

The forward takes a flattened batch: the tokens of many sequences laid end to end, no
padding. Sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its KV lives in the
blocks of ``block_tables[i]``. Weights are plain tensors (no nn.Module): the hot loop is a
handful of kernels per layer with q/k/v and gate/up fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from engine.kv_cache.storage import layer_kv
from kernels.ops import Ops
from kernels.rotary import build_cos_sin_cache


@dataclass(slots=True)
class AttentionMetadata:
    """Where each scheduled token's KV goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> contiguous [in, out]: the layout both BLAS paths stream fastest."""
    return weight.t().contiguous()


def make_matmul(device: torch.device, dtype: torch.dtype):
    """x [M, in] @ w_t [in, out]. fp32 on CPU goes through numpy's OpenBLAS, which measured
    about 2x faster than torch's CPU BLAS for the skinny products of decode and speculative
    verification (M = 1..16) and no slower for prefill (docs/benchmarks.md); both share memory
    with the tensors, nothing is copied."""
    if device.type == "cpu" and dtype == torch.float32:
        return lambda x, w_t: torch.from_numpy(np.matmul(x.numpy(), w_t.numpy()))
    return torch.matmul


class DecoderLayer:
    """One layer's weights, pre-transposed to [in, out]; q/k/v and gate/up fused."""

    __slots__ = ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight",
                 "input_norm", "post_attention_norm")

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        w = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.qkv_weight = _transposed(torch.cat(
            [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]))
        bias_names = [f"{prefix}.self_attn.{p}_proj.bias" for p in "qkv"]
        self.qkv_bias = (torch.cat([weights[n] for n in bias_names])
                         if all(n in weights for n in bias_names) else None)
        self.o_weight = _transposed(w("self_attn.o_proj.weight"))
        self.gate_up_weight = _transposed(
            torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down_weight = _transposed(w("mlp.down_proj.weight"))
        self.input_norm = w("input_layernorm.weight")
        self.post_attention_norm = w("post_attention_layernorm.weight")


class LlamaForCausalLM:
    """The model. ``forward`` returns final hidden states; ``compute_logits`` maps the rows
    that need a next-token distribution to fp32 logits."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        weights = {name: t.to(device=self.device, dtype=dtype) for name, t in weights.items()}
        self.matmul = make_matmul(self.device, dtype)
        self.embed_tokens = weights["model.embed_tokens.weight"]
        # Tied embeddings: the LM head is a second, transposed copy (read once per step).
        self.lm_head = _transposed(weights.get("lm_head.weight", self.embed_tokens))
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer(weights, f"model.layers.{i}") for i in range(config.num_layers)]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.cos_sin_cache = build_cos_sin_cache(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling,
        ).to(self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by one forward step (the LM head counted once)."""
        tensors = [self.lm_head, self.norm]  # the embedding reads one row per token
        for layer in self.layers:
            tensors += [t for t in (layer.qkv_weight, layer.qkv_bias, layer.o_weight,
                                    layer.gate_up_weight, layer.down_weight, layer.input_norm,
                                    layer.post_attention_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata, kv_cache: torch.Tensor,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, L, 2, block_size, Hkv, D].

        Returns hidden states [T, hidden] after the final norm. ``num_layers`` runs only the
        first layers (layer-skip self-speculation shares those layers' KV)."""
        cfg, ops, mm = self.config, self.ops, self.matmul
        num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens[input_ids]
        residual = None
        for i, layer in enumerate(self.layers[:num_layers]):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = mm(x, layer.qkv_weight)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            ops.rotary(q, k, positions, self.cos_sin_cache)
            key_cache, value_cache = layer_kv(kv_cache, i)
            ops.store_kv(k, v, key_cache, value_cache, attn.slot_mapping)
            out = ops.paged_attention(q, key_cache, value_cache, attn.block_tables, attn.seq_lens,
                                      attn.cu_seqlens_q, attn.max_seqlen_q, self.scale)
            hidden = mm(out.reshape(num_tokens, self.q_size), layer.o_weight)
            x, residual = ops.rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps, residual)
            hidden = mm(ops.silu_and_mul(mm(x, layer.gate_up_weight)), layer.down_weight)
        hidden, _ = ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        return self.matmul(hidden, self.lm_head).float()
