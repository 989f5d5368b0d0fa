"""The disaggregated backend's parts that need no worker: a Sample's params converted once,
the one DecodeStream reader and its error mapping, and the load policy as the null planner.
(The paths against real workers: tests/integration/test_cluster.py, test_routing.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2
from services.common.wire import FAILED_PEER_KEY, INVALID_PARAM_KEY, finish_to_proto
from services.router.backends.decode_stream import DecodeStream
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import WorkerLost, worker_error
from services.router.errors import BackendError, Overloaded, RefusedByBackend
from services.router.routing.policy import LoadPolicy
from services.router.routing.worker_pool import Worker


class FakeCall:
    """A unary-stream call that answers ``replies`` (a DecodeResponse, an AioRpcError to raise,
    or grpc.aio.EOF) one read at a time."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.is_cancelled = False

    async def read(self):
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def done(self) -> bool:
        return not self.replies

    def cancel(self) -> None:
        self.is_cancelled = True


def rpc_error(code: grpc.StatusCode, details: str = "boom", trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def decode_worker() -> Worker:
    worker = Worker("127.0.0.1:1", "decode")
    worker.is_healthy = True
    return worker


def reply(*token_ids: int, finish: str | None = None) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(token_ids=token_ids, finish_reason=finish_to_proto(finish))


def sample(prompt_logprobs: int | None = None) -> Sample:
    return Sample.create("r", [1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs), 2)


def read_all(stream: DecodeStream) -> list:
    async def run():
        try:
            return [event async for event in stream.events()]
        finally:
            await stream.close()
    return asyncio.run(run())


def test_sample_converts_params_once_and_resumes_without_prompt_logprobs():
    s = sample(prompt_logprobs=2)
    assert s.wire_params.max_tokens == 4 and s.wire_params.prompt_logprobs == 2
    assert s.renamed("r~m1").wire_params is s.wire_params  # every attempt sends the one message
    resumed = s.resumed_wire_params()
    assert not resumed.HasField("prompt_logprobs") and resumed.max_tokens == 4
    assert s.wire_params.HasField("prompt_logprobs")  # the sample's own is untouched


def test_decode_stream_yields_events_until_a_finish_and_ends_the_in_flight_share():
    worker = decode_worker()
    call = FakeCall([reply(5, 6), reply(7, finish="length")])
    stream = DecodeStream(call, worker, sample(), worker.begin(prefill_tokens=3, blocks=1))
    assert worker.local == [1, 3, 1]
    events = read_all(stream)
    assert [(e.index, e.token_ids, e.finish_reason) for e in events] == [(2, [5, 6], None), (2, [7], "length")]
    assert stream.is_finished and not call.is_cancelled and worker.local == [0, 0, 0]


def test_decode_stream_maps_a_lost_worker_and_an_early_end_to_worker_lost():
    worker = decode_worker()
    stream = DecodeStream(FakeCall([reply(5), rpc_error(grpc.StatusCode.UNAVAILABLE, "reset")]),
                          worker, sample(), worker.begin())
    with pytest.raises(WorkerLost, match="UNAVAILABLE: reset"):
        read_all(stream)
    assert not worker.is_healthy  # out of routing until a health poll passes
    worker = decode_worker()
    call = FakeCall([reply(5), grpc.aio.EOF, reply(6)])
    with pytest.raises(WorkerLost, match="without a finish reason"):
        read_all(DecodeStream(call, worker, sample(), worker.begin()))
    assert call.is_cancelled and worker.is_healthy


def test_worker_errors_before_and_after_the_first_event():
    worker = decode_worker()
    assert type(worker_error(worker, rpc_error(grpc.StatusCode.INVALID_ARGUMENT), False)) is ValueError
    # a refused constraint: the field comes in trailing metadata, never read out of the text
    refused = worker_error(worker, rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "Prefill: no good", trailing=(
        (INVALID_PARAM_KEY, "guided_regex"),)), False)
    assert isinstance(refused, RefusedByBackend) and refused.param == "guided_regex"
    assert refused.message == "Prefill: no good"
    assert isinstance(worker_error(worker, rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED), False), Overloaded)
    lost = worker_error(worker, rpc_error(grpc.StatusCode.INTERNAL, trailing=((FAILED_PEER_KEY,
                                                                              "prefill"),)), True)
    assert isinstance(lost, WorkerLost) and lost.is_peer_at_fault
    failed = worker_error(worker, rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "no"), True)
    assert type(failed) is BackendError and str(failed) == (
        "decode worker 127.0.0.1:1 failed: FAILED_PRECONDITION: no")


