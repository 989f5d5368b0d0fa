"""The whole default model through the Triton kernels (interpreter on CPU) equals the torch path."""

from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from kernels.ops import BACKEND_ENV

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not __import__("torch").cuda.is_available(),
                       reason="Triton needs CUDA or TRITON_INTERPRET=1 (make test sets it)"),
]

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


def test_triton_backend_matches_torch_greedy(loaded_model, monkeypatch):
    # 12 new tokens: the 7-token prompt's KV crosses a 16-token block boundary while decoding
    # (reads span two blocks), at about 3 s per interpreted step
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    reference = LLM(loaded_model, max_model_len=256, num_kv_blocks=64).generate(PROMPTS, params)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = LLM(loaded_model, max_model_len=256, num_kv_blocks=64)
    assert llm.engine.runner.backend == "triton"
    outputs = llm.generate(PROMPTS, params)
    for ours, ref in zip(outputs, reference):
        assert ours.token_ids == ref.token_ids
    llm.engine.check_integrity()
