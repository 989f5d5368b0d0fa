"""Blocks a decode worker holds for prompts whose KV a prefill worker is writing.

Life of a reservation (its id is the engine request id)::

                 RenewReservation (while LEASED, CLAIMED or ABANDONED: expires_at moves on)
    ReserveBlocks ──▶ LEASED ──(Decode RPC)──▶ CLAIMED ──(all blocks landed)──▶ decoding
                        │                       │   (the Decode call ends early,
                        │                       ▼    KV still arriving)
                        │                    ABANDONED ──(all blocks landed)──┐
                        └──(lease runs out, or ReleaseBlocks)─────────────────┴──▶ RELEASED

* The lease: every live reservation has ``expires_at``. ReserveBlocks sets it to now +
  ``lease_s``; RenewReservation and the Decode claim move it to now + ``lease_s`` (never
  back). The prefill worker renews every ``lease_s / 3`` while its job runs — queued behind
  other prompts, computing, or pushing — so a slow prefill keeps its blocks, while a crashed
  prefill worker or router stops renewing and loses them: a LEASED or ABANDONED reservation
  past ``expires_at`` is released, and a CLAIMED one's Decode call gives up at it.
* No write lands after a release by the lease: the prefill worker writes only until
  ``LEASE_SAFETY * lease_s`` after it *sent* the last ReserveBlocks / RenewReservation that
  was acknowledged, and that call *arrived* here before ``expires_at - lease_s``.
* Landing is counted per block id: each KV notification (one per sender ``send_blocks`` call,
  NIXL or gRPC) names destination blocks; the reservation is complete when every reserved
  block has landed. Notifications for unknown or released reservations are ignored.
* A Decode call that ends before the KV landed (client cancel) cannot free the blocks at
  once: a NIXL write may still be on its way. The reservation is ABANDONED and released when
  the prefill worker says it stopped writing (ReleaseBlocks, sent after its pushes settled),
  when every block has landed, or when the lease runs out, whichever comes first.
* gRPC pushes check in (``begin_push``) and out; a release waits for pushes in progress to
  end before the blocks go back to the pool.

This table is plain data, used from the event loop only; freeing the engine's blocks is the
caller's job (services/decode/handler.py), and so is the polling: ``poll_delay`` says how long
the caller's housekeeping may sleep (a short poll while KV is expected; else until the next lease
can run out, at most ``max_idle_s``), and ``added`` wakes it when a reservation is made.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from engine.kv_transfer.base import KVNotification
from engine.sampling_params import SamplingParams


class LeaseState(enum.Enum):
    LEASED = "leased"
    CLAIMED = "claimed"
    ABANDONED = "abandoned"
    RELEASED = "released"


@dataclass(eq=False)
class Reservation:
    reservation_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]  # the blocks the sender writes: the prompt's table after its cached prefix
    expires_at: float  # time.monotonic(); moved on by renew() and claim()
    state: LeaseState = LeaseState.LEASED
    num_cached_blocks: int = 0  # leading blocks of the table reused from the prefix cache
    landed_block_ids: set[int] = field(default_factory=set)
    num_active_pushes: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # landed, released, push ended

    @property
    def is_landed(self) -> bool:
        return len(self.landed_block_ids) == len(self.block_ids)

    def notify(self) -> None:
        self.changed.set()


class ReservationTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._reservations: dict[str, Reservation] = {}
        self.added = asyncio.Event()  # set by add(); the housekeeper clears it when it wakes

    def __len__(self) -> int:
        return len(self._reservations)

    def __contains__(self, reservation_id: str) -> bool:
        return reservation_id in self._reservations

    def add(self, reservation_id: str, prompt_token_ids: list[int], params: SamplingParams,
            block_ids: list[int], num_cached_blocks: int = 0) -> Reservation:
        if reservation_id in self._reservations:
            raise ValueError(f"reservation {reservation_id!r} already exists")
        reservation = Reservation(reservation_id, list(prompt_token_ids), params, list(block_ids),
                                  time.monotonic() + self.lease_s, num_cached_blocks=num_cached_blocks)
        self._reservations[reservation_id] = reservation
        self.added.set()
        return reservation

    def get(self, reservation_id: str) -> Reservation | None:
        return self._reservations.get(reservation_id)

    def claim(self, reservation_id: str, now: float | None = None) -> Reservation:
        """LEASED -> CLAIMED, with a fresh lease: its Decode call waits for the KV until
        ``expires_at`` (renewals move it on). KeyError if unknown, released or claimed."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.state is not LeaseState.LEASED:
            raise KeyError(reservation_id)
        reservation.state = LeaseState.CLAIMED
        self._extend(reservation, now)
        return reservation

    def renew(self, reservation_id: str, now: float | None = None) -> Reservation | None:
        """Hold a live reservation for ``lease_s`` more from ``now``; None if it is unknown
        (never made, or already handed over to decoding) or released."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.state is LeaseState.RELEASED:
            return None
        self._extend(reservation, now)  # a Decode call waiting for its KV re-reads it
        return reservation

    def _extend(self, reservation: Reservation, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        reservation.expires_at = max(reservation.expires_at, now + self.lease_s)

    def on_landed(self, note: KVNotification) -> Reservation | None:
        """Count a notification's blocks; returns the reservation if it is now complete."""
        reservation = self._reservations.get(note.request_id)
        if reservation is None or reservation.state is LeaseState.RELEASED or reservation.is_landed:
            return None
        reservation.landed_block_ids.update(set(note.dst_block_ids) & set(reservation.block_ids))
        reservation.notify()
        return reservation if reservation.is_landed else None

    def begin_push(self, reservation_id: str, dst_block_ids: list[int]) -> str | None:
        """A gRPC push wants to write ``dst_block_ids``: None if allowed, else why not."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.state is LeaseState.RELEASED:
            return f"no live reservation {reservation_id!r} (never made, expired or released)"
        stray = sorted(set(dst_block_ids) - set(reservation.block_ids))
        if stray:
            return (f"blocks {stray[:8]} are not reserved for {reservation_id!r} "
                    f"(it holds {reservation.block_ids[:16]})")
        reservation.num_active_pushes += 1
        return None

    def end_push(self, reservation_id: str) -> None:
        reservation = self._reservations.get(reservation_id)
        if reservation is not None:
            reservation.num_active_pushes -= 1
            reservation.notify()

    def expired(self, now: float | None = None) -> list[Reservation]:
        now = time.monotonic() if now is None else now
        return [r for r in self._reservations.values()
                if r.state in (LeaseState.LEASED, LeaseState.ABANDONED) and r.expires_at <= now]

    def abandon(self, reservation_id: str) -> None:
        """CLAIMED -> ABANDONED: its Decode call ended before the KV landed."""
        reservation = self._reservations.get(reservation_id)
        if reservation is not None and reservation.state is LeaseState.CLAIMED:
            reservation.state = LeaseState.ABANDONED

    def has_pending_kv(self) -> bool:
        return any(r.state is not LeaseState.RELEASED and not r.is_landed
                   for r in self._reservations.values())

    def poll_delay(self, busy_s: float, max_idle_s: float, now: float | None = None) -> float:
        """How long housekeeping may sleep: ``busy_s`` while KV is expected (notifications to
        count); else until the first LEASED or ABANDONED reservation's lease runs out, at most
        ``max_idle_s``. At rest (nothing reserved) that is ``max_idle_s``: nothing can land or
        expire before ``add`` sets ``added``."""
        if self.has_pending_kv():
            return busy_s
        now = time.monotonic() if now is None else now
        deadlines = [r.expires_at for r in self._reservations.values()
                     if r.state in (LeaseState.LEASED, LeaseState.ABANDONED)]
        return max(0.0, min([max_idle_s, *(d - now for d in deadlines)]))

    def mark_released(self, reservation_id: str) -> Reservation | None:
        """Stop accepting writes and wake its waiter; the caller frees the blocks, then ``pop``s."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.state is LeaseState.RELEASED:
            return None
        reservation.state = LeaseState.RELEASED
        reservation.notify()
        return reservation

    def pop(self, reservation_id: str) -> Reservation | None:
        return self._reservations.pop(reservation_id, None)