def test_the_load_policy_is_the_null_planner():
    policy = LoadPolicy()
    assert policy.is_configured and policy.plan_stage is None
    assert asyncio.run(policy.plan("r", [1, 2], SamplingParams(), lambda: ([], []))) is None
    assert policy.decisions.snapshot() == {"remote/load": 1}
    policy.finish("r")
    policy.close()


class FakePlacement:
    """Places every sample on ``pairs`` in order (an address already excluded is skipped)."""

    def __init__(self, prefill: list[Worker], decode: list[Worker]) -> None:
        self.workers = {"prefill": prefill, "decode": decode}

    def planned(self, role, plan, excluded):
        return None

    def pick(self, role, prompt, excluded, last_error=None):
        for worker in self.workers[role]:
            if worker.address not in excluded:
                return worker
        raise Overloaded(f"no {role} worker left")


class PrefillStub:
    """Prefill calls answered by ``replies`` in turn; each call records both workers' open
    counts as they were when it was made (what a GetStats answered then could hold)."""

    def __init__(self, workers: list[Worker], replies: list) -> None:
        self.workers, self.replies, self.seen = workers, list(replies), []

    def Prefill(self, request, timeout=None):
        self.seen.append([w.local for w in self.workers])
        return FakeCall([self.replies.pop(0)])


def test_start_prefill_counts_the_sample_before_either_worker_sees_it():
    """The load estimate (worker_pool.py) needs every request begun before a worker can hold it;
    an attempt that failed ends its share, and a retry on another pair begins a new one."""
    from services.router.backends.prefill_start import KVFullWait, PrefillSettings, start_prefill

    p0, p1, d0 = Worker("127.0.0.1:1", "prefill"), Worker("127.0.0.1:2", "prefill"), decode_worker()
    stub = PrefillStub([p0, p1, d0], [rpc_error(grpc.StatusCode.UNAVAILABLE),
                                      worker_pb2.PrefillResponse(request_id="r")])
    p0.prefill = p1.prefill = stub  # type: ignore[attr-defined]
    settings = PrefillSettings(worker_pb2.KV_TRANSFER_METHOD_GRPC)
    started = asyncio.run(start_prefill(sample(), None, FakePlacement([p0, p1], [d0]),  # type: ignore[arg-type]
                                        settings, KVFullWait(0.0)))
    assert stub.seen == [[[1, 3, 1], [0, 0, 0], [1, 0, 1]],   # p0, then p0 failed: its share ended
                         [[0, 0, 0], [1, 3, 1], [1, 0, 1]]]
    assert started.prefill is p1 and p0.local == [0, 0, 0]
    started.on_prefill.end()
    started.on_decode.end()
    assert p1.local == d0.local == [0, 0, 0]


def test_start_prefill_retries_a_call_a_draining_worker_cancelled_before_it_started():
    """grpc.aio's server.stop(grace) cancels the calls it has not started ("CANCELLED:
    CANCELLED"): a rolling restart's prefill worker, met just as it began to drain. Nothing ran
    for the sample there, so another worker takes it (test_chaos saw it fail the request)."""
    from services.router.backends.prefill_start import KVFullWait, PrefillSettings, start_prefill

    p0, p1, d0 = Worker("127.0.0.1:1", "prefill"), Worker("127.0.0.1:2", "prefill"), decode_worker()
    stub = PrefillStub([p0, p1, d0], [rpc_error(grpc.StatusCode.CANCELLED, "CANCELLED"),
                                      worker_pb2.PrefillResponse(request_id="r")])
    p0.prefill = p1.prefill = stub  # type: ignore[attr-defined]
    p0.is_healthy = True
    started = asyncio.run(start_prefill(sample(), None, FakePlacement([p0, p1], [d0]),  # type: ignore[arg-type]
                                        PrefillSettings(worker_pb2.KV_TRANSFER_METHOD_GRPC), KVFullWait(0.0)))
    assert started.prefill is p1 and len(stub.seen) == 2
    assert p0.is_healthy  # its health watch says when it drains; one cancelled call does not
    started.on_prefill.end()
    started.on_decode.end()
