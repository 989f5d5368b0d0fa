"""Many Decode and Generate calls on one DecodeMany stream: the worker's end (services/decode/decode_many.py)
and the router's (services/router/backends/decode_mux.py) over a real gRPC server in this
process, with a scripted ``decode`` per request in place of the engine (the real one:
tests/integration/test_cluster.py and the chaos tests run every remote request through it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import InvalidArgument, NotFound
from services.common.grpc_server import start_grpc_server
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import FAILED_PEER_KEY, finish_to_proto
from services.decode.decode_many import CallWriter, serve_decode_many
from services.router.backends.decode_mux import DecodeMuxes
from services.router.routing.worker_pool import Worker


class Scripted(worker_pb2_grpc.DecodeServiceServicer):
    """``decode`` per request id: "ok-N" streams N tokens, one per engine step (a step every
    2 ms, every running request's output at once, as the engine hands them over), then
    finishes; "missing" raises NotFound naming the prefill side; "hang" waits until cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.swallowed: list[str] = []
        self.step = asyncio.Event()
        self.clock: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.002)
            self.step.set()
            self.step.clear()

    async def next_step(self) -> None:
        if self.clock is None:
            self.clock = asyncio.ensure_future(self._tick())
        await self.step.wait()

    async def DecodeMany(self, requests, context):
        await serve_decode_many(requests, context, self.decode, self.generate)

    async def generate(self, request: worker_pb2.GenerateLocalRequest, outbox: CallWriter) -> None:
        """A Generate call: "gen-N" streams tokens N.. after the resumed ones, "gen-bad" is
        refused as bad input."""
        rid = request.request_id
        if rid == "gen-bad":
            raise InvalidArgument("Generate: prompt_token_ids is empty: give at least one token")
        start = len(request.resumed_output_token_ids)
        n = int(rid.split("-")[1])
        for i in range(start, n):
            await self.next_step()
            await outbox.write(worker_pb2.DecodeResponse(
                request_id=rid, token_ids=[100 + i], finish_reason=finish_to_proto("length" if i == n - 1 else None)))

    async def decode(self, request: worker_pb2.DecodeRequest, outbox: CallWriter) -> None:
        rid = request.request_id
        try:
            if rid == "missing":
                raise NotFound(f"Decode: no reservation {rid!r}", failed_peer="prefill")
            if rid.startswith("hang"):
                await asyncio.sleep(3600)
            if rid.startswith("swallow"):  # loses its cancel, as 3.11's wait_for can
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.swallowed.append(rid)
            n = int(rid.split("-")[1])
            for i in range(n):
                await self.next_step()
                last = i == n - 1
                await outbox.write(worker_pb2.DecodeResponse(
                    request_id=rid, token_ids=[i], finish_reason=finish_to_proto("length" if last else None)))
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


async def with_worker(scenario):
    servicer = Scripted()
    server = await start_grpc_server([(worker_pb2_grpc.add_DecodeServiceServicer_to_server, servicer)])
    worker = Worker(server.address, "decode")
    worker.connect()
    muxes = DecodeMuxes()
    try:
        return await scenario(servicer, server, worker, muxes)
    finally:
        if servicer.clock is not None:
            servicer.clock.cancel()
        await muxes.close()
        await worker.close()
        await server.stop(0)


async def read_all(call) -> list[int]:
    tokens = []
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens += list(response.token_ids)
    return tokens


def test_calls_on_one_stream_get_their_own_outputs_batched_into_few_messages():
    async def scenario(servicer, server, worker, muxes):
        calls = [muxes.start(worker, worker_pb2.DecodeRequest(request_id=f"ok-{20 + i}"), 30)
                 for i in range(16)]
        results = await asyncio.gather(*(read_all(c) for c in calls))
        assert results == [list(range(20 + i)) for i in range(16)]
        assert all(c.done() for c in calls)
        total = sum(20 + i for i in range(16))
        (stream,) = muxes._streams.values()
        assert stream.num_messages < total / 4, (stream.num_messages, total)  # per step, not per token
    asyncio.run(with_worker(scenario))


