"""The decode reservation table's lease: renewal moves it on, a claim refreshes it, nothing
moves it back, and a released or unknown reservation cannot be renewed (in-process, exact
times passed in)."""

from __future__ import annotations

import asyncio

import pytest

from engine.kv_transfer.base import KVNotification
from engine.sampling_params import SamplingParams
from services.decode.reservations import EarlyReleases, LeaseState, ReservationTable


def _run(scenario):
    async def main():
        scenario()
    asyncio.run(main())


def test_renewal_keeps_a_leased_reservation_past_its_first_lease():
    def scenario():
        table = ReservationTable(lease_s=6.0)
        reservation = table.add("slow", [1, 2], SamplingParams(), [3])
        first_expiry = reservation.expires_at
        assert table.renew("slow", now=first_expiry - 1.0) is reservation
        assert reservation.expires_at == first_expiry + 5.0
        assert table.expired(first_expiry + 0.5) == []
        assert table.expired(first_expiry + 5.0) == [reservation]
        # a late or reordered renewal never shortens it
        assert table.renew("slow", now=first_expiry - 3.0) is reservation
        assert reservation.expires_at == first_expiry + 5.0
    _run(scenario)


def test_without_renewal_the_lease_runs_out_as_before():
    def scenario():
        table = ReservationTable(lease_s=2.0)
        reservation = table.add("crashed-prefill", [1], SamplingParams(), [0])
        assert table.expired(reservation.expires_at - 0.01) == []
        assert table.expired(reservation.expires_at) == [reservation]
    _run(scenario)


def test_released_or_unknown_reservations_cannot_be_renewed():
    def scenario():
        table = ReservationTable(lease_s=5.0)
        reservation = table.add("r", [1], SamplingParams(), [0])
        expiry = reservation.expires_at
        table.mark_released("r")
        assert table.renew("r", now=expiry) is None
        assert reservation.expires_at == expiry
        assert table.renew("never-made") is None
        table.pop("r")
        assert table.renew("r") is None
    _run(scenario)


def test_claim_refreshes_the_lease_and_renewal_extends_a_claimed_or_abandoned_one():
    def scenario():
        table = ReservationTable(lease_s=4.0)
        reservation = table.add("r", [1], SamplingParams(), [0, 1])
        t0 = reservation.expires_at - 4.0
        claimed = table.claim("r", now=t0 + 3.0)
        assert claimed.state is LeaseState.CLAIMED and claimed.expires_at == t0 + 7.0
        assert table.renew("r", now=t0 + 6.0).expires_at == t0 + 10.0
        table.abandon("r")  # its Decode call ended while KV was arriving
        assert table.renew("r", now=t0 + 9.0).expires_at == t0 + 13.0
        assert table.expired(t0 + 12.9) == [] and table.expired(t0 + 13.0) == [reservation]
    _run(scenario)


def test_housekeeping_sleeps_at_rest_polls_while_kv_is_expected_and_wakes_for_expiry():
    def scenario():
        table = ReservationTable(lease_s=6.0)
        assert table.poll_delay(0.002, 1.0) == 1.0  # nothing reserved: the longest sleep
        assert not table.added.is_set()
        pending = table.add("pending", [1, 2], SamplingParams(), [3, 4])
        assert table.added.is_set()  # wakes a sleeping housekeeper
        assert table.poll_delay(0.002, 1.0) == 0.002  # its KV is expected: poll notifications
        table.on_landed(KVNotification("pending", (3, 4)))
        # landed and not claimed: nothing to poll, but its lease runs out at expires_at
        now = pending.expires_at - 0.25
        assert table.poll_delay(0.002, 1.0, now=now) == 0.25
        assert table.poll_delay(0.002, 1.0, now=pending.expires_at + 1.0) == 0.0
        table.claim("pending", now=now)  # decoding: the lease no longer releases it
        assert table.poll_delay(0.002, 1.0, now=now) == 1.0
        # a reservation whose blocks were all cached (none to write) is landed when made
        cached = table.add("cached", [1], SamplingParams(), [])
        assert table.poll_delay(0.002, 1.0, now=cached.expires_at - 0.5) == 0.5
    _run(scenario)


def test_an_early_release_refuses_only_its_own_attempt_once_and_is_forgotten_in_time():
    early = EarlyReleases(ttl_s=10.0, max_entries=3)
    early.note("a", now=100.0)
    assert not early.take("b", now=101.0)  # a retry of the same request: another attempt
    assert early.take("a", now=101.0)
    assert not early.take("a", now=101.5)  # taken once
    early.note("c", now=102.0)
    assert early.take("c", now=111.9)
    early.note("d", now=102.0)
    assert not early.take("d", now=112.0)  # its time ran out
    assert len(early) == 0


def test_early_releases_stay_bounded_the_oldest_going_first():
    early = EarlyReleases(ttl_s=10.0, max_entries=3)
    for i, attempt in enumerate("abcd"):
        early.note(attempt, now=100.0 + i)
    assert len(early) == 3
    assert not early.take("a", now=104.0)
    early.note("b", now=105.0)  # noted again: now the newest
    early.note("e", now=105.0)
    assert [early.take(x, now=105.0) for x in "bcde"] == [True, False, True, True]
    early.note("f", now=106.0)
    early.note("g", now=117.0)  # f's time ran out on the way
    assert len(early) == 1
    with pytest.raises(ValueError, match="must be positive"):
        EarlyReleases(ttl_s=0.0)
