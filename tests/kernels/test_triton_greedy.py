"""The greedy-token kernel (kernels/greedy.py) against torch's max / isfinite / where: ties go to
the first index, rows without a finite maximum give -1, vocabularies that leave a partial tile."""

from __future__ import annotations

import pytest
import torch

from kernels.greedy import BLOCK, greedy_rows, greedy_rows_ref
from tests.kernels.helpers import DEVICE, requires_triton

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [7, BLOCK, 2 * BLOCK + 300])
def test_greedy_rows_match_torch(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    # small integers: many ties, so the first index must win
    logits = torch.randint(-4, 4, (6, vocab), generator=gen).to(dtype)
    logits[1, vocab - 1] = 9  # the maximum in the last (partial) tile
    logits[2, 3] = float("nan")  # a NaN: no finite maximum
    logits[3, vocab // 2] = float("inf")
    logits[4] = float("-inf")  # nothing finite at all
    logits[5, 0] = float("-inf")  # -inf beside finite values is fine
    logits = logits.to(DEVICE)
    expected = greedy_rows_ref(logits)
    assert expected[2:5].tolist() == [-1, -1, -1]
    assert torch.equal(greedy_rows(logits), expected)


def test_greedy_rows_of_a_view_and_no_rows():
    logits = torch.randn(5, 40, device=DEVICE)
    assert torch.equal(greedy_rows(logits[1:4]), greedy_rows_ref(logits[1:4]))
    assert greedy_rows(logits[:0]).shape == (0,)
    with pytest.raises(ValueError, match="logits must be 2-d"):
        greedy_rows(logits[0])
