"""The compiled decoder stack (kernels/cpu/decoder_stack.py) against the model's Python layer
loop with the same compiled ops: the same bits, on decode, prefill and mixed steps, a prefix of
the layers, an int8 KV cache, fp32 activations and qkv biases; and its refusals. The decode and
mixed steps (up to 32 rows) take the stack's team path, the 40-token prefill its op calls.

The model is the default one cut to two layers (its own Q4_1 blocks, Q8_0 head)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig
from engine.kv_cache.storage import allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.models.quant_weights import linear_weight_names, plan_quantized
from engine.runner.inputs import ScheduledSeq, build_model_input
from kernels.cpu.attention import LONG_QUERY_THRESHOLD
from kernels.ops import compiled_ops

NUM_LAYERS = 2
BLOCK = 16


@pytest.fixture(scope="module")
def two_layers(loaded_model):
    config = dataclasses.replace(loaded_model.config, num_layers=NUM_LAYERS)
    keep = {n for n in loaded_model.weights if not n.startswith("model.layers.")
            or int(n.split(".")[2]) < NUM_LAYERS}
    weights = {n: loaded_model.weights[n] for n in keep}
    plan = plan_quantized(config, weights, loaded_model.blocks, "q4")
    assert plan is not None and set(linear_weight_names(config)) <= set(plan)
    return config, weights, plan


def models(config, weights, plan):
    """(the Python loop, the stack) over the same weights and compiled ops."""
    ops = compiled_ops()
    stacked = LlamaForCausalLM(config, weights, ops, quant_plan=plan)
    looped = LlamaForCausalLM(config, weights, dataclasses.replace(ops, decoder_stack=None), quant_plan=plan)
    assert stacked.stack is not None and looped.stack is None
    return looped, stacked


STEPS = {
    "decode batch 1": [ScheduledSeq([5], 37, list(range(3)))],
    "decode batch 3": [ScheduledSeq([5], 37, [4, 5, 6]), ScheduledSeq([9], 0, [7]),
                       ScheduledSeq([11], 63, [0, 1, 2, 3, 8])],
    "prefill": [ScheduledSeq(list(range(100, 140)), 0, [9, 10, 11])],
    "mixed": [ScheduledSeq([7], 20, [12, 13]), ScheduledSeq(list(range(200, 219)), 16, [14, 15, 19]),
              ScheduledSeq([1, 2, 3], 40, [16, 17, 18], num_logits=3)],
}


def run_both(looped, stacked, seqs, kv_dtype="float32", num_layers=None, history=()):
    """Each model's hidden states and KV cache after the step, from the same cache: random K/V
    for an fp32 one, else what the Python loop wrote for ``history`` (earlier prompts)."""
    model_input = build_model_input(seqs, BLOCK)
    base = allocate_kv_cache(looped.config, CacheConfig(block_size=BLOCK, num_blocks=24, dtype=kv_dtype))
    if kv_dtype == "float32":
        base.copy_(torch.randn(base.shape, generator=torch.Generator().manual_seed(0)))
    if history:
        earlier = build_model_input(list(history), BLOCK)
        looped.forward(earlier.input_ids, earlier.positions, earlier.attn, base)
    results = []
    for model in (looped, stacked):
        cache = base.clone()
        hidden = model.forward(model_input.input_ids, model_input.positions, model_input.attn, cache,
                               num_layers)
        results.append((hidden, cache))
    return results


@pytest.mark.parametrize("step", list(STEPS))
def test_the_stack_is_the_python_loop_bit_for_bit(two_layers, step):
    looped, stacked = models(*two_layers)
    (h1, c1), (h2, c2) = run_both(looped, stacked, STEPS[step])
    assert torch.equal(h1, h2), (h1 - h2).abs().max()
    assert torch.equal(c1, c2)


def test_a_prefix_of_the_layers_and_an_int8_cache(two_layers):
    looped, stacked = models(*two_layers)
    (h1, c1), (h2, c2) = run_both(looped, stacked, STEPS["mixed"], num_layers=1)
    assert torch.equal(h1, h2) and torch.equal(c1, c2)
    history = [ScheduledSeq(list(range(300, 337)), 0, [4, 5, 6]), ScheduledSeq(list(range(400, 463)), 0, [0, 1, 2, 3])]
    (h1, c1), (h2, c2) = run_both(looped, stacked, STEPS["decode batch 3"], kv_dtype="int8", history=history)
    assert torch.equal(h1, h2) and torch.equal(c1, c2)


def test_fp32_activations_and_qkv_biases(two_layers, monkeypatch):
    config, weights, plan = two_layers
    monkeypatch.setenv("PDSERVE_CPU_QUANT_ACTIVATIONS", "fp32")
    generator = torch.Generator().manual_seed(1)
    biased = dict(weights)
    for i in range(NUM_LAYERS):
        for p, size in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
            biased[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(
                size * config.head_dim, generator=generator) * 0.1
    looped, stacked = models(config, biased, plan)
    assert stacked.layers[0].qkv_weight.exact and stacked.layers[0].qkv_bias is not None
    (h1, _), (h2, _) = run_both(looped, stacked, STEPS["mixed"])
    assert torch.equal(h1, h2)


def test_long_queries_go_to_the_python_loop_and_bad_calls_are_refused(two_layers):
    looped, stacked = models(*two_layers)
    seqs = [ScheduledSeq([3] * (LONG_QUERY_THRESHOLD + 1), 0, list(range(24)) * 3)]
    model_input = build_model_input(seqs, BLOCK)
    cache = allocate_kv_cache(looped.config, CacheConfig(block_size=BLOCK, num_blocks=24))
    assert model_input.attn.max_seqlen_q > stacked.stack.max_query_len
    hidden = stacked.forward(model_input.input_ids, model_input.positions, model_input.attn, cache)
    assert hidden.shape == (LONG_QUERY_THRESHOLD + 1, looped.config.hidden_size)
    embedded = stacked.embed_tokens[model_input.input_ids]
    with pytest.raises(ValueError, match="takes queries up to 1024 tokens, got 1025"):
        stacked.stack.forward(embedded, model_input.positions, model_input.attn, cache)
    small = build_model_input(STEPS["decode batch 1"], BLOCK)
    embedded = stacked.embed_tokens[small.input_ids]
    with pytest.raises(ValueError, match="num_layers 3 > the model's 2"):
        stacked.stack.forward(embedded, small.positions, small.attn, cache, num_layers=3)
    with pytest.raises(ValueError, match="kv_cache must be"):
        stacked.stack.forward(embedded, small.positions, small.attn, cache[:, 0])
    with pytest.raises(ValueError, match="hidden must be a contiguous float32"):
        stacked.stack.forward(embedded[:, :100], small.positions, small.attn, cache)


def test_the_team_path_on_one_thread_and_on_every_thread(two_layers):
    """The team splits each matmul's columns between the threads it gets: any count, the same bits."""
    looped, stacked = models(*two_layers)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (h1, c1), (h2, c2) = run_both(looped, stacked, STEPS["decode batch 3"])
    finally:
        torch.set_num_threads(threads)
    (h3, c3), _ = run_both(looped, stacked, STEPS["decode batch 3"])
    assert torch.equal(h1, h2) and torch.equal(c1, c2) and torch.equal(h1, h3) and torch.equal(c1, c3)


def test_no_stack_without_compiled_quantized_weights(two_layers):
    config, weights, _ = two_layers
    assert LlamaForCausalLM(config, weights, compiled_ops()).stack is None  # fp32 weights
