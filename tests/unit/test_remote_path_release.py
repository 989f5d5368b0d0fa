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
from services.router.backends.remote_path import TransferSeen, _drain, _release_after


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
