"""The interface below the host tier: what a kvstore client (or any lower tier) implements.

Torch tensors cross it, nothing else of the engine: a client lives in services/ (gRPC, NIXL)
and is handed to ``HostTier`` by whoever builds the engine. Nothing here does I/O.

Contract, from the host tier's side:

- ``offer`` is called with the blocks the host pool is evicting, each with its hash, parent,
  tokens and bytes (``data``: a view of the host slot, valid only during the call: copy what you
  keep, or stage it, before returning). It runs on the engine thread inside a step, so it must
  not block on the network: queue and return (an after_first_reuse or dedup policy is the
  implementation's business). The blocks may be dropped; a lower tier is a cache.
- ``match`` is asked, at admission, for a continuation of a request's hash chain after what the
  device and host tiers hold: the number of leading hashes it can serve now. A miss is always
  legal and costs the request nothing but recompute.
- ``load`` writes the leading ``len(dst_slots)`` of those blocks into ``dst[dst_slots[i]]``
  (a host staging tensor with the device layout) and returns how many it wrote; the request
  recomputes from the first block not written (a failed or slow load is a short count, never an
  exception).

- ``prefetch`` is handed a request's whole prompt chain as the request arrives, from any
  thread, before the engine admits it: a tier that answers ``match`` over the network can start
  that lookup now, so that the engine thread finds the answer waiting (a run of that chain);
  it must not block. Doing nothing is legal.

Wiring: ``EngineCore(config, loaded, lower_tier=...)`` hands ``offer`` to the host pool's
eviction path; ``match``/``load`` are the admission half (``lower_stage.py``: after the host
hit, gated by a ``LoadCostModel`` of their own, staging into host slots that the host tier's
``load`` moves up in the same batch as its own hits); ``EngineCore.prefetch_prefix`` calls
``prefetch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A block leaving the host tier, offered to the tier below."""

    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]
    data: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim]; valid during the call only


class LowerTier(Protocol):
    """A cache below the host tier (the node's kvstore). See the module docstring."""

    def offer(self, blocks: Sequence[EvictedBlock]) -> None:
        """Take (or drop) blocks the host tier evicts, without blocking."""
        ...

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Start looking up a prompt's chain for a ``match`` soon after; any thread, no blocking."""
        ...

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` this tier can serve now."""
        ...

    def load(self, block_hashes: Sequence[BlockHash], dst: torch.Tensor, dst_slots: Sequence[int]) -> int:
        """Write the leading blocks into ``dst[dst_slots[i]]``; return how many were written."""
        ...
