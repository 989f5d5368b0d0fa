"""The push thread's guard past a push's deadline (services/prefill/kv_grpc_sender.py).

gRPC's own deadline ends the push in the integration test (test_kv_transfer.py, a frozen
receiver); this checks what happens should a call outlive it anyway: cancelled, reported as
DEADLINE_EXCEEDED, and the guard waits neither less nor much more than deadline + guard."""

from __future__ import annotations

import time

import grpc
import pytest

from services.prefill.kv_grpc_sender import PushTimedOut, call_push_blocks, push_error


class _Unanswered:
    """A PushBlocks call whose answer never comes (what grpc's future gives to wait on)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.waited_s: float | None = None

    def result(self, timeout: float | None = None) -> None:
        assert timeout is not None, "the push waited without a bound"
        self.waited_s = timeout
        time.sleep(timeout)
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _Stub:
    def __init__(self, call: _Unanswered) -> None:
        self.PushBlocks = self
        self.call = call
        self.timeout: float | None = None

    def future(self, requests, timeout: float | None = None) -> _Unanswered:
        self.timeout = timeout
        return self.call


def test_a_push_past_deadline_and_guard_is_cancelled_and_reported():
    call = _Unanswered()
    stub = _Stub(call)
    started = time.monotonic()
    with pytest.raises(PushTimedOut, match=r"no answer 0.15 s after the push began"):
        call_push_blocks(stub, iter([]), timeout_s=0.05, guard_s=0.1)  # type: ignore[arg-type]
    assert stub.timeout == 0.05  # gRPC's deadline is the push's timeout
    assert call.waited_s == pytest.approx(0.15) and call.cancelled
    assert time.monotonic() - started >= 0.15


def test_a_push_error_names_the_grpc_status_first():
    assert push_error(PushTimedOut("no answer 1.5 s after the push began")) == (
        "DEADLINE_EXCEEDED: no answer 1.5 s after the push began")
    assert push_error(ValueError("bad")) == "ValueError: bad"
