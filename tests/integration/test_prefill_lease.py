"""A slow prefill is not a failure; a failed one frees every block it holds, on both workers.

Real processes on loopback: one prefill worker with a tiny token budget (8 tokens a step, so
a 200-token prompt takes 25 steps, a few seconds on one thread) and two decode workers whose
reservation lease (1.5 s) is shorter than that. The prefill worker renews the lease while the
job runs (services/prefill/lease.py); requests go straight to the worker RPCs, or through the
router's DisaggregatedBackend in this process when the tokens are compared with the offline
engine. Every prompt is new (no prefix-cache hit shortens a prefill). Decode worker "B" is
killed, then the prefill worker, by the last two tests.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import params_to_proto
from services.router.backends.disaggregated import DisaggregatedBackend
from tests.integration.cluster_fixtures import (
    WorkerProcess,
    oracle_llm,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
LEASE_MS = 1500
BUDGET = 8  # --max-num-batched-tokens of the prefill worker
# the lease tests need a prompt's prefill, BUDGET tokens a step, to outlast a lease renewal: on
# the 2-core Xeon with GGUF weights 600 tokens (three prompts of 200) took 1.0 s
PROMPT_LEN = 600
NIXL, GRPC = worker_pb2.KV_TRANSFER_METHOD_NIXL, worker_pb2.KV_TRANSFER_METHOD_GRPC
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
_prompt_seeds = itertools.count(1)


def new_prompt(length: int = PROMPT_LEN) -> list[int]:
    """Token ids no earlier prompt of this module began with."""
    seed = next(_prompt_seeds)
    return [1000 + (seed * 7919 + i * 104729) % 40000 for i in range(length)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lease-logs")
    common = ["--num-kv-blocks", str(NUM_BLOCKS)]
    started = [start_worker("prefill", log_dir, *common, "--max-num-batched-tokens", str(BUDGET))]
    started += [start_worker("decode", log_dir, *common, "--reservation-lease-ms", str(LEASE_MS))
                for _ in range(2)]
    try:
        wait_serving(started)
        yield dict(zip(("prefill", "decode_a", "decode_b"), started))
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def llm(loaded_model):
    """The offline oracle, on one thread (the workers share the cores)."""
    yield from oracle_llm(loaded_model, num_kv_blocks=NUM_BLOCKS)


def alive(workers) -> list[WorkerProcess]:
    return [w for w in workers.values() if w.proc.poll() is None]


def assert_no_leaks(workers, timeout_s: float = 2.0) -> None:
    seen = wait_all_blocks_free(alive(workers), timeout_s)
    assert all(free == total for free, total in seen.values()), f"blocks in use: {seen}"


def prefill_call(channel: grpc.aio.Channel, decode: WorkerProcess, request_id: str,
                 prompt: list[int], max_tokens: int = 4, method: int = GRPC,
                 timeout_s: float = 120.0) -> grpc.aio.UnaryStreamCall:
    return worker_pb2_grpc.PrefillServiceStub(channel).Prefill(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling_params=params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens)),
        decode=worker_pb2.DecodeTarget(address=decode.address), transfer_method=method),
        timeout=timeout_s)


async def read_until(call: grpc.aio.UnaryStreamCall, event: str) -> worker_pb2.PrefillResponse:
    while True:
        response = await call.read()
        assert response is not grpc.aio.EOF, f"the Prefill stream ended before a {event!r} event"
        if response.WhichOneof("event") == event:
            return response


async def failure_of(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await call.read() is not grpc.aio.EOF:
            pass
    return err.value


async def blocker(channel: grpc.aio.Channel, workers, name: str) -> grpc.aio.UnaryStreamCall:
    """A long prompt with max_tokens=1 (no reservation), running once this returns: it keeps
    the prefill worker's engine busy for seconds, so requests added after it wait in its queue."""
    call = prefill_call(channel, workers["decode_a"], name, new_prompt(), max_tokens=1)
    deadline = time.monotonic() + 10.0
    while workers["prefill"].stats().num_running_requests == 0:
        assert time.monotonic() < deadline, "the blocker never started running"
        await asyncio.sleep(0.02)
    return call


def test_a_prefill_slower_than_the_lease_completes_with_the_offline_tokens(workers, llm):
    """Three prompts at once through the router's backend (NIXL and gRPC transfers): the
    last one's first token comes well after one lease, and all three match the offline
    engine token for token."""
    prompts = [new_prompt() for _ in range(3)]
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]

    async def one(backend, request_id, prompt):
        tokens, first_token_s = [], None
        started = time.monotonic()
        async for event in backend.generate(request_id, prompt, GREEDY):
            first_token_s = first_token_s or time.monotonic() - started
            tokens += event.token_ids
        return tokens, first_token_s

    async def scenario():
        backends = [DisaggregatedBackend([workers["prefill"].address], [workers["decode_a"].address],
                                         transfer, poll_interval_s=0.2) for transfer in ("nixl", "grpc")]
        for backend in backends:
            await backend.start()
        try:
            return await asyncio.gather(*(one(backends[i % 2], f"slow-{i}", prompt)
                                          for i, prompt in enumerate(prompts)))
        finally:
            for backend in backends:
                await backend.close()

    results = asyncio.run(scenario())
    assert [tokens for tokens, _ in results] == expected
    slowest = max(first_token_s for _, first_token_s in results)
    assert slowest > LEASE_MS / 1000, (
        f"the slowest prefill took {slowest:.2f} s, under one lease: this test proves nothing "
        "on this machine (lengthen the prompts)")
    assert_no_leaks(workers)


