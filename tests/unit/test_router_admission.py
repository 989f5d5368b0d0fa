"""Admission control, size limits and deadlines at the router's HTTP edge (fast, no workers).

A scripted backend stands in for the workers (as in test_router_frontend.py): it blocks on an
event before its first token, so tests can hold requests in the queue, and records whether it
was closed (the abort that frees a request's KV in a real cluster) and the deadline its
worker calls would carry (services/router/deadline.py).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.sampling_params import SamplingParams
from services.router.backends.backend import Backend, TokenEvent
from services.router.deadline import remaining_s
from services.router.errors import RequestTimeout
from services.router.http.server import build_app
from services.router.model_info import ModelInfo
from services.router.pipeline.admission import Admission, AdmissionConfig, QueueFull
from services.router.pipeline.frontend import Frontend, RouterState
from services.router.pipeline.limits import RequestLimits
from tests.unit.test_router_frontend import ALPHABET, CharTokenizer, ids


class GatedBackend(Backend):
    """Waits for ``gate`` (or ``delay_s`` per token), then streams "ok" and stops."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.gate = asyncio.Event()
        self.delay_s = delay_s
        self.num_started = 0
        self.num_closed = 0
        self.call_timeouts: list[float] = []

    async def generate(self, request_id, prompt_token_ids, params):
        self.num_started += 1
        self.call_timeouts.append(remaining_s(300.0))  # what a worker call would carry
        try:
            await self.gate.wait()
            for i, token in enumerate(ids("ok")):
                await asyncio.sleep(self.delay_s)
                yield TokenEvent(0, [token], finish_reason="length" if i == 1 else None)
        finally:
            self.num_closed += 1

    async def is_healthy(self) -> bool:
        return True


def make_state(backend: Backend, limits: RequestLimits | None = None,
               admission: AdmissionConfig | None = None) -> RouterState:
    state = RouterState(backend, limits=limits or RequestLimits(),
                        admission=Admission(admission or AdmissionConfig()))
    state.frontend = Frontend(CharTokenizer(), backend, ModelInfo("m", len(ALPHABET) + 1, 64),
                              limits=state.limits, admission=state.admission)
    return state


def test_admission_counts_queue_and_slots():
    async def scenario():
        admission = Admission(AdmissionConfig(max_queued_requests=2, max_running_requests=1))
        first, second = admission.admit(), admission.admit()
        with pytest.raises(QueueFull, match="queue is full .*--max-queued-requests 2") as info:
            admission.admit()
        assert info.value.retry_after_s == 1  # nothing measured yet
        await first.acquire_slot()
        waiting = asyncio.ensure_future(second.acquire_slot())
        await asyncio.sleep(0.01)
        assert not waiting.done() and admission.num_running == 1  # one slot only
        first.on_streaming()
        assert admission.num_queued == 1
        third = admission.admit()  # a queue place freed up
        first.release()
        await asyncio.wait_for(waiting, 1)
        assert (admission.num_queued, admission.num_running) == (2, 1)
        for ticket in (second, third, first):
            ticket.release()
        assert (admission.num_queued, admission.num_running) == (0, 0)

    asyncio.run(scenario())


def test_a_full_queue_answers_429_at_once_with_retry_after_and_admitted_requests_finish():
    backend = GatedBackend()
    state = make_state(backend, admission=AdmissionConfig(max_queued_requests=2))

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            body = {"prompt": "ab", "max_tokens": 2}
            admitted = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(2)]
            while backend.num_started < 2:
                await asyncio.sleep(0.005)
            # the gate stays shut until the refusal is in: a refusal made to wait for a queue
            # place would never come (wait_for turns that into a failure, not a hang)
            refused = await asyncio.wait_for(client.post("/v1/completions", json=body), 30.0)
            error = (await refused.json())["error"]
            backend.gate.set()
            replies = [await (await reply).json() for reply in admitted]
            return refused, error, replies

    refused, error, replies = asyncio.run(scenario())
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert error["code"] == "rate_limit_exceeded" and "--max-queued-requests 2" in error["message"]
    assert [r["choices"][0]["text"] for r in replies] == ["ok", "ok"]
    assert state.admission.num_queued == state.admission.num_running == 0
    assert state.metrics.rejected.labels("overload")._value.get() == 1


