"""Which blocks serve each matmul under --weight-format (engine/models/quant_weights.py), on the
default model (a Q4_1 file with a Q8_0 embedding), and the loader's blocks being the file's
values: dequantizing them gives exactly the fp32 weights HF's GGUF loader sees."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.models.quant_weights import (
    HEAD,
    linear_weight_names,
    plan_bytes,
    plan_quantized,
)
from kernels.quant import dequantize


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
