"""What the sampler and the speculative path ask of a request's matcher, and its null object.

A matcher's state is a function of the request's output tokens: ``sync(output_token_ids)``
advances it over the tokens it has not seen (and replays from the start if the list is
shorter than what it saw), so wherever a request continues (a decode worker after the prefill
worker's first token, a migrated or preempted request) its matcher catches up on its own at
the next sample. Drafts are tried and rolled back, never kept.

An unconstrained request holds ``NO_MATCHER``; the batch code asks ``is_constrained`` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class MatcherProtocol(Protocol):
    @property
    def is_constrained(self) -> bool: ...

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Advance over the output tokens not seen yet."""

    def num_valid(self, draft_token_ids: Sequence[int]) -> int:
        """How many leading drafts the constraint admits after the synced tokens (state unchanged)."""
        ...

    def fill(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int] = ()) -> None:
        """Write rows first_row .. first_row + len(drafts) of ``bitmask`` [B, ceil(V / 32)] int32
        (CPU): the tokens admitted after the synced tokens plus drafts[:j] in row first_row + j."""


class NullMatcher:
    """No constraint: every token, every draft."""

    __slots__ = ()

    @property
    def is_constrained(self) -> bool:
        return False

    def sync(self, output_token_ids: Sequence[int]) -> None:
        pass

    def num_valid(self, draft_token_ids: Sequence[int]) -> int:
        return len(draft_token_ids)

    def fill(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int] = ()) -> None:
        bitmask[first_row:first_row + len(draft_token_ids) + 1] = -1


NO_MATCHER = NullMatcher()