def test_timeout_field_ends_the_request_with_504_and_aborts_it():
    backend = GatedBackend()  # never opens: the first token never comes
    state = make_state(backend)

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            sent_at = time.monotonic()
            reply = await client.post("/v1/completions", json={"prompt": "ab", "timeout": 0.3})
            return reply.status, await reply.json(), time.monotonic() - sent_at

    status, body, took_s = asyncio.run(scenario())
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", body
    assert 0.3 <= took_s < 2.0
    assert backend.num_closed == 1  # the backend's iterator was closed: workers free the KV
    assert 0.2 < backend.call_timeouts[0] <= 0.3  # worker calls carried the time left
    assert state.admission.num_queued == state.admission.num_running == 0


def test_timeout_mid_stream_sends_an_error_event():
    backend = GatedBackend(delay_s=0.5)
    backend.gate.set()
    state = make_state(backend)

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            reply = await client.post("/v1/completions", json={"prompt": "ab", "stream": True,
                                                               "timeout": 0.8})
            return reply.status, await reply.text()

    status, text = asyncio.run(scenario())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "o"
    assert json.loads(events[1])["error"]["code"] == "deadline_exceeded" and events[2] == "[DONE]"
    assert backend.num_closed == 1


def test_a_generation_past_its_deadline_raises_request_timeout():
    backend = GatedBackend()
    frontend = make_state(backend).frontend

    async def scenario():
        generation = frontend.generate([1, 2], SamplingParams(max_tokens=2),
                                       deadline=time.monotonic() + 0.05)
        with pytest.raises(RequestTimeout, match="deadline passed"):
            await generation.start()

    asyncio.run(scenario())
    assert backend.num_closed == 1


def test_body_and_header_limits_answer_413_and_431_in_openai_shape():
    state = make_state(GatedBackend(), RequestLimits(max_body_bytes=1024, max_header_bytes=2048))

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            big_body = await client.post("/v1/completions", json={"prompt": "a" * 2000})
            big_header = await client.post("/v1/completions", json={"prompt": "ab"},
                                           headers={"x-padding": "p" * 4000})
            return [(r.status, await r.json()) for r in (big_body, big_header)]

    (body_status, body_error), (header_status, header_error) = asyncio.run(scenario())
    assert body_status == 413 and "at most 1024 bytes" in body_error["error"]["message"]
    assert header_status == 431 and "at most 2048" in header_error["error"]["message"]
    assert header_error["error"]["code"] == "request_header_fields_too_large"


def test_grpc_full_queue_is_resource_exhausted_with_retry_after_and_deadlines_are_honoured():
    """The public gRPC API over a real grpc.aio server in this process."""
    import grpc

    from services.common.grpc_server import start_grpc_server
    from services.common.pb import generate_pb2, generate_pb2_grpc
    from services.router.grpc.servicer import GenerateServicer, add_generate_servicer

    backend = GatedBackend()
    state = make_state(backend, admission=AdmissionConfig(max_queued_requests=1))

    async def scenario():
        server = await start_grpc_server([(add_generate_servicer, GenerateServicer(state))])
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                request = generate_pb2.GenerateRequest(
                    prompt="ab", sampling_params=generate_pb2.SamplingParams(max_tokens=2))
                held = stub.Generate(request, timeout=0.5)  # takes the one queue place
                first = asyncio.ensure_future(held.read())
                while backend.num_started < 1:
                    await asyncio.sleep(0.005)
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await stub.Generate(request, timeout=5).read()
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await first  # the gate never opens: the call's deadline ends it
                raw = channel.unary_stream("/pdserve.v1.GenerateService/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as garbled:
                    await raw(b"\x1a\x02\xff\xfe", timeout=5).read()
                return full.value, late.value, garbled.value
        finally:
            await server.server.stop(None)

    full, late, garbled = asyncio.run(scenario())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in full.details()
    assert dict(full.trailing_metadata())["retry-after"] == "1"
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert garbled.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in garbled.details()
    assert backend.num_closed == 1 and state.admission.num_queued == 0
