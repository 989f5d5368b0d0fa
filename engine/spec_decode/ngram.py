"""N-gram prompt lookup: draft the tokens that followed an earlier copy of the current suffix.

Free to run (no model), strong on inputs that repeat themselves: code edits, summaries that
quote the prompt, retrieval answers. It has no distribution, so its drafts go to the
rejection sampler with ``draft_probs=None`` (a point-mass q).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.spec_decode.proposer import Proposal, ProposalInput, Proposer


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix.

    Tries suffix lengths n = max_n down to min_n; the first n whose suffix token_ids[L-n:] also
    occurs at an earlier start s < L - n wins, and among its occurrences the most recent (largest
    s) wins. The proposal is token_ids[s+n : s+n+k]; where that runs past the end of token_ids it
    continues with the proposal itself (as if the drafts were appended and looked up again), so a
    sequence repeating with period P < k still yields k tokens. Returns [] when nothing matches.

    Cost is O(L * max_n) numpy work over the candidates, ~tens of microseconds for L = 8k
    when ``token_ids`` is already an int array (converting an 8k Python list costs more).
    """
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = np.asarray(token_ids)
    length = tokens.shape[0]
    if k <= 0 or length < 2:
        return []
    last = length - 1
    # ends: exclusive end e of each earlier occurrence of the current n-token suffix. An earlier
    # occurrence ends at e <= L - 1, so at least one token follows it.
    ends = np.flatnonzero(tokens[:last] == tokens[last]) + 1
    best_end = -1
    n = 1
    while ends.size:
        if n >= min_n:
            best_end = int(ends[-1])  # ends is ascending: the last one is the most recent
        if n == max_n:
            break
        n += 1
        ends = ends[ends >= n]  # the occurrence must start at s = e - n >= 0
        ends = ends[tokens[ends - n] == tokens[length - n]]
    if best_end < 0:
        return []
    # Period P = L - e: beyond the end, the draft repeats the P tokens after the match.
    draft: list[int] = np.resize(tokens[best_end:], k).tolist()
    return draft


class NgramProposer(Proposer):
    """Prompt-lookup proposer: ``propose_ngram`` per request, point-mass q (draft_probs None)."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[ProposalInput], k: list[int]) -> list[Proposal]:
        if len(k) != len(requests):
            raise ValueError(f"need one k per request, got {len(k)} for {len(requests)} requests")
        return [
            Proposal(propose_ngram(req.token_ids, k_i, self.min_n, self.max_n))
            for req, k_i in zip(requests, k)
        ]
