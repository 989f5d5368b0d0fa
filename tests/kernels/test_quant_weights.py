"""Which blocks serve each matmul under --weight-format (engine/models/quant_weights.py), on the
default model (a Q4_1 file with a Q8_0 embedding) and on small written Q4_K files, and the
loader's blocks being the file's values: dequantizing them gives exactly the fp32 weights HF's
GGUF loader sees."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.config import CacheConfig, ConfigError, EngineConfig
from engine.kv_cache.storage import allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.models.quant_weights import (
    HEAD,
    linear_weight_names,
    plan_bytes,
    plan_quantized,
)
from engine.runner.inputs import ScheduledSeq, build_model_input
from kernels.ops import compiled_ops, get_ops
from kernels.quant import dequantize
from tests.unit._hf import write_tiny_gguf

LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def model(loaded_model):
    return loaded_model.config, loaded_model.weights, loaded_model.blocks


def test_the_loader_blocks_are_the_fp32_weights(model):
    _, weights, blocks = model
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(dequantize(blocks[name]), weights[name]), name


def test_q4_and_auto_keep_the_files_blocks(model):
    config, weights, blocks = model
    for fmt in ("q4", "auto"):
        plan = plan_quantized(config, weights, blocks, fmt)
        assert plan is not None and set(plan) == {*linear_weight_names(config), HEAD}
        assert all(plan[name] is blocks[name] for name in linear_weight_names(config))
        assert plan[HEAD] is blocks["model.embed_tokens.weight"]  # tied: the Q8_0 embedding
    assert {plan[n].format for n in linear_weight_names(config)} == {"q4_1"}
    assert plan_bytes(plan) < sum(w.numel() * 4 for n, w in weights.items() if n in plan or "embed" in n) / 5


def test_q8_0_quantizes_the_4_bit_layers_and_keeps_the_q8_0_head(model):
    config, weights, blocks = model
    names = linear_weight_names(config)[:7]  # one layer: requantizing all 30 takes seconds
    small = {n: weights[n] for n in names} | {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}
    one_layer = type(config)(**{**config.__dict__, "num_layers": 1})
    plan = plan_quantized(one_layer, small, blocks, "q8_0")
    assert {rows.format for rows in plan.values()} == {"q8_0"}
    assert plan[HEAD] is blocks["model.embed_tokens.weight"]
    w = weights[names[0]]
    # Q8_0 of 4-bit values: within half a step (max |w| / 127 / 2) of each weight, plus the
    # fp16 rounding of the scale (127 steps x 2^-11 relative: 0.06 steps)
    step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) / 127
    assert ((dequantize(plan[names[0]]) - w).reshape(step.shape[0], -1, 32).abs() <= step * 0.57 + 1e-7).all()


def test_fp32_and_bad_settings(model):
    config, weights, blocks = model
    assert plan_quantized(config, weights, blocks, "fp32") is None
    assert plan_quantized(config, weights, {}, "auto") is None  # an HF directory
    assert plan_quantized(config, weights, blocks, "auto", "bfloat16") is None
    with pytest.raises(ValueError, match="weight_format must be one of auto|fp32|q8_0|q4, got 'q3'"):
        plan_quantized(config, weights, blocks, "q3")
    with pytest.raises(ValueError, match="weight_format q4 needs dtype float32, got bfloat16"):
        plan_quantized(config, weights, blocks, "q4", "bfloat16")
    with pytest.raises(ConfigError, match="weight_format q8_0 needs dtype float32"):
        EngineConfig(model=config, dtype="bfloat16", weight_format="q8_0")
    with pytest.raises(ConfigError, match="weight_format must be"):
        EngineConfig(model=config, weight_format="int4")


def _k_quant_file(tmp_path, **types):
    """A 2-layer llama GGUF of 256-wide rows, laid out as llama.cpp's Q4_K_M: the layer matmuls
    in Q4_K but ffn_down and the output in Q6_K, and ``types`` over that."""
    path = tmp_path / "q4_k_m.gguf"
    write_tiny_gguf(path, hidden=256, inner=512, num_heads=4, num_kv_heads=2,
                    types={**dict.fromkeys(LINEAR_KINDS, T.Q4_K), "ffn_down": T.Q6_K, "output": T.Q6_K, **types})
    return load_model(str(path))


# llama.cpp's Q4_K_M mix, and its mix for rows whose width is not a multiple of 256 (Q5_0 instead)
LAYOUTS = {"Q4_K_M": {}, "Q4_K_M with Q5_0 fallbacks": {k: T.Q5_0 for k in LINEAR_KINDS if k != "ffn_down"}
           | {"attn_k": T.Q5_1}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_k_quant_file_is_served_from_its_own_blocks(tmp_path, monkeypatch, layout):
    """The loader keeps Q4_K, Q6_K and Q5 blocks (Q/K rows back in HF order) whose values are
    the fp32 weights; auto serves them all as stored, q4 the Q4_K ones (the others to Q4_1, a
    stored head kept); the compiled kernels on them (fp32 activations: the exact values) give
    the fp32 model's hidden states and logits within fp32 rounding."""
    loaded = _k_quant_file(tmp_path, **LAYOUTS[layout])
    config, weights, blocks = loaded.config, loaded.weights, loaded.blocks
    kinds = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for name in [*linear_weight_names(config), HEAD]:
        kind = "output" if name == HEAD else kinds[name.split(".")[-2]]
        stored = LAYOUTS[layout].get(kind, T.Q6_K if kind in ("ffn_down", "output") else T.Q4_K)
        assert blocks[name].format == stored.name.lower(), name
        assert torch.equal(dequantize(blocks[name]), weights[name]), name
    plan = plan_quantized(config, weights, blocks, "auto")
    assert all(plan[name] is blocks[name] for name in [*linear_weight_names(config), HEAD])
    q4 = plan_quantized(config, weights, blocks, "q4")
    assert all(q4[n] is blocks[n] if blocks[n].format == "q4_k" else q4[n].format == "q4_1"
               for n in linear_weight_names(config)) and q4[HEAD] is blocks[HEAD]
    monkeypatch.setenv("PDSERVE_CPU_QUANT_ACTIVATIONS", "fp32")
    quantized = LlamaForCausalLM(config, weights, compiled_ops(), quant_plan=plan)
    assert quantized.stack is not None  # the decode path: the compiled stack on K-quant panels
    reference = LlamaForCausalLM(config, weights, get_ops("torch"))
    for seqs in ([ScheduledSeq(list(range(5, 45)), 0, [0, 1, 2])], [ScheduledSeq([7], 20, [3, 4])]):
        step = build_model_input(seqs, 16)
        out = []
        for model in (quantized, reference):
            cache = allocate_kv_cache(config, CacheConfig(block_size=16, num_blocks=8))
            hidden = model.forward(step.input_ids, step.positions, step.attn, cache)
            out.append((hidden, model.compute_logits(hidden)))
        torch.testing.assert_close(out[0][0], out[1][0], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(out[0][1], out[1][1], atol=2e-4, rtol=2e-4)


def test_a_fused_group_of_mixed_stored_formats_is_quantized_as_a_whole(tmp_path):
    """A Q4_K q/k beside a Q6_K v (a Q4_K_M file's mix): one matmul needs one layout, so q4
    quantizes the whole group to Q4_1 and auto to Q8_0; other groups keep their blocks."""
    loaded = _k_quant_file(tmp_path, attn_v=T.Q6_K)
    config, weights, blocks = loaded.config, loaded.weights, loaded.blocks
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    for fmt, target in (("q4", "q4_1"), ("auto", "q8_0")):
        plan = plan_quantized(config, weights, blocks, fmt)
        assert [plan[n].format for n in qkv] == [target] * 3, fmt
        assert plan["model.layers.0.mlp.gate_proj.weight"] is blocks["model.layers.0.mlp.gate_proj.weight"]
        LlamaForCausalLM(config, weights, compiled_ops(), quant_plan=plan)  # the fused matmuls build
