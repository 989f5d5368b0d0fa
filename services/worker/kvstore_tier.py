"""The node's kvstore as the engine's lower tier (``engine/kv_cache/lower_tier.py``).

    tier = KVStoreTier(KVStoreTierConfig("127.0.0.1:50081"))
    core = EngineCore(config, loaded, lower_tier=tier)
    tier.start(KVCompat.from_kv_cache(model_name, core.runner.kv_cache))   # before the first step
    ...
    tier.close()

The engine calls ``offer``/``match``/``load`` synchronously on its thread, inside a step. The
``KVStoreClient`` (grpc.aio) runs on a dedicated event-loop thread owned by this object; the
engine thread waits for it with short budgets: ``match`` a few milliseconds (no answer in time is
a miss), ``load`` a bounded time (a short count; the engine recomputes the rest). ``load`` has the
client fill a private staging buffer and copies it into the engine's host slots on the engine
thread, so a load that ran out of time can never write a slot after the engine took it back.
``offer`` copies the blocks' bytes and queues them for the loop (at most ``max_queued_blocks``
in flight; beyond that the blocks are dropped and counted): it never blocks the step.

Every failure is a miss or a drop, never an exception into the engine; the counters say how
many. At rest the loop thread sleeps in epoll (no timers), so an idle worker uses no CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host_pool import copy_block_runs
from engine.kv_cache.lower_tier import EvictedBlock
from engine.kv_transfer.base import KVCompat
from services.kvstore.client import KVStoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KVStoreTierConfig:
    """Where the node's kvstore is and how long the engine thread waits for it."""

    address: str  # host:port of ``pdserve serve kvstore``
    lookup_budget_s: float = 0.005  # a lookup not answered by then is a miss
    load_budget_s: float = 1.0  # a load not finished by then loads nothing
    rpc_timeout_s: float = 5.0  # deadline of the background puts
    max_queued_blocks: int = 256  # offered blocks waiting to be put; more are dropped

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("KVStoreTierConfig.address is empty: give the kvstore's host:port")
        if self.lookup_budget_s <= 0 or self.load_budget_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError(f"kvstore budgets must be > 0 s, got lookup {self.lookup_budget_s}, "
                             f"load {self.load_budget_s}, rpc {self.rpc_timeout_s}")
        if self.max_queued_blocks < 1:
            raise ValueError(f"max_queued_blocks must be >= 1, got {self.max_queued_blocks}")


@dataclass(slots=True)
class KVStoreTierCounters:
    """What happened at this edge (mutable; read from any thread, torn reads are harmless)."""

    num_lookup_timeouts: int = 0
    num_load_timeouts: int = 0
    num_offered_blocks: int = 0
    num_dropped_blocks: int = 0  # offered while the queue was full, or before ``start``
    num_put_blocks: int = 0  # the store took them


class KVStoreTier:
    """A ``LowerTier`` over a ``KVStoreClient`` on its own event-loop thread."""

    def __init__(self, config: KVStoreTierConfig) -> None:
        self.config = config
        self.counters = KVStoreTierCounters()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-tier", daemon=True)
        self._client: KVStoreClient | None = None
        self._lock = threading.Lock()
        self._num_queued = 0

    def start(self, compat: KVCompat) -> None:
        """Start the loop thread and the client for this engine's KV ``compat`` (the store
        needs it to name blocks); until then every call is a miss or a drop."""
        if self._client is not None:
            raise RuntimeError("KVStoreTier.start called twice")
        self._thread.start()

        async def connect() -> KVStoreClient:
            client = KVStoreClient(self.config.address, compat, timeout_s=self.config.rpc_timeout_s)
            asyncio.ensure_future(client.handshake())  # early, so the first lookup is not a miss
            return client
        self._client = asyncio.run_coroutine_threadsafe(connect(), self._loop).result(timeout=10)

    def close(self) -> None:
        """Close the client and stop the loop thread (queued puts are dropped)."""
        if self._client is not None and self._thread.is_alive():
            try:
                self._run(self._client.close(), timeout_s=2.0)
            except (TimeoutError, concurrent.futures.TimeoutError):
                log.warning("kvstore client did not close within 2 s")
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    # ---- LowerTier -------------------------------------------------------------------

    def offer(self, blocks: Sequence[EvictedBlock]) -> None:
        """Copy the blocks and queue them for the store, chain by chain; never blocks."""
        client = self._client
        if client is None:
            self.counters.num_dropped_blocks += len(blocks)
            return
        self.counters.num_offered_blocks += len(blocks)
        for chain in _chains(blocks):
            with self._lock:
                if self._num_queued + len(chain) > self.config.max_queued_blocks:
                    self.counters.num_dropped_blocks += len(chain)
                    continue
                self._num_queued += len(chain)
            data = torch.stack([b.data for b in chain])  # a copy: the slots are reused after this call
            tokens = [t for b in chain for t in b.token_ids]
            hashes = [b.block_hash for b in chain]
            asyncio.run_coroutine_threadsafe(self._put(client, hashes, chain[0].parent_hash, tokens, data),
                                             self._loop)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the store holds; 0 when it does not answer in budget."""
        if self._client is None or not block_hashes:
            return 0
        try:
            return self._run(self._client.lookup(list(block_hashes)), self.config.lookup_budget_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            self.counters.num_lookup_timeouts += 1
            return 0

    def load(self, block_hashes: Sequence[BlockHash], dst: torch.Tensor, dst_slots: Sequence[int]) -> int:
        """Fetch the leading ``len(dst_slots)`` blocks into ``dst[dst_slots[i]]``; how many landed."""
        n = len(dst_slots)
        if self._client is None or n == 0:
            return 0
        staging = torch.empty((n, *dst.shape[1:]), dtype=dst.dtype)
        try:
            num_filled = self._run(self._client.get_into(list(block_hashes[:n]), list(staging)),
                                   self.config.load_budget_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            self.counters.num_load_timeouts += 1
            return 0
        # One memcpy per run of consecutive slots (torch's copy_ per block is slow on a busy CPU).
        copy_block_runs(dst, list(dst_slots[:num_filled]), staging, list(range(num_filled)))
        return num_filled

    # ---- the loop thread -------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop; raise TimeoutError (and cancel it) after ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise

    async def _put(self, client: KVStoreClient, hashes: list[BlockHash], parent: BlockHash | None,
                   tokens: list[int], data: torch.Tensor) -> None:
        try:
            self.counters.num_put_blocks += await client.offer_and_put(hashes, parent, tokens, data)
        except ValueError as error:  # a caller bug (shapes): log it, the tier stays a cache
            log.error("kvstore put of %d blocks rejected: %s", len(hashes), error)
        finally:
            with self._lock:
                self._num_queued -= len(hashes)


def _chains(blocks: Sequence[EvictedBlock]) -> list[list[EvictedBlock]]:
    """``blocks`` cut into runs where each block's parent is the block before it (a Put is one
    chain: the store announces each run with its first block's parent)."""
    chains: list[list[EvictedBlock]] = []
    for block in blocks:
        if chains and block.parent_hash == chains[-1][-1].block_hash:
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains
