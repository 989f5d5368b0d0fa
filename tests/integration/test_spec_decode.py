"""Speculative decoding in the engine: greedy output identical to plain decoding with each
proposer, alone and in a batch of 16 mixed requests; no block leaks after rollbacks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.default_model import default_model_path

pytestmark = pytest.mark.slow

CODE = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


def _prompts(tokenizer) -> list[list[int]]:
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    base = [
        chat("Repeat this code exactly:\n" + CODE),
        chat("Tell me a short story about a dragon."),
        tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown"),
        tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8,"),
    ]
    return [base[i % len(base)] for i in range(16)]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8 + (i * 5) % 17)


@pytest.fixture(scope="module")
def prompts(loaded_model):
    return _prompts(loaded_model.tokenizer)


@pytest.fixture(scope="module")
def reference(loaded_model, prompts):
    llm = LLM(loaded_model, max_model_len=512, num_kv_blocks=256)
    return [o.token_ids for o in llm.generate(prompts, [_params(i) for i in range(16)])]


@pytest.mark.parametrize("method", ["ngram", "layer-skip", "draft"])
def test_greedy_equals_plain_decoding(loaded_model, prompts, reference, method):
    # max_batch=32: keep speculation on for the 16-request batch, so verification in a mixed
    # batch is exercised, not switched off by the adaptive threshold. draft_cost=0: drafts as if
    # free, or the adaptive policy would rightly never let the target draft for itself.
    llm = LLM(loaded_model, max_model_len=512, num_kv_blocks=256, spec_method=method, spec_k=4,
              spec_layers=6, spec_max_batch=32, spec_draft_cost=0.0,
              draft_model=default_model_path() if method == "draft" else None)
    batched = llm.generate(prompts, [_params(i) for i in range(16)])
    assert [o.token_ids for o in batched] == reference
    for i in (0, 2, 3):
        (alone,) = llm.generate([prompts[i]], _params(i))
        assert alone.token_ids == reference[i], f"prompt {i} alone"
    stats = llm.engine.spec_stats()
    assert stats["num_spec_steps"] > 0 and sum(stats["num_proposed_per_position"]) > 0
    if method in ("ngram", "draft"):  # both accept a lot on the copy / counting prompts
        assert sum(stats["num_accepted_per_position"]) > 0
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_rollback_under_a_small_pool_leaks_nothing(loaded_model, prompts, reference):
    """Speculation with preemption: drafts take slots, rollbacks return them."""
    llm = LLM(loaded_model, max_model_len=512, num_kv_blocks=14, spec_method="ngram", spec_k=4,
              spec_max_batch=32)
    outputs = llm.generate(prompts[:8], [_params(i) for i in range(8)])
    assert [o.token_ids for o in outputs] == reference[:8]
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_seeded_sampling_with_speculation_is_reproducible(loaded_model, prompts):
    llm = LLM(loaded_model, max_model_len=512, num_kv_blocks=256, spec_method="ngram", spec_k=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20,
                            repetition_penalty=1.1)
    first = llm.generate([prompts[0]], params)[0].token_ids
    again = llm.generate([prompts[0], prompts[1], prompts[3]], params)[0].token_ids
    assert first == again
    llm.engine.check_integrity()
