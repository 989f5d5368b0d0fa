"""The node's kvstore as the engine's lower tier (``engine/kv_cache/tiers/lower_tier.py``).

    tier = KVStoreTier(KVStoreTierConfig("127.0.0.1:50081"))
    core = EngineCore(config, loaded, lower_tier=tier)
    tier.start(KVCompat.from_kv_cache(model_name, core.runner.kv_cache))   # before the first step
    ...
    tier.close()

The engine calls ``offer``/``match``/``load`` synchronously on its thread, inside a step. The
``KVStoreClient`` (grpc.aio) runs on a dedicated event-loop thread owned by this object; the
engine thread waits for it with short budgets: ``match`` a few milliseconds (no answer in time is
a miss), ``load`` at most ``load_budget_s`` (a load not finished by then loads nothing more; the
engine recomputes the rest).

``prefetch`` (any thread, never blocks) looks a request's whole prompt chain up as it arrives,
before the engine admits it: a ``match`` on a run of that chain within ``PREFETCH_TTL_S``
answers from the store's per-block reply instead of a round trip on the engine thread (a
decode worker's reservation, a prefill worker's admission waited for one per request, in
series with the steps). The answer may be that much older; a block evicted since is a short
``load`` (recomputed), one stored since a miss.

``load`` moves the bytes over NIXL when both sides can (``transfer`` nixl or auto, and the store
runs with NIXL): PrepareRead (a lease), a one-sided READ into a registered staging region owned
by this tier, Release (``kvstore_nixl.py``). Otherwise, over gRPC ``Get`` into a private staging
buffer. Either way the engine thread itself copies the landed blocks into its host slots, after
the transfer finished, so a transfer that ran out of time can never write a slot after the
engine took it back (``kvstore_nixl.py`` says why the READ does not target the slots directly).
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
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.host_pool import copy_block_runs
from engine.kv_cache.tiers.lower_tier import EvictedBlock
from engine.kv_transfer.base import KVCompat, KVTransferError
from services.kvstore.client import KVStoreClient
from services.worker.kvstore_nixl import NixlLoader
from services.worker.settings import KVSTORE_TRANSFERS

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFETCH_TTL_S = 1.0  # a prefetched answer older than this is asked again
MAX_PREFETCHED_HASHES = 16384  # the oldest prefetches are forgotten past this many hashes


@dataclass(frozen=True, slots=True)
class KVStoreTierConfig:
    """Where the node's kvstore is and how long the engine thread waits for it."""

    address: str  # host:port of ``pdserve serve kvstore``
    lookup_budget_s: float = 0.005  # a lookup not answered by then is a miss
    load_budget_s: float = 1.0  # a load not finished by then loads nothing
    rpc_timeout_s: float = 5.0  # deadline of the background puts
    max_queued_blocks: int = 256  # offered blocks waiting to be put; more are dropped
    # How ``load`` moves bytes: nixl (a NIXL agent is required: ``start`` raises without one),
    # auto (NIXL when the agent can be made here, gRPC otherwise), grpc (``Get`` only). With
    # nixl or auto, a store that serves no NIXL is read with ``Get``.
    transfer: str = "grpc"
    staging_blocks: int = 128  # the NIXL staging region, in blocks; a longer load goes in chunks

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("KVStoreTierConfig.address is empty: give the kvstore's host:port")
        if self.lookup_budget_s <= 0 or self.load_budget_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError(f"kvstore budgets must be > 0 s, got lookup {self.lookup_budget_s}, "
                             f"load {self.load_budget_s}, rpc {self.rpc_timeout_s}")
        if self.max_queued_blocks < 1:
            raise ValueError(f"max_queued_blocks must be >= 1, got {self.max_queued_blocks}")
        if self.transfer not in KVSTORE_TRANSFERS:
            raise ValueError(f"kvstore transfer must be one of {', '.join(KVSTORE_TRANSFERS)}, "
                             f"got {self.transfer!r}")
        if self.staging_blocks < 1:
            raise ValueError(f"staging_blocks must be >= 1, got {self.staging_blocks}")


