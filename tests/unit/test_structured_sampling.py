"""The grammar mask in the sampler: bit layout, mixed batches, greedy, logprobs, verification."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampling.metadata import SamplingMetadata, takes_argmax
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.spec_decode.verify import verify_drafts
from engine.structured.bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    bitmask_width,
    build_grammar_mask,
    unpack_bitmask,
)
from engine.structured.params import StructuredOutputsParams
from engine.structured.protocol import NO_MATCHER

V = 70  # not a multiple of 32: the last word is partial
CONSTRAINED = StructuredOutputsParams(regex="x")  # the params only mark the row; FakeMatcher decides


class FakeMatcher:
    """Admits ``allowed[len(history)]`` after a history (drafts included)."""

    def __init__(self, allowed: Sequence[set[int]]) -> None:
        self.allowed = allowed
        self.history: list[int] = []

    @property
    def is_constrained(self) -> bool:
        return True

    def sync(self, output_token_ids: Sequence[int]) -> None:
        self.history = list(output_token_ids)

    def num_valid(self, draft_token_ids: Sequence[int]) -> int:
        for j, t in enumerate(draft_token_ids):
            if t not in self.allowed[len(self.history) + j]:
                return j
        return len(draft_token_ids)

    def fill(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int] = ()) -> None:
        for j in range(len(draft_token_ids) + 1):
            row = torch.zeros(V, dtype=torch.bool)
            row[list(self.allowed[len(self.history) + j])] = True
            bitmask[first_row + j] = pack(row)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32, the reference packing."""
    words = []
    for w in range(bitmask_width(V)):
        value = sum(1 << b for b in range(32) if w * 32 + b < V and bool(allowed[w * 32 + b]))
        words.append(value - (1 << 32) if value >= 1 << 31 else value)
    return torch.tensor(words, dtype=torch.int32)


def test_unpack_and_apply_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, V, generator=gen) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bit of a word
    bitmask = torch.stack([pack(row) for row in allowed])
    assert torch.equal(unpack_bitmask(bitmask, V), allowed)
    logits = torch.randn(5, V, generator=gen)
    expected = logits.clone()
    rows = [0, 2, 4]
    for i, r in enumerate(rows):
        expected[r][~allowed[i]] = float("-inf")
    mask = build_grammar_mask([(FakeMatcher([set(allowed[0].nonzero().flatten().tolist())]), ()), (NO_MATCHER, ()),
                               (FakeMatcher([set(allowed[1].nonzero().flatten().tolist())]), ()), (NO_MATCHER, ()),
                               (FakeMatcher([set(allowed[2].nonzero().flatten().tolist())]), ())], V)
    assert mask is not None and mask.rows.tolist() == mask.row_ids == rows
    reference = logits.clone()
    apply_token_bitmask_ref(reference, mask)
    assert torch.equal(reference, expected)
    apply_token_bitmask(logits, mask)  # the CPU kernel
    assert torch.equal(logits, expected)


def test_no_constrained_row_builds_no_mask():
    assert build_grammar_mask([(NO_MATCHER, ()), (NO_MATCHER, (1, 2))], V) is None


def test_mixed_batch_constrained_rows_obey_and_free_rows_are_untouched():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen)
    params = [SamplingParams(temperature=0, structured_outputs=CONSTRAINED), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3, structured_outputs=CONSTRAINED),
              SamplingParams(temperature=1.0, seed=4)]
    allowed = [{5, 69}, {7}]
    mask = build_grammar_mask([(FakeMatcher([allowed[0]]), ()), (NO_MATCHER, ()),
                               (FakeMatcher([allowed[1]]), ()), (NO_MATCHER, ())], V)
    metadata = SamplingMetadata.from_requests(params, [[]] * 4, [[1]] * 4, None, V, grammar_mask=mask)
    sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
    assert sampled[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
    assert sampled[1] == int(logits[1].argmax())
    assert sampled[2] == 7
    unconstrained = SamplingMetadata.from_requests(params[3:], [[]], [[1]], None, V)
    assert sampled[3] == Sampler()(logits[3:], unconstrained).sampled_token_ids.item()


def test_a_constrained_greedy_row_never_takes_the_argmax_fast_path():
    assert takes_argmax(SamplingParams(temperature=0), [], [2])
    assert not takes_argmax(SamplingParams(temperature=0, structured_outputs=CONSTRAINED), [], [2])


def test_logprobs_are_taken_after_the_grammar_mask_in_both_modes():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    for mode in ("processed", "raw"):
        params = [SamplingParams(temperature=0, logprobs=3, logprobs_mode=mode, structured_outputs=CONSTRAINED)]
        mask = build_grammar_mask([(FakeMatcher([{4, 9}]), ())], V)
        out = Sampler()(logits, SamplingMetadata.from_requests(params, [[]], [[1]], None, V, grammar_mask=mask))
        entry = out.logprobs.tolists([3])[0]
        expected = dict(zip((4, 9), logits[0, [4, 9]].log_softmax(-1).tolist()))
        assert entry.token_id in (4, 9)
        assert abs(entry.logprob - expected[entry.token_id]) < 1e-5
        top = dict(entry.top)
        assert abs(top[4] - expected[4]) < 1e-5 and abs(top[9] - expected[9]) < 1e-5
        assert len(top) == 2 or all(v == float("-inf") for t, v in top.items() if t not in (4, 9))


def test_verification_masks_every_draft_position():
    # request 0 greedy with drafts [5, 6]; the grammar admits {5} then {8} then {9}: draft 6 is
    # refused, whatever the logits say, and the recovered token is the masked argmax
    request = Request("r", [1, 2], SamplingParams(temperature=0, structured_outputs=CONSTRAINED),
                      matcher=FakeMatcher([{5}, {8}, {9}]))
    request.spec_token_ids = [5, 6]
    logits = torch.full((3, V), -5.0)
    logits[0, 5] = logits[1, 6] = 10.0  # the model prefers the drafts
    logits[1, 8], logits[1, 1] = 1.0, 20.0  # token 1 is the raw argmax at position 1
    (accepted,) = verify_drafts(logits, [request], {}, V, torch.device("cpu"))
    assert accepted == [5, 8]
