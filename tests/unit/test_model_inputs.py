"""engine/runner/inputs.py: the decode batch's inputs (built from lists) are the general path's
(built with numpy), tensor for tensor; and a block table too short for a position is refused."""

from __future__ import annotations

import random

import pytest
import torch

from engine.runner import inputs
from engine.runner.inputs import ScheduledSeq, build_model_input

BLOCK = 16


def decode_batch(rng: random.Random, size: int) -> list[ScheduledSeq]:
    seqs = []
    for _ in range(size):
        pos = rng.randrange(0, 300)
        blocks = rng.sample(range(1000), pos // BLOCK + 1 + rng.randrange(0, 3))  # spare blocks allowed
        seqs.append(ScheduledSeq([rng.randrange(50_000)], pos, blocks))
    return seqs


@pytest.mark.parametrize("size", [1, 2, 7, 33])
def test_decode_inputs_equal_the_general_path(size):
    rng = random.Random(size)
    seqs = decode_batch(rng, size)
    fast, general = build_model_input(seqs, BLOCK), inputs._general_input(seqs, BLOCK, "cpu")
    assert fast is not general
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q"):
        a, b = getattr(fast.attn, name), getattr(general.attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.attn.max_seqlen_q == general.attn.max_seqlen_q == 1


def test_a_prompt_chunk_or_a_verification_takes_the_general_path():
    seqs = [ScheduledSeq([1], 5, [0]), ScheduledSeq([2, 3], 5, [1])]
    assert build_model_input(seqs, BLOCK).attn.max_seqlen_q == 2
    seqs = [ScheduledSeq([1], 5, [0], num_logits=0)]
    assert build_model_input(seqs, BLOCK).logits_indices.numel() == 0


@pytest.mark.parametrize("path", ["decode", "general"])
def test_a_short_block_table_is_refused(path):
    seqs = [ScheduledSeq([1], 3, [4]), ScheduledSeq([2], 32, [5, 6])]  # position 32 needs 3 blocks
    build = build_model_input if path == "decode" else lambda s, b: inputs._general_input(s, b, "cpu")
    with pytest.raises(ValueError, match="sequence 1 needs 3 blocks for 33 tokens, its block table has 2"):
        build(seqs, BLOCK)