class EarlyReleases:
    """ReleaseBlocks calls that overtook the ReserveBlocks call they undo.

    A prefill worker whose ReserveBlocks call was cancelled or timed out unanswered releases
    by request id and ``attempt_id`` (unique per call). gRPC does not order two calls: that
    ReleaseBlocks can be served here before the ReserveBlocks handler starts (and finds
    nothing), while the ReserveBlocks call's own cancellation is delivered too late to stop it.
    So the release is remembered by attempt, and ReserveBlocks ``take``\\ s it at its start:
    found, the call is refused and reserves nothing. Keyed by attempt, not request id, so a
    retry of the request on this worker is not refused. Entries live ``ttl_s`` (longer than
    any ReserveBlocks deadline), at most ``max_entries`` of them (the oldest go first)."""

    def __init__(self, ttl_s: float = 120.0, max_entries: int = 4096) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError(f"EarlyReleases: ttl_s and max_entries must be positive, got "
                             f"{ttl_s} and {max_entries}")
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._expires: dict[str, float] = {}  # attempt id -> when it is forgotten (in order)

    def note(self, attempt_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._prune(now)
        self._expires.pop(attempt_id, None)  # re-inserted last: the order stays by expiry
        self._expires[attempt_id] = now + self.ttl_s
        while len(self._expires) > self.max_entries:
            del self._expires[next(iter(self._expires))]

    def take(self, attempt_id: str, now: float | None = None) -> bool:
        """Was ``attempt_id`` released before this moment (and not forgotten)? Forgets it."""
        self._prune(time.monotonic() if now is None else now)
        return self._expires.pop(attempt_id, None) is not None

    def __len__(self) -> int:
        return len(self._expires)

    def _prune(self, now: float) -> None:
        while self._expires:
            attempt_id, expires_at = next(iter(self._expires.items()))
            if expires_at > now:
                break
            del self._expires[attempt_id]
