"""A cancel frees every KV block on both workers within 2 s, whatever moment it lands on.

One cluster (router, a prefill worker, a decode worker, gRPC KV transfer, a lease of 60 s so
only the cancel path can free a reservation in time). Streams are cancelled at the racy moments
of a request, over and over (bounded): while the prefill worker reserves on the decode worker,
while it computes, the instant the first token arrives (the Decode call just opened, the last
block still being pushed, the prefill call about to end), and a few milliseconds after. The
cancel comes from a gRPC client and from an HTTP client that drops its connection (the router's
aiohttp handler is cancelled). After each cancel both workers must have every block free
within 2 s.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import params_to_proto
from tests.integration.cluster_fixtures import (
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow
NUM_BLOCKS = 64
LEASE_MS = 60_000  # longer than the test: a leaked reservation is not hidden by its lease
FREE_WITHIN_S = 2.0
# 40 tokens (3 blocks of 16; the decode worker caches its 2 full blocks after the first one:
# delta transfer, as in test_metrics_cluster), and 150 tokens (prefilled in 64-token chunks)
PROMPTS = [list(range(300, 340)), [100 + (i * 13) % 900 for i in range(150)]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
AFTER_SEND_S = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05)  # before the first token
AFTER_FIRST_S = (0.0, 0.0, 0.001, 0.003, 0.01, 0.03)  # after it
ROUNDS = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cancel-logs")
    common = ["--num-kv-blocks", str(NUM_BLOCKS)]
    prefill = start_worker("prefill", log_dir, *common, "--max-num-batched-tokens", "64", transfer="grpc")
    decode = start_worker("decode", log_dir, *common, "--reservation-lease-ms", str(LEASE_MS),
                          transfer="grpc")
    router = start_router(log_dir, [prefill], [decode], "grpc", "--local-prefill-max-tokens", "0")
    try:
        wait_serving([prefill, decode, router], timeout_s=400.0)
        yield prefill, decode, router
    finally:
        stop_all([router])
        stop_all([prefill, decode])


def _assert_free(cluster, moment: str) -> None:
    prefill, decode, _ = cluster
    seen = wait_all_blocks_free([prefill, decode], timeout_s=FREE_WITHIN_S)
    assert all(free == total for free, total in seen.values()), f"cancelled {moment}: blocks in use {seen}"


async def _grpc_cancel(address: str, prompt: list[int], after_first_s: float | None,
                       after_send_s: float) -> None:
    """One Generate stream cancelled ``after_send_s`` after it was sent, or (when
    ``after_first_s`` is set) that long after its first token."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=params_to_proto(PARAMS)),
            timeout=60)
        if after_first_s is None:
            await asyncio.sleep(after_send_s)
        else:
            await call.read()
            if after_first_s:
                await asyncio.sleep(after_first_s)
        call.cancel()


def _http_cancel(http_port: str, prompt: list[int], after_first_s: float) -> None:
    """A streaming completion whose client leaves after the first data line (as
    test_metrics_cluster's cancelled stream)."""
    connection = http.client.HTTPConnection("127.0.0.1", int(http_port), timeout=60)
    body = json.dumps({"prompt": prompt, "max_tokens": PARAMS.max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    for _ in range(20):  # bounded: until the first data line
        if reply.readline().startswith(b"data: {"):
            break
    if after_first_s:
        time.sleep(after_first_s)
    connection.close()


def test_a_cancel_at_any_moment_frees_every_block_on_both_workers(cluster):
    _, _, router = cluster
    http_port = router.args[router.args.index("--http-port") + 1]
    for prompt in PROMPTS:  # warm up: the decode worker caches each prompt's full blocks
        asyncio.run(_grpc_cancel(router.address, prompt, 0.2, 0.0))
        _assert_free(cluster, "warm-up")
    for round_ in range(ROUNDS):
        for p, prompt in enumerate(PROMPTS):
            for delay in AFTER_SEND_S:
                asyncio.run(_grpc_cancel(router.address, prompt, None, delay))
                _assert_free(cluster, f"round {round_}, prompt {p}: {delay * 1000:g} ms after sending")
            for delay in AFTER_FIRST_S:
                asyncio.run(_grpc_cancel(router.address, prompt, delay, 0.0))
                _assert_free(cluster, f"round {round_}, prompt {p}: {delay * 1000:g} ms after the first token")
                _http_cancel(http_port, prompt, delay)
                _assert_free(cluster, f"round {round_}, prompt {p}: HTTP, {delay * 1000:g} ms after the "
                                      "first token")
