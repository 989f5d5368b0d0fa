"""Benchmark prompts that share no prefix: each a seeded random walk over a few English words.

Slices of one repeated sentence (what bench_serve and bench_gpu used before 2026-11-27) repeat
every 14 tokens, so prompts at different offsets were often the same prompt: bench_serve's 32
load prompts were 14 distinct ones, and 18 requests were prefix-cache hits that a real load
would not give. Here no two prompts of a call share their first KV block (checked), so every
prompt is prefilled in full; the token ids are natural words, so the tokenizer's ordinary
vocabulary is what the engine reads (not special or rare ids).
"""

from __future__ import annotations

import random
from typing import Any

from engine.config import CacheConfig

WORDS = ("the history of computing is a story of ideas machines and people who built them "
         "from relays to transistors chips networks languages compilers memory disks").split()
FIRST_BLOCK_TOKENS = CacheConfig.block_size  # the engine's default KV block: prompts must differ within it


def distinct_prompts(tokenizer: Any, length: int, count: int, salt: int | str = 0) -> list[list[int]]:
    """``count`` token-id prompts of ``length`` tokens, the same ones for the same arguments and
    tokenizer; ``salt`` picks another set (calls with different salts may share prompts only by
    chance, ~1 in 10^17 per pair)."""
    batch = []
    for i in range(count):
        rng = random.Random(f"{salt}/{i}")
        ids = list(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(2 * length))))
        batch.append(ids[:length])
    short = [len(ids) for ids in batch if len(ids) < length]
    if short:
        raise ValueError(f"distinct_prompts: {len(short)} prompts came out shorter than {length} tokens")
    if len({tuple(ids[:FIRST_BLOCK_TOKENS]) for ids in batch}) < count:
        raise ValueError(f"distinct_prompts: {count} prompts of {length} tokens share a first block")
    return batch
