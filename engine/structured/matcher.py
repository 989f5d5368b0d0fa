"""GrammarMatcher: one request's (one sample's) position in its compiled constraint.

State = the output tokens it has accepted (``protocol.py``: ``sync`` catches up, replaying from
the start when the history it saw is no longer a prefix of the request's). Once the constraint
is complete it admits only the stop tokens (EOS and the request's ``stop_token_ids``); after one
is accepted the matcher is terminated and keeps admitting only those, so a request that goes on
(``ignore_eos``) cannot leave the grammar.

A token the constraint refuses can only come from outside the mask (a resumed request whose
earlier tokens were produced elsewhere under another constraint): it is logged, and the matcher
admits only the stop tokens from then on, so the request ends rather than the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

log = logging.getLogger(__name__)


class GrammarMatcher:
    __slots__ = ("_matcher", "_stop_token_ids", "_num_synced", "_synced_tail", "_is_broken", "_label")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int], label: str = "") -> None:
        self._stop_token_ids = list(dict.fromkeys(stop_token_ids))
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)
        self._num_synced = 0
        self._synced_tail = -1  # the last synced token: a cheap check that history was not rewritten
        self._is_broken = False
        self._label = label  # for the log line

    @property
    def is_constrained(self) -> bool:
        return True

    @property
    def is_terminated(self) -> bool:
        return self._is_broken or self._matcher.is_terminated()

    def sync(self, output_token_ids: Sequence[int]) -> None:
        num = len(output_token_ids)
        if num < self._num_synced or (self._num_synced and output_token_ids[self._num_synced - 1] != self._synced_tail):
            self._matcher.reset()
            self._num_synced, self._is_broken = 0, False
        for index in range(self._num_synced, num):
            self._accept(output_token_ids[index])
        if num:
            self._synced_tail = output_token_ids[num - 1]
        self._num_synced = num

    def _accept(self, token_id: int) -> None:
        if self.is_terminated:
            return
        if not self._matcher.accept_token(token_id):
            log.error("structured output %s: token %d is outside the constraint; only stop tokens from now on",
                      self._label, token_id)
            self._is_broken = True

    def num_valid(self, draft_token_ids: Sequence[int]) -> int:
        if self.is_terminated:
            return 0
        count = 0
        for token_id in draft_token_ids:
            if not self._matcher.accept_token(token_id):
                break
            count += 1
            if self._matcher.is_terminated():
                break
        if count:
            self._matcher.rollback(count)
        return count

    def fill(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int] = ()) -> None:
        """Rows after a draft the constraint refuses admit every token: verification rejects
        that draft (its target probability is 0), so those rows are never used."""
        num_accepted = 0
        for j in range(len(draft_token_ids) + 1):
            row = first_row + j
            if num_accepted < j:  # draft j - 1 was refused
                bitmask[row:first_row + len(draft_token_ids) + 1] = -1
                break
            if self.is_terminated:
                self._fill_stop_only(bitmask, row)
            else:
                self._matcher.fill_next_token_bitmask(bitmask, row)
            if j < len(draft_token_ids) and not self.is_terminated and self._matcher.accept_token(draft_token_ids[j]):
                num_accepted += 1
        if num_accepted:
            self._matcher.rollback(num_accepted)

    def _fill_stop_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token_id in self._stop_token_ids:
            word, bit = divmod(token_id, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