@dataclass(slots=True)
class KVStoreTierCounters:
    """What happened at this edge (mutable; read from any thread, torn reads are harmless)."""

    num_lookup_timeouts: int = 0
    num_prefetches: int = 0  # prompt chains looked up ahead of their admission
    num_prefetched_matches: int = 0  # matches answered by one of them (no round trip of their own)
    num_load_timeouts: int = 0
    num_offered_blocks: int = 0
    num_dropped_blocks: int = 0  # offered while the queue was full, or before ``start``
    num_put_blocks: int = 0  # the store took them
    # Loads by the transport that moved the bytes (blocks and bytes that landed in host slots)
    num_nixl_loaded_blocks: int = 0
    num_nixl_loaded_bytes: int = 0
    num_grpc_loaded_blocks: int = 0
    num_grpc_loaded_bytes: int = 0
    num_abandoned_reads: int = 0  # NIXL READs still in progress at the deadline
    nixl_load_s: float = 0.0  # engine-thread seconds in loads that went over NIXL
    grpc_load_s: float = 0.0  # ... over gRPC (both: PrepareRead or Get to the copy into host slots)


@dataclass(slots=True, eq=False)
class _Prefetch:
    """One prompt chain's lookup, started by ``prefetch``."""

    hashes: list[BlockHash]
    present: concurrent.futures.Future[list[bool]]
    started: float  # time.monotonic()