def test_generate_calls_share_the_stream_with_decode_calls():
    async def scenario(servicer, server, worker, muxes):
        decodes = [muxes.start(worker, worker_pb2.DecodeRequest(request_id=f"ok-{10 + i}"), 30) for i in range(4)]
        generates = [muxes.start(worker, worker_pb2.GenerateLocalRequest(request_id=f"gen-{12 + i}"), 30)
                     for i in range(4)]
        resumed = muxes.start(worker, worker_pb2.GenerateLocalRequest(
            request_id="gen-9", resumed_output_token_ids=[100, 101, 102]), 30)
        bad = muxes.start(worker, worker_pb2.GenerateLocalRequest(request_id="gen-bad"), 30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad.read()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()
        results = await asyncio.gather(*(read_all(c) for c in decodes + generates + [resumed]))
        assert results[:4] == [list(range(10 + i)) for i in range(4)]
        assert results[4:8] == [[100 + t for t in range(12 + i)] for i in range(4)]
        assert results[8] == [103, 104, 105, 106, 107, 108]  # after the three it resumed from
        assert len(muxes._streams) == 1  # all on one stream
    asyncio.run(with_worker(scenario))


def test_a_failed_call_ends_with_its_own_status_and_the_others_go_on():
    async def scenario(servicer, server, worker, muxes):
        ok = muxes.start(worker, worker_pb2.DecodeRequest(request_id="ok-30"), 30)
        bad = muxes.start(worker, worker_pb2.DecodeRequest(request_id="missing"), 30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad.read()
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        assert "no reservation 'missing'" in err.value.details()
        assert (FAILED_PEER_KEY, "prefill") in tuple(err.value.trailing_metadata())
        assert await read_all(ok) == list(range(30))
    asyncio.run(with_worker(scenario))


def test_cancel_and_deadline_cancel_the_call_on_the_worker():
    async def scenario(servicer, server, worker, muxes):
        cancelled = muxes.start(worker, worker_pb2.DecodeRequest(request_id="hang-1"), 30)
        late = muxes.start(worker, worker_pb2.DecodeRequest(request_id="hang-2"), 0.2)
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await late.read()
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if sorted(servicer.cancelled) == ["hang-1", "hang-2"]:
                break
            await asyncio.sleep(0.01)
        assert sorted(servicer.cancelled) == ["hang-1", "hang-2"]
        assert cancelled.done() and late.done()
        assert await read_all(muxes.start(worker, worker_pb2.DecodeRequest(request_id="ok-3"), 30)) == [0, 1, 2]
    asyncio.run(with_worker(scenario))


def test_a_call_whose_cancel_was_lost_ends_at_its_next_write():
    async def scenario(servicer, server, worker, muxes):
        call = muxes.start(worker, worker_pb2.DecodeRequest(request_id="swallow-1000"), 30)
        await asyncio.sleep(0.1)
        call.cancel()
        for _ in range(100):
            if servicer.cancelled:
                break
            await asyncio.sleep(0.01)
        assert servicer.swallowed == ["swallow-1000"] and servicer.cancelled == ["swallow-1000"]
        (stream,) = muxes._streams.values()
        assert stream.num_messages == 0  # not one token went out after the cancel
    asyncio.run(with_worker(scenario))


def test_a_worker_that_goes_away_fails_every_call_and_the_next_start_opens_a_new_stream():
    async def scenario(servicer, server, worker, muxes):
        calls = [muxes.start(worker, worker_pb2.DecodeRequest(request_id=f"hang-{i}"), 30) for i in range(3)]
        await asyncio.sleep(0.1)
        first_stream = next(iter(muxes._streams.values()))
        await server.stop(0)
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err.value
        assert first_stream.closed and not muxes._streams
        again = muxes.start(worker, worker_pb2.DecodeRequest(request_id="ok-2"), 30)  # nobody listens
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await again.read()
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    asyncio.run(with_worker(scenario))
