"""The kvstore tier's NIXL loads: READ the store's blocks into a registered staging region, then
copy them into the engine's host slots on the engine thread.

    loader = NixlLoader(compat, num_staging_blocks=128, loop=tier_loop)   # on the loop thread
    landed = loader.load(client, hashes, dst, dst_slots, deadline)         # engine thread
    # (num_landed, timed_out), or None: NIXL cannot serve this load now (the store has no
    # NIXL, the region is busy): use Get

One load is a PrepareRead (the store leases the blocks against eviction), a NIXL READ of the
leased slots into the staging region, and a Release, per chunk of at most ``num_staging_blocks``
blocks (``KVStoreClient.read_into``); the lease is released on every path, and if this worker
dies the store's lease expires by itself (``tests/integration/test_kvstore_tier_nixl.py``).

Why a staging region and not the engine's host slots: ``KVStoreTier.load`` runs on the engine
thread with a budget. A READ that has not completed when the budget runs out is abandoned, the
engine takes the host slots it reserved back and may reuse them at once, but UCX gives no
guarantee that an abandoned READ stops writing its destination (releasing the request asks to
cancel it). READing into the host slots directly would need the slots to stay reserved until
every READ into them is proven finished, which the ``LowerTier`` contract (slots are the
engine's again when ``load`` returns) does not give. So the READ lands here, in memory only this
object owns, and the engine thread copies the landed blocks into its host slots itself, after
the READ completed and before ``load`` returns.

Ownership, one owner at a time: the engine thread sets ``busy`` and hands the region to a read
on the tier's loop thread; the read clears ``busy`` when it has finished (DONE, FAILED, or
abandoned at the deadline) and released its lease; only then may the engine thread copy out or
start the next read. A region with an abandoned READ (``is_tainted``) is never read into or
copied from again: the tier parks it (kept alive, so a late write lands in memory nobody uses)
and makes a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.host_pool import copy_block_runs
from engine.kv_transfer.base import KVCompat, KVTransferError
from services.kvstore.client import KVStoreClient
from services.kvstore.nixl_reader import NixlBlockReader
from services.kvstore.region import torch_dtype

log = logging.getLogger(__name__)
MAX_PARKED = 2  # tainted regions replaced by fresh ones; at the next, loads go over gRPC for good


class NixlStaging:
    """``num_blocks`` host blocks in ``compat``'s layout, registered with a NIXL agent (UCX).

    Construction raises KVTransferError (naming why) when NIXL cannot make the agent here.
    Pages are committed when first written, so an unused region costs address space only."""

    def __init__(self, compat: KVCompat, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a staging region needs at least one block, got {num_blocks}")
        self.compat = compat
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.blocks = torch.empty((num_blocks, *compat.block_shape), dtype=torch_dtype(compat.dtype))
        self.reader = NixlBlockReader(compat.model_name, self.blocks)
        self.busy = False  # a read on the loop thread owns the region (see the module docstring)

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def is_tainted(self) -> bool:
        """An abandoned READ may still write here: never use this region again."""
        return self.reader.num_abandoned > 0

    def check_destination(self, dst: torch.Tensor) -> None:
        """ValueError unless ``dst`` ([num_slots, *block_shape]) has this region's block layout."""
        if tuple(dst.shape[1:]) != tuple(self.blocks.shape[1:]) or dst.dtype != self.blocks.dtype:
            raise ValueError(f"load destination must be [n, *{tuple(self.blocks.shape[1:])}] "
                             f"{self.blocks.dtype} (the kvstore tier's compat), got "
                             f"{tuple(dst.shape)} {dst.dtype}")

    def close(self) -> None:
        self.reader.close()


class NixlLoader:
    """NIXL loads for ``KVStoreTier``: ``load`` on the engine thread, the reads on ``loop``'s
    thread. Build it on the loop thread (the agent lives there); KVTransferError if NIXL
    cannot make an agent here."""

    def __init__(self, compat: KVCompat, num_staging_blocks: int, loop: asyncio.AbstractEventLoop,
                 on_abandoned: Callable[[], None] = lambda: None) -> None:
        self._loop = loop
        self._on_abandoned = on_abandoned  # called on the loop thread, once per abandoned READ
        self.staging: NixlStaging | None = NixlStaging(compat, num_staging_blocks)
        self._parked: list[NixlStaging] = []

    def load(self, client: KVStoreClient, block_hashes: Sequence[BlockHash], dst: torch.Tensor,
             dst_slots: Sequence[int], deadline: float) -> tuple[int, bool] | None:
        """Engine thread: land the leading blocks of ``block_hashes`` in ``dst[dst_slots[i]]``
        by ``deadline`` (``time.monotonic()``); (how many landed, whether the deadline cut the
        load short), or None when NIXL cannot serve this load (nothing was written).
        ValueError if ``dst`` is not in the compat's layout."""
        staging = self.staging
        if staging is None or staging.busy or staging.is_tainted:
            return None  # a read that ran out of time is still finishing, or NIXL was given up
        staging.check_destination(dst)
        num_landed, timed_out = 0, False
        for start in range(0, len(dst_slots), staging.num_blocks):
            chunk = list(block_hashes[start:start + staging.num_blocks])
            staging.busy = True
            future = asyncio.run_coroutine_threadsafe(self._read(staging, client, chunk, deadline), self._loop)
            try:
                num_read = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except (TimeoutError, concurrent.futures.TimeoutError):
                # Not cancelled: the read stops at the same deadline by itself, releases its
                # lease and clears ``busy``; nothing of it is copied.
                timed_out = True
                break
            if num_read is None:  # the store serves no NIXL (restarted without it)
                return None if num_landed == 0 else (num_landed, False)
            copy_block_runs(dst, list(dst_slots[start:start + num_read]), staging.blocks, list(range(num_read)))
            num_landed += num_read
            if num_read < len(chunk):
                break
        return num_landed, timed_out

    async def _read(self, staging: NixlStaging, client: KVStoreClient, block_hashes: list[BlockHash],
                    deadline: float) -> int | None:
        """Loop thread: READ ``block_hashes`` into ``staging``'s leading blocks; how many landed
        (all or 0), None when the store serves no NIXL. Clears ``staging.busy`` when done."""
        try:
            serves_nixl = await client.serves_nixl()
            if not serves_nixl:
                return None if serves_nixl is False else 0
            return await client.read_into(staging.reader, block_hashes, range(len(block_hashes)), deadline)
        finally:
            if staging.is_tainted:
                self._on_abandoned()
                self._retire(staging)
            staging.busy = False

    def _retire(self, staging: NixlStaging) -> None:
        """Loop thread: park a tainted region and put a fresh one in its place (up to
        MAX_PARKED). The tainted one stays in place while the fresh one registers (``load``
        refuses it: gRPC meanwhile), so ``staging`` never reads None for a moment on the way
        from one region to the next; None means NIXL was given up."""
        self._parked.append(staging)
        fresh = None
        if len(self._parked) > MAX_PARKED:
            log.warning("kvstore tier: %d NIXL READs abandoned at their deadline; loading over "
                        "gRPC from now on", len(self._parked))
        else:
            try:
                fresh = NixlStaging(staging.compat, staging.num_blocks)
            except KVTransferError as error:
                log.warning("kvstore tier: no new NIXL staging region (%s); loading over gRPC", error)
        self.staging = fresh

    def close(self) -> None:
        """Loop thread: deregister every region (the process is about to stop using them)."""
        for region in [*self._parked, *([self.staging] if self.staging is not None else [])]:
            region.close()
        self._parked.clear()
        self.staging = None
