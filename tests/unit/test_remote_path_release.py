"""The router's release of a decode reservation after an early exit (remote_path._release_after):
released when the prefill worker had finished its pushes, as the router read it (the ``done``
event) or as the call's status says (OK); left to the prefill worker otherwise. A cancelled
stream whose prefill had finished once leaked 3 blocks on the decode worker until the lease."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.pb import worker_pb2
from services.router.backends.remote_path import TransferSeen, _drain, _drain_then_release, _release_after


class FakeCall:
    def __init__(self, responses: list[worker_pb2.PrefillResponse], code: grpc.StatusCode) -> None:
        self.responses, self._code = list(responses), code

    async def read(self):
        return self.responses.pop(0) if self.responses else grpc.aio.EOF

    async def code(self) -> grpc.StatusCode:
        return self._code


class FakeDecode:
    def __init__(self) -> None:
        self.released: list[str] = []
        self.address = "127.0.0.1:1"
        self.decode = SimpleNamespace(ReleaseBlocks=self._release)

    async def _release(self, request: worker_pb2.ReleaseBlocksRequest, timeout: float) -> None:
        self.released.append(request.reservation_id)


def progress(done: bool) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(transfer=worker_pb2.TransferProgress(
        num_blocks_sent=3, num_blocks_total=3, done=done))


@pytest.mark.parametrize("events, code, released", [
    ([progress(False), progress(True)], grpc.StatusCode.CANCELLED, True),  # read done, then cancelled
    ([progress(False)], grpc.StatusCode.CANCELLED, False),  # pushes may be in flight: prefill's job
    ([progress(False)], grpc.StatusCode.OK, True),  # finished: handed over
])
def test_a_reservation_is_released_once_the_pushes_are_known_done(events, code, released):
    async def scenario() -> list[str]:
        call, decode, transfer = FakeCall(events, code), FakeDecode(), TransferSeen()
        await _drain(call, SimpleNamespace(address="127.0.0.1:2"), transfer)
        assert transfer.done == any(e.transfer.done for e in events)
        await _release_after(call, decode, "r1", transfer)
        return decode.released

    assert asyncio.run(scenario()) == (["r1"] if released else [])


class SlowCall(FakeCall):
    """A prefill stream whose events arrive ``delay_s`` apart; cancel() ends it CANCELLED."""

    def __init__(self, responses, delay_s: float) -> None:
        super().__init__(responses, grpc.StatusCode.OK)
        self.delay_s, self.cancelled = delay_s, False

    async def read(self):
        await asyncio.sleep(self.delay_s)
        return await super().read()

    def cancel(self) -> None:
        self.cancelled, self._code = True, grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("delay_s, released", [
    (0.01, True),  # the pushes end: done read, released (cancelling it could miss done)
    (1.0, False),  # still pushing at the timeout: cancelled, left to the prefill worker
])
def test_an_abandoned_sample_reads_the_prefill_stream_to_its_end_before_releasing(delay_s, released):
    async def scenario() -> tuple[list[str], bool]:
        call, decode, transfer = SlowCall([progress(False), progress(True)], delay_s), FakeDecode(), TransferSeen()
        rest = asyncio.ensure_future(_drain(call, SimpleNamespace(address="127.0.0.1:2"), transfer))
        await _drain_then_release(call, rest, decode, "r1", transfer, timeout_s=0.5)
        return decode.released, call.cancelled

    assert asyncio.run(scenario()) == ((["r1"], False) if released else ([], True))
