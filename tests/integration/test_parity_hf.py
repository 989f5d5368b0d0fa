"""Greedy parity with HF transformers on the same GGUF weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.mathutils import cdiv
from engine.runner.inputs import ScheduledSeq, build_model_input
from tests.integration.hf_parity import GREEDY, NUM_NEW_TOKENS
from tests.integration.hf_parity import parity_prompts as _prompts

__all__ = ["NUM_NEW_TOKENS", "_prompts"]  # loadtests/bench_kv_quant.py imports the parity set from here

pytestmark = pytest.mark.slow  # the prompts and HF's tokens: session fixtures (tests/conftest.py)


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model, weight_format="fp32", max_num_batched_tokens=512)  # HF's weights, dense


def test_greedy_batched_equals_hf(llm, parity_prompts, hf_greedy):
    outputs = llm.generate(parity_prompts, GREEDY)
    for i, (ours, theirs) in enumerate(zip(outputs, hf_greedy)):
        assert ours.token_ids == theirs, f"prompt {i} diverges"
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_greedy_one_by_one_equals_hf(llm, parity_prompts, hf_greedy):
    for i, (ids, theirs) in enumerate(zip(parity_prompts, hf_greedy)):
        (ours,) = llm.generate([ids], GREEDY)
        assert ours.token_ids == theirs, f"prompt {i} diverges"
    llm.engine.check_integrity()


def prefill_logits(llm: LLM, hf_model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, HF's) logits at every position of one prefill of ``ids``."""
    runner = llm.engine.runner
    num_blocks = cdiv(len(ids), runner.block_size)
    model_input = build_model_input(
        [ScheduledSeq(ids, 0, list(range(num_blocks)), num_logits=len(ids))], runner.block_size)
    hidden = runner.model.forward(model_input.input_ids, model_input.positions,
                                  model_input.attn, runner.kv_cache)
    ours = runner.model.compute_logits(hidden[model_input.logits_indices])
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    return ours, theirs


def assert_prefill_logits_match_hf(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    """Every position's logits of the first and the last prompt's prefill within 1e-3 of HF's."""
    for ids in (prompts[0], prompts[-1]):
        ours, theirs = prefill_logits(llm, hf_model, ids)
        assert (ours - theirs).abs().max().item() < 1e-3


def test_prefill_logits_match_hf(llm, hf_model, parity_prompts):
    assert_prefill_logits_match_hf(llm, hf_model, parity_prompts)