class KVStoreTier:
    """A ``LowerTier`` over a ``KVStoreClient`` on its own event-loop thread."""

    def __init__(self, config: KVStoreTierConfig) -> None:
        self.config = config
        self.counters = KVStoreTierCounters()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-tier", daemon=True)
        self._client: KVStoreClient | None = None
        self._nixl: NixlLoader | None = None  # made on the loop thread by ``start``
        self._lock = threading.Lock()
        self._num_queued = 0
        # every hash of a prefetched chain -> (its prefetch, its index in the chain); under _lock
        self._prefetched: OrderedDict[BlockHash, tuple[_Prefetch, int]] = OrderedDict()

    @property
    def transport(self) -> str:
        """How loads move bytes now: "nixl" (when the store serves it) or "grpc"."""
        return "nixl" if self._nixl is not None and self._nixl.staging is not None else "grpc"

    def start(self, compat: KVCompat) -> None:
        """Start the loop thread and the client for this engine's KV ``compat`` (the store
        needs it to name blocks), and the NIXL agent with ``transfer`` nixl or auto; until then
        every call is a miss or a drop. KVTransferError with ``transfer="nixl"`` and no agent."""
        if self._client is not None:
            raise RuntimeError("KVStoreTier.start called twice")
        self._thread.start()

        async def connect() -> KVStoreClient:
            if self.config.transfer != "grpc":
                try:
                    self._nixl = NixlLoader(compat, self.config.staging_blocks, self._loop,
                                            on_abandoned=self._count_abandoned_read)
                except KVTransferError as error:
                    if self.config.transfer == "nixl":
                        raise
                    log.warning("kvstore tier: NIXL unavailable (%s); loading over gRPC", error)
            client = KVStoreClient(self.config.address, compat, timeout_s=self.config.rpc_timeout_s)
            asyncio.ensure_future(client.handshake())  # early, so the first lookup is not a miss
            return client
        try:
            self._client = asyncio.run_coroutine_threadsafe(connect(), self._loop).result(timeout=30)
        except BaseException:
            self.close()
            raise
        log.info("kvstore tier: %s, loads over %s", self.config.address, self.transport)

    def close(self) -> None:
        """Close the client and the NIXL agent, and stop the loop thread (queued puts are dropped)."""
        if self._thread.is_alive():
            if self._client is not None:
                try:
                    self._run(self._client.close(), timeout_s=2.0)
                except (TimeoutError, concurrent.futures.TimeoutError):
                    log.warning("kvstore client did not close within 2 s")
            if self._nixl is not None:
                nixl = self._nixl

                async def close_nixl() -> None:
                    nixl.close()
                try:
                    self._run(close_nixl(), timeout_s=2.0)
                except (TimeoutError, concurrent.futures.TimeoutError):
                    log.warning("kvstore tier NIXL agent did not close within 2 s")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and not self._loop.is_closed():
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

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Start looking ``block_hashes`` (a prompt's chain) up for a ``match`` soon after; any
        thread, never blocks."""
        client = self._client
        if client is None or not block_hashes:
            return
        hashes = list(block_hashes)
        entry = _Prefetch(hashes, asyncio.run_coroutine_threadsafe(client.lookup_present(hashes), self._loop),
                          time.monotonic())
        self.counters.num_prefetches += 1
        with self._lock:
            for i, block_hash in enumerate(hashes):
                self._prefetched[block_hash] = (entry, i)
                self._prefetched.move_to_end(block_hash)
            while len(self._prefetched) > MAX_PREFETCHED_HASHES:
                self._prefetched.popitem(last=False)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the store holds; 0 when it does not answer in budget.
        A run of a chain prefetched within ``PREFETCH_TTL_S`` is answered from that lookup."""
        if self._client is None or not block_hashes:
            return 0
        taken = self._take_prefetch(block_hashes)
        try:
            if taken is None:
                return self._run(self._client.lookup(list(block_hashes)), self.config.lookup_budget_s)
            entry, start = taken
            present = entry.present.result(timeout=self.config.lookup_budget_s)
        except (TimeoutError, concurrent.futures.TimeoutError):
            self.counters.num_lookup_timeouts += 1
            if taken is not None:
                taken[0].present.cancel()
            return 0
        self.counters.num_prefetched_matches += 1
        run = present[start:start + len(block_hashes)]
        return next((i for i, held in enumerate(run) if not held), len(run))

    def _take_prefetch(self, block_hashes: Sequence[BlockHash]) -> tuple[_Prefetch, int] | None:
        """The fresh prefetch whose chain holds ``block_hashes`` as a run, and where the run starts
        (forgotten here: a prefetch answers one admission); None if there is none."""
        with self._lock:
            found = self._prefetched.get(block_hashes[0])
            if found is None:
                return None
            entry, start = found
            if entry.hashes[start:start + len(block_hashes)] != list(block_hashes):
                return None  # another chain through the same block: left for its own match
            for block_hash in entry.hashes:
                if self._prefetched.get(block_hash, (None, 0))[0] is entry:
                    del self._prefetched[block_hash]
        return found if time.monotonic() - entry.started <= PREFETCH_TTL_S else None

    def load(self, block_hashes: Sequence[BlockHash], dst: torch.Tensor, dst_slots: Sequence[int]) -> int:
        """Land the leading ``len(dst_slots)`` blocks in ``dst[dst_slots[i]]`` within
        ``load_budget_s``, over NIXL when it can serve the load, else gRPC; how many landed."""
        n = len(dst_slots)
        client = self._client
        if client is None or n == 0:
            return 0
        started = time.monotonic()
        deadline = started + self.config.load_budget_s
        hashes = list(block_hashes[:n])
        if self._nixl is not None:
            landed = self._nixl.load(client, hashes, dst, dst_slots, deadline)
            if landed is not None:
                num_landed, timed_out = landed
                self.counters.num_load_timeouts += int(timed_out)
                self.counters.num_nixl_loaded_blocks += num_landed
                self.counters.num_nixl_loaded_bytes += num_landed * client.block_bytes
                self.counters.nixl_load_s += time.monotonic() - started
                return num_landed
        num_landed = self._load_grpc(client, hashes, dst, dst_slots, deadline)
        self.counters.num_grpc_loaded_blocks += num_landed
        self.counters.num_grpc_loaded_bytes += num_landed * client.block_bytes
        self.counters.grpc_load_s += time.monotonic() - started
        return num_landed

    def _load_grpc(self, client: KVStoreClient, hashes: list[BlockHash], dst: torch.Tensor,
                   dst_slots: Sequence[int], deadline: float) -> int:
        """``Get`` into a private staging buffer, copied into ``dst`` on this (the engine) thread."""
        staging = torch.empty((len(hashes), *dst.shape[1:]), dtype=dst.dtype)
        try:
            num_filled = self._run(client.get_into(hashes, list(staging)), max(0.0, deadline - time.monotonic()))
        except (TimeoutError, concurrent.futures.TimeoutError):
            self.counters.num_load_timeouts += 1
            return 0
        # One memcpy per run of consecutive slots (torch's copy_ per block is slow on a busy CPU).
        copy_block_runs(dst, list(dst_slots[:num_filled]), staging, list(range(num_filled)))
        return num_filled

    # ---- the loop thread -------------------------------------------------------------

    def _count_abandoned_read(self) -> None:
        self.counters.num_abandoned_reads += 1

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
