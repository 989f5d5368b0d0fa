"""Greedy parity with HF transformers for ``--weight-format q4`` on the default Q4_1 file.

HF's GGUF loader dequantizes the file to fp32; q4 with fp32 activations
(``PDSERVE_CPU_QUANT_ACTIVATIONS=fp32``) computes with the very same values straight from the
blocks (the Q8_0 head included), only in another order of arithmetic. So the 8 parity prompts
must give HF's greedy tokens, except at a near-tie: where the two first differ, HF's logit for
its own token may exceed its logit for ours by at most NEAR_TIE (the prefill logits agree to
1e-3, as for fp32), and the comparison ends there.

With int8 activations (the default, llama.cpp's arithmetic) the values are no longer HF's: each
matmul input is rounded to 8 bits per block of 32, and this small model's outlier activations
make that visible (measured 2026-11-25 against pdserve fp32, which equals HF to 1e-3: prefill
top-1 agreement 0.81 on the 37-token chat prompt and 0.92 on the 1155-token one, mean |logit
error| 0.77 and 0.30; perplexity on loadtests.bench_quant's texts +0.96%). Greedy paths part
from HF's after a few tokens, so the int8 test pins those prefill numbers (with a margin)
instead of greedy equality.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine import LLM
from tests.integration.hf_parity import GREEDY
from tests.integration.test_parity_hf import assert_prefill_logits_match_hf, prefill_logits

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-3
INT8_MIN_TOP1, INT8_MAX_MEAN_ERROR = 0.75, 1.0  # int8 activations vs HF, per prompt (see above)


@contextmanager
def activations(mode: str) -> Iterator[None]:
    """``PDSERVE_CPU_QUANT_ACTIVATIONS=mode`` while the weights are packed (kernels.quant_cpu)."""
    before = os.environ.get("PDSERVE_CPU_QUANT_ACTIVATIONS")
    os.environ["PDSERVE_CPU_QUANT_ACTIVATIONS"] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ["PDSERVE_CPU_QUANT_ACTIVATIONS"]
        else:
            os.environ["PDSERVE_CPU_QUANT_ACTIVATIONS"] = before


@pytest.fixture(scope="module")
def llm_q4(loaded_model):
    with activations("fp32"):
        return LLM(loaded_model, weight_format="q4", max_num_batched_tokens=512)


def _agrees(hf_model, ids: list[int], ours: list[int], theirs: list[int],
            near_tie: float = NEAR_TIE) -> tuple[bool, str]:
    """Equal, or first different at a near-tie of HF's logits."""
    if ours == theirs:
        return True, "equal"
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if at >= min(len(ours), len(theirs)):
        return False, f"lengths differ ({len(ours)} vs {len(theirs)})"
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + theirs[:at]])).logits[0, -1].float()
    gap = (logits[theirs[at]] - logits[ours[at]]).item()
    return gap <= near_tie, f"first differs at token {at}, HF logit gap {gap:.2e}"


def test_q4_greedy_equals_hf_on_the_same_dequantized_weights(llm_q4, hf_model, parity_prompts, hf_greedy):
    assert llm_q4.engine.runner.model.quantized
    outputs = llm_q4.generate(parity_prompts, GREEDY)
    verdicts = [_agrees(hf_model, ids, out.token_ids, theirs)
                for ids, out, theirs in zip(parity_prompts, outputs, hf_greedy)]
    assert all(ok for ok, _ in verdicts), [why for _, why in verdicts]
    llm_q4.engine.check_integrity()


def test_q4_prefill_logits_match_hf(llm_q4, hf_model, parity_prompts):
    assert_prefill_logits_match_hf(llm_q4, hf_model, parity_prompts)


@pytest.fixture(scope="module")
def llm_q4_int8(loaded_model):
    with activations("int8"):
        return LLM(loaded_model, weight_format="q4", max_num_batched_tokens=512)


def _prefill_agreement(llm: LLM, hf_model, ids: list[int]) -> tuple[float, float]:
    """(top-1 agreement, mean |logit error|) with HF over every prefill position of ``ids``."""
    ours, theirs = prefill_logits(llm, hf_model, ids)
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return top1, (ours - theirs).abs().mean().item()


def test_q4_int8_activations_stay_close_to_hf(llm_q4_int8, hf_model, parity_prompts):
    assert llm_q4_int8.engine.runner.model.quantized
    for ids in (parity_prompts[0], parity_prompts[-1]):
        top1, mean_error = _prefill_agreement(llm_q4_int8, hf_model, ids)
        assert top1 >= INT8_MIN_TOP1 and 0 < mean_error <= INT8_MAX_MEAN_ERROR, (len(ids), top1, mean_error)
    llm_q4_int8.engine.check_integrity()