@pytest.mark.parametrize("when", ["at_once", "after_reservation", "while_queued", "while_pushing"])
def test_cancelling_a_prefill_frees_its_blocks_on_both_workers(workers, when):
    """Cancelled before anything happened, right after the reservation (the request is being
    added while the engine is mid-step), while it waits in the queue, or while its KV is
    being pushed: within 2 s neither worker holds a block."""
    async def scenario():
        async with grpc.aio.insecure_channel(workers["prefill"].address) as channel:
            busy = await blocker(channel, workers, f"blocker-{when}")
            call = prefill_call(channel, workers["decode_a"], f"cancel-{when}", new_prompt(),
                                method=NIXL)
            if when == "at_once":
                await asyncio.sleep(0.02)
            elif when == "after_reservation":
                await read_until(call, "reservation")
            elif when == "while_queued":
                await read_until(call, "reservation")
                await asyncio.sleep(0.5)
            elif when == "while_pushing":
                busy.cancel()
                await read_until(call, "reservation")
                await read_until(call, "transfer")
            call.cancel()
            busy.cancel()

    asyncio.run(scenario())
    assert_no_leaks(workers)


def test_a_client_deadline_during_prefill_frees_its_blocks(workers):
    async def scenario():
        async with grpc.aio.insecure_channel(workers["prefill"].address) as channel:
            busy = await blocker(channel, workers, "blocker-deadline")
            call = prefill_call(channel, workers["decode_a"], "deadline", new_prompt(),
                                timeout_s=1.0)
            error = await failure_of(call)
            busy.cancel()
            return error

    assert asyncio.run(scenario()).code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_leaks(workers)


def test_a_released_reservation_stops_nixl_writes_and_fails_the_prefill(workers):
    """NIXL writes are one-sided, so no push is refused: the next renewal finds the
    reservation gone, the prefill stops writing and fails, naming the decode worker."""
    async def scenario():
        async with grpc.aio.insecure_channel(workers["prefill"].address) as channel, \
                grpc.aio.insecure_channel(workers["decode_a"].address) as decode:
            call = prefill_call(channel, workers["decode_a"], "released", new_prompt(), method=NIXL)
            reservation = (await read_until(call, "reservation")).reservation
            await worker_pb2_grpc.DecodeServiceStub(decode).ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(reservation_id=reservation.reservation_id),
                timeout=5)
            released_at = time.monotonic()
            error = await failure_of(call)
            return error, time.monotonic() - released_at

    error, seconds = asyncio.run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "no live reservation 'released'" in error.details()
    assert ("pdserve-failed-peer", "decode") in tuple(error.trailing_metadata())
    assert seconds < LEASE_MS / 1000  # one renewal interval, plus the cleanup
    assert_no_leaks(workers)


def test_killing_the_decode_worker_mid_prefill_frees_every_block_on_the_survivors(workers, llm):
    """Decode worker B dies while one prefill for it pushes over NIXL and another waits in
    the queue (its renewals fail until its write deadline). Both calls fail naming the decode
    worker; the prefill worker and decode worker A then hold nothing, and serve on."""
    victim = workers["decode_b"]

    async def scenario():
        async with grpc.aio.insecure_channel(workers["prefill"].address) as channel:
            pushing = prefill_call(channel, victim, "doomed-pushing", new_prompt(), method=NIXL)
            await read_until(pushing, "reservation")
            queued = prefill_call(channel, victim, "doomed-queued", new_prompt(), method=GRPC)
            await read_until(queued, "reservation")
            await read_until(pushing, "transfer")
            victim.stop(signal.SIGKILL)
            return await asyncio.gather(failure_of(pushing), failure_of(queued))

    errors = asyncio.run(scenario())
    for error in errors:
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), error
        assert ("pdserve-failed-peer", "decode") in tuple(error.trailing_metadata()), error
        assert victim.address in error.details()
    assert_no_leaks(workers)

    prompt = new_prompt(20)

    async def after():
        backend = DisaggregatedBackend([workers["prefill"].address], [workers["decode_a"].address],
                                       "nixl", poll_interval_s=0.2)
        await backend.start()
        try:
            return [t async for event in backend.generate("after", prompt, GREEDY)
                    for t in event.token_ids]
        finally:
            await backend.close()

    assert asyncio.run(after()) == llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_no_leaks(workers)


def test_a_crashed_prefill_worker_loses_its_reservation_to_the_lease(workers):
    """Runs last. While the prefill worker lives, it renews: the reservation outlives its
    first lease. Killed, it renews no more, and the decode worker frees the blocks within
    one lease."""
    decode = workers["decode_a"]

    async def scenario():
        async with grpc.aio.insecure_channel(workers["prefill"].address) as channel:
            busy = await blocker(channel, workers, "blocker-crash")
            call = prefill_call(channel, decode, "orphan", new_prompt(2 * PROMPT_LEN))
            reservation = (await read_until(call, "reservation")).reservation
            await asyncio.sleep(1.5 * LEASE_MS / 1000)
            held = decode.stats()
            workers["prefill"].stop(signal.SIGKILL)
            killed_at = time.monotonic()
            call.cancel()
            busy.cancel()
            return reservation, held, killed_at

    reservation, held, killed_at = asyncio.run(scenario())
    assert held.num_free_blocks == held.num_total_blocks - len(reservation.block_ids)
    seen = wait_all_blocks_free([decode], timeout_s=LEASE_MS / 1000 + 2.0)
    assert seen[decode.address][0] == seen[decode.address][1], f"blocks in use: {seen}"
    assert time.monotonic() - killed_at < LEASE_MS / 1000 + 2.0
