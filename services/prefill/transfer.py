"""One request's KV push: prompt blocks go to the decode reservation as soon as they are final.

Prompt block ``i`` of the prefill worker goes to reserved block ``i`` of the decode worker,
except the leading ``num_cached_blocks`` the decode worker already holds in its prefix cache
(a delta transfer: those are neither sent nor waited for)::

    prompt tokens  |0 ........ B-1|B ....... 2B-1|2B .. P-1|
    final when     computed >= B   computed >= 2B  computed == P (the partial last block)

A full block is final once computed (nothing writes it again); the partial last block is final
when the whole prompt is computed. Each ``push`` sends the blocks that became final since the
previous one, in one ``send_blocks`` call, while later chunks still compute. Writes start only
while the reservation's lease allows (``lease.check()``; lease.py renews it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from engine.kv_transfer.base import RemoteInfo, TransferHandle, TransferState
from engine.mathutils import cdiv
from services.prefill.pusher import KVPusher


class TransferFailed(RuntimeError):
    """A push failed or did not finish in time; the request cannot be handed to decode."""


class WriteLease(Protocol):
    """What a transfer needs of the reservation's lease (lease.py's LeaseKeeper)."""

    @property
    def deadline(self) -> float:
        """time.monotonic() after which no write may start."""

    def check(self) -> None:
        """Raise TransferFailed (LeaseLost) unless writes are still allowed now."""


class RequestTransfer:
    def __init__(self, pusher: KVPusher, remote: RemoteInfo, request_id: str,
                 dst_block_ids: Sequence[int], block_size: int, num_prompt_tokens: int,
                 lease: WriteLease, num_cached_blocks: int = 0) -> None:
        num_prompt_blocks = cdiv(num_prompt_tokens, block_size)
        if len(dst_block_ids) != num_prompt_blocks:
            raise TransferFailed(f"the decode worker reserved {len(dst_block_ids)} blocks for a "
                                 f"{num_prompt_tokens}-token prompt; {num_prompt_blocks} are needed "
                                 f"(do both workers use block size {block_size}?)")
        if not 0 <= num_cached_blocks < num_prompt_blocks:
            raise TransferFailed(f"the decode worker says {num_cached_blocks} of the prompt's "
                                 f"{num_prompt_blocks} blocks are cached; the last block is always sent")
        self.pusher = pusher
        self.remote = remote
        self.request_id = request_id
        self.dst_block_ids = list(dst_block_ids)
        self.block_size = block_size
        self.num_prompt_tokens = num_prompt_tokens
        self.lease = lease
        self.num_cached_blocks = num_cached_blocks
        self.num_blocks_queued = num_cached_blocks  # table index of the next block to send
        self.num_blocks_sent = 0  # confirmed by the transport
        self._in_flight: list[asyncio.Future[TransferHandle]] = []

    @property
    def num_blocks_total(self) -> int:
        """Blocks that need sending (the cached prefix excluded)."""
        return len(self.dst_block_ids) - self.num_cached_blocks

    @property
    def deadline(self) -> float:
        """time.monotonic() by which every push must be confirmed (renewals move it on)."""
        return self.lease.deadline

    @property
    def is_done(self) -> bool:
        return self.num_blocks_sent == self.num_blocks_total

    def num_final_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks of the prompt's table that no later step writes."""
        if num_computed_tokens >= self.num_prompt_tokens:
            return len(self.dst_block_ids)
        return num_computed_tokens // self.block_size

    async def push(self, src_block_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Send the blocks that are final at ``num_computed_tokens``; ``src_block_ids`` is the
        request's block table on this worker (it must cover them). Raises LeaseLost when
        the reservation may no longer be written."""
        end = min(self.num_final_blocks(num_computed_tokens), len(src_block_ids))
        if end <= self.num_blocks_queued:
            return
        self.lease.check()
        start, self.num_blocks_queued = self.num_blocks_queued, end
        self._in_flight.append(await self.pusher.send(
            self.request_id, src_block_ids[start:end], self.remote, self.dst_block_ids[start:end]))

    def collect(self) -> bool:
        """Account finished pushes; True if more blocks were confirmed. Raises TransferFailed."""
        confirmed = 0
        for future in [f for f in self._in_flight if f.done()]:
            self._in_flight.remove(future)
            handle = future.result()
            if handle.state is not TransferState.DONE:
                raise TransferFailed(f"KV push of {handle.num_blocks} blocks failed: {handle.error}")
            confirmed += handle.num_blocks
        self.num_blocks_sent += confirmed
        return confirmed > 0

    def collect_quietly(self) -> None:
        """Account the pushes that ended successfully, ignoring failed ones (for counters)."""
        for future in [f for f in self._in_flight if f.done()]:
            self._in_flight.remove(future)
            if not future.cancelled() and future.exception() is None:
                handle = future.result()
                if handle.state is TransferState.DONE:
                    self.num_blocks_sent += handle.num_blocks

    async def wait_all(self) -> AsyncIterator[int]:
        """Yield ``num_blocks_sent`` each time it grows until every block is confirmed."""
        while not self.is_done:
            if not self._in_flight:
                raise TransferFailed(f"{len(self.dst_block_ids) - self.num_blocks_queued} blocks "
                                     "were never queued (the prompt was not fully computed)")
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TransferFailed(self._late_message())
            await asyncio.wait(self._in_flight, timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
            if self.collect():
                yield self.num_blocks_sent

    async def settle(self, timeout_s: float) -> None:
        """Wait (bounded) until no push is in flight, whatever their outcome: until then the
        source blocks and the reserved destination blocks must not be reused."""
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=timeout_s)

    def _late_message(self) -> str:
        return (f"KV of {self.request_id!r} was not pushed before the decode reservation's "
                f"lease runs out ({self.num_blocks_sent}/{self.num_blocks_total} blocks confirmed)")
