"""Engine KV events -> index ops (the ``apply`` script's wire form).

One op per block and tier: ``("S", hash hex, mask)`` stored, ``("R", hash hex, mask)`` removed,
``("C", "", mask)`` every block of those tiers cleared. Ops are idempotent set operations per
(block, tier) bit, so replaying any suffix of the stream after a snapshot converges to the truth.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    Tier,
)
from services.index.scripts import ApplyOp

ALL_TIERS = int(Tier.DEVICE | Tier.HOST | Tier.KVSTORE)


def events_to_ops(events: Iterable[KVCacheEvent]) -> list[ApplyOp]:
    """The ops of ``events``, in order. Raises TypeError on anything that is not a KV event."""
    ops: list[ApplyOp] = []
    for event in events:
        if isinstance(event, BlockStored):
            ops += [("S", h.hex(), int(event.tier)) for h in event.block_hashes]
        elif isinstance(event, BlockRemoved):
            ops += [("R", h.hex(), int(event.tier)) for h in event.block_hashes]
        elif isinstance(event, AllBlocksCleared):
            ops.append(("C", "", ALL_TIERS if event.tier is None else int(event.tier)))
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
    return ops
