"""Greedy parity with HF transformers on the same GGUF weights (fp32, CPU)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from engine import LLM, SamplingParams
from engine.mathutils import cdiv
from engine.runner.inputs import ScheduledSeq, build_model_input

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 64


def _prompts(tokenizer) -> list[list[int]]:
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    long_context = inspect.getsource(textwrap)[:4200]
    return [
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        chat("Explain in two sentences why the sky is blue."),
        tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        tokenizer.encode("#include <stdio.h>\n\nint main(void) {\n"),
        tokenizer.encode("The three primary colours are"),
        chat("Summarise this code:\n" + long_context[:600]),
        tokenizer.encode(long_context + "\n\n# The function above"),
    ]


@pytest.fixture(scope="module")
def prompts(loaded_model):
    prompts = _prompts(loaded_model.tokenizer)
    assert max(len(p) for p in prompts) >= 900, "the long-context prompt must be ~1,000 tokens"
    return prompts


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                    eos_token_id=list(hf_model.generation_config.eos_token_id
                                                      if isinstance(hf_model.generation_config.eos_token_id, list)
                                                      else [hf_model.generation_config.eos_token_id]))
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model, max_num_batched_tokens=512)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)


def test_greedy_batched_equals_hf(llm, prompts, hf_greedy):
    outputs = llm.generate(prompts, GREEDY)
    for i, (ours, theirs) in enumerate(zip(outputs, hf_greedy)):
        assert ours.token_ids == theirs, f"prompt {i} diverges"
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_greedy_one_by_one_equals_hf(llm, prompts, hf_greedy):
    for i, (ids, theirs) in enumerate(zip(prompts, hf_greedy)):
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


def test_prefill_logits_match_hf(llm, hf_model, prompts):
    assert_prefill_logits_match_hf(llm, hf_model, prompts)
