"""plan_logit_rows: exact rows for each kind of scheduled request, and for a mixed step."""

from __future__ import annotations

from engine.runner.logit_rows import plan_logit_rows
from tests.unit._scheduler_fakes import make_request


def decoding(request_id: str, prompt_len: int = 6, num_output: int = 2, **params):
    """A request whose KV covers everything but its last token (one decode token to run)."""
    request = make_request(request_id, prompt_len, **params)
    request.append_output_token_ids(list(range(500, 500 + num_output)))
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_a_mixed_step_numbers_rows_in_schedule_order():
    decode = decoding("decode")
    mid_chunk = make_request("mid", 20)  # 8 of 20 prompt tokens: no row
    last_chunk = make_request("last", 12)
    last_chunk.num_computed_tokens = 8  # the last 4 prompt tokens: one row
    verify = decoding("verify")
    verify.spec_token_ids = [7, 8]  # last token + 2 drafts: 3 rows
    scheduled = [decode, mid_chunk, last_chunk, verify]
    num_new = {"decode": 1, "mid": 8, "last": 4, "verify": 3}

    plan = plan_logit_rows(scheduled, num_new, {})

    assert plan.num_logits == [1, 0, 1, 3]
    assert plan.num_rows == 5
    assert plan.sample_rows == [(decode, 0), (last_chunk, 1)]
    assert plan.verify_requests == [verify]
    assert plan.verify_rows == [2, 3, 4]
    assert plan.prompt_rows == []


def test_forked_samples_share_their_parents_last_row():
    parent = make_request("p", 5)
    children = [make_request("p/1", 5, index=1), make_request("p/2", 5, index=2)]
    decode = decoding("d")
    plan = plan_logit_rows([decode, parent], {"d": 1, "p": 5}, {"p": children})
    assert plan.sample_rows == [(decode, 0), (parent, 1), (children[0], 1), (children[1], 1)]


def test_prompt_logprobs_take_a_row_per_computed_prompt_position():
    """Row p predicts prompt token p + 1, so a chunk ending the prompt has one row fewer of
    prompt logprobs than positions; its last row is also the sample row."""
    first = make_request("first", 10, prompt_logprobs=1)
    plan = plan_logit_rows([first], {"first": 6}, {})  # positions 0..5 of 10
    assert plan.num_logits == [6]
    assert plan.prompt_rows == [(first, 0, 6, 0)]
    assert plan.sample_rows == []

    first.num_computed_tokens = 6  # the rest: positions 6..9, the last one predicts no prompt token
    plan = plan_logit_rows([decoding("d"), first], {"d": 1, "first": 4}, {})
    assert plan.num_logits == [1, 4]
    assert plan.prompt_rows == [(first, 1, 3, 6)]
    assert plan.sample_rows[1] == (first, 4)


def test_a_recompute_after_output_wants_no_prompt_logprobs():
    request = make_request("r", 6, prompt_logprobs=1)
    request.append_output_token_ids([500])  # preempted after its first token: recompute all 7
    plan = plan_logit_rows([request], {"r": 7}, {})
    assert plan.num_logits == [1]
    assert plan.prompt_rows == []
    assert plan.sample_rows == [(request, 0)]
