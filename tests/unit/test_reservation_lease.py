"""The decode reservation table's lease: renewal moves it on, a claim refreshes it, nothing
moves it back, and a released or unknown reservation cannot be renewed (in-process, exact
times passed in)."""

from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParams
from services.decode.reservations import LeaseState, ReservationTable


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
