"""Which rows of a step's logits are computed, and what each is for: a pure function.

The scheduled requests' logits rows come in schedule order, each request's rows contiguous::

    request      | decode | prefill chunk (mid-prompt) | last chunk | verify, k = 2 |
    num_logits       1              0                       1          3
    rows             0                                      1          2 3 4
    used for      sample                                  sample     verify 2 drafts + bonus

A request gets one row per trailing position that needs a next-token distribution: none for a
chunk that stops inside the prompt, one when its last token is computed (a sample, shared by the
parallel samples forked from it this step), k + 1 when it carries k draft tokens (verification),
and every computed prompt position when it asked for prompt logprobs (row p predicts prompt
token p + 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class LogitRows:
    num_logits: list[int] = field(default_factory=list)  # per scheduled request, in order
    sample_rows: list[tuple[Request, int]] = field(default_factory=list)  # (to sample for, row)
    verify_requests: list[Request] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)  # request by request, k + 1 each
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # ^ (request, first row, number of rows, first prompt position)

    @property
    def num_rows(self) -> int:
        return sum(self.num_logits)


def plan_logit_rows(scheduled: Sequence[Request], num_scheduled_tokens: Mapping[str, int],
                    fork_children: Mapping[str, Sequence[Request]]) -> LogitRows:
    """The logits rows of one step, from each request's state before the step (its
    ``num_computed_tokens`` is where this step's tokens start)."""
    plan = LogitRows()
    first_row = 0  # plan.num_rows so far (a running sum: summing per request is quadratic)
    for request in scheduled:
        num_new = num_scheduled_tokens[request.request_id]
        start = request.num_computed_tokens
        reaches_end = start + num_new >= request.num_tokens
        wants_prompt = (request.sampling_params.prompt_logprobs is not None
                        and start < request.num_prompt_tokens
                        and request.num_output_tokens == 0)  # a recompute needs none
        num_logits = num_new if wants_prompt else int(reaches_end)
        if request.spec_token_ids:  # the last token + k drafts: k + 1 positions to verify
            num_logits = max(num_logits, len(request.spec_token_ids) + 1)
        plan.num_logits.append(num_logits)
        if wants_prompt:
            count = min(start + num_new, request.num_prompt_tokens - 1) - start
            plan.prompt_rows.append((request, first_row, count, start))
        last_row = first_row + num_logits - 1
        if request.spec_token_ids:
            plan.verify_requests.append(request)
            plan.verify_rows += range(last_row - len(request.spec_token_ids), last_row + 1)
        elif reaches_end:
            plan.sample_rows += [(r, last_row) for r in
                                 [request, *fork_children.get(request.request_id, ())]]
        first_row += num_logits
    return plan
