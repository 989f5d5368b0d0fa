"""What the scheduler hands to the runner, and what comes back to the engine's caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request
    from engine.sampling.logprobs import PositionLogprobs


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``num_scheduled_tokens[request_id]`` counts draft tokens too."""

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    copy_ops: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies first
    preempted_ids: list[str] = field(default_factory=list)
    # Parallel samples (n > 1) forked from a request whose prompt completes this step: the
    # runner samples their first tokens from that request's last logits row.
    fork_children: dict[str, list[Request]] = field(default_factory=dict)
    # A chained decode step (``chained.py``): scheduled before the step before it was booked; its
    # first ``num_fed`` requests compute the token that step samples for them (fed on the device),
    # at position ``num_tokens`` (their known tokens are all computed by then); any after them
    # were admitted with their KV landed and compute their known last token.
    num_fed: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestOutput:
    """A diff for one request after a step: only its new tokens."""

    request_id: str  # the sample's id ("<id>/<index>" when n > 1)
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobs] | None = None  # per new token
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None at position 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0  # KV that exists now (PREFILL: what can be sent)
    error: str | None = None
    parent_id: str | None = None  # the caller's request id when n > 1
    index: int = 0

    def can_absorb(self, later: RequestOutput) -> bool:
        """Whether ``later`` (the same queue's next output) can join this one as one output:
        the same sample, this one not finished, and ``later`` no failure (an abort or error
        stays its own output, so the tokens before it reach the caller as they would have)."""
        return (later.request_id == self.request_id and not self.finished
                and later.finish_reason not in ("abort", "error"))

    def absorb(self, later: RequestOutput) -> RequestOutput:
        """This output and ``later`` (see ``can_absorb``) as one: the tokens (and logprobs) of
        both, the prompt logprobs of the first that has them, the rest ``later``'s."""
        return RequestOutput(
            later.request_id, self.new_token_ids + later.new_token_ids, later.finished,
            later.finish_reason, later.stop_reason,
            None if self.new_logprobs is None and later.new_logprobs is None
            else (self.new_logprobs or []) + (later.new_logprobs or []),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.num_prompt_tokens, later.num_cached_tokens, later.num_computed_tokens,
            later.error, later.parent_id, later.index)

    @classmethod
    def of(cls, request: Request, new_token_ids: list[int]) -> RequestOutput:
        """``request``'s output after a step that gave it ``new_token_ids`` (not finished yet)."""
        # every field in order: by keyword it took twice as long (once per request per step)
        return cls(request.request_id, new_token_ids, False, None, None, None, None,
                   len(request.prompt_token_ids), request.num_cached_tokens,
                   request.num_computed_tokens, None, request.parent_id, request.index)
