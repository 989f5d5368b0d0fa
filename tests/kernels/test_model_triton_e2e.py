"""The whole default model through the Triton kernels (interpreter on CPU) equals the torch path."""

from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from kernels import paged_attention
from kernels.ops import BACKEND_ENV

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not __import__("torch").cuda.is_available(),
                       reason="Triton needs CUDA or TRITON_INTERPRET=1 (make test sets it)"),
]

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


def test_triton_backend_matches_torch_greedy(loaded_model, monkeypatch):
    # 4-token blocks: the 4-, 5- and 7-token prompts fill one or two blocks, and 6 new tokens
    # take each one's KV across one or two more block boundaries while decoding (reads span up
    # to four blocks), at about 3 s per interpreted step (16-token blocks needed 12 steps for one)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # dense fp32 weights, the path the GPU serves (in bf16): with GGUF blocks (the CPU default) the
    # interpreter also ran the Triton quantized matmul, and this test had not finished after 7
    # minutes (that kernel has its own tests: tests/kernels/test_triton_quant_linear.py)
    engine_args = {"max_model_len": 256, "num_kv_blocks": 64, "block_size": 4, "weight_format": "fp32"}
    monkeypatch.setenv(BACKEND_ENV, "torch")
    reference = LLM(loaded_model, **engine_args).generate(PROMPTS, params)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    fused_calls = []  # decode steps take the fused rotary + store + attention, prefills do not
    real_fused = paged_attention.rotary_store_attention

    def counted(q, *args, **kwargs):
        fused_calls.append(q.shape[0])
        return real_fused(q, *args, **kwargs)

    monkeypatch.setattr(paged_attention, "rotary_store_attention", counted)
    llm = LLM(loaded_model, **engine_args)
    assert llm.engine.runner.backend == "triton"
    outputs = llm.generate(PROMPTS, params)
    for ours, ref in zip(outputs, reference):
        assert ours.token_ids == ref.token_ids
    llm.engine.check_integrity()
    num_layers = llm.engine.config.model.num_layers
    assert len(fused_calls) >= 5 * num_layers and set(fused_calls) <= {1, 2, 3}, fused_calls
