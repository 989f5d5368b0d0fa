"""Per-worker admission (services/worker/admission.py) through a real cluster: a prefill worker
that runs one request at a time (``--max-num-seqs 1``) and lets one more wait
(``--max-waiting-requests 1``) refuses the rest of a burst with RESOURCE_EXHAUSTED; the router
reads that as "full" (not as a failure, and not as an unhealthy worker) and answers 429 with
Retry-After. The requests it took all complete, and the cluster serves at once afterwards.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.cluster_fixtures import (
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow
NUM_REQUESTS = 6
PROMPT_LEN = 160


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("worker-admission-logs")
    common = ["--num-kv-blocks", "64", "--log-level", "WARNING", "--metrics-port", "-1"]
    prefill = start_worker("prefill", log_dir, *common, "--max-num-seqs", "1",
                           "--max-waiting-requests", "1", transfer="grpc")
    decode = start_worker("decode", log_dir, *common, transfer="grpc")
    router = start_router(log_dir, [prefill], [decode], "grpc")
    try:
        wait_serving([prefill, decode, router], timeout_s=400.0)
        yield {"prefill": prefill, "decode": decode, "router": router}
    finally:
        stop_all([router])
        stop_all([prefill, decode])


async def burst(port: int, prompts: list[list[int]]) -> list[tuple[int, str, str | None]]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> tuple[int, str, str | None]:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
            return reply.status, await reply.text(), reply.headers.get("Retry-After")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, prompt) for prompt in prompts))


def test_a_full_prefill_worker_is_skipped_and_the_client_gets_429(cluster):
    args = cluster["router"].args
    port = int(args[args.index("--http-port") + 1])
    # distinct prompts: no prefix-cache hit shortens anyone's prefill
    prompts = [[100 + (i * 997 + j * 13) % 40000 for j in range(PROMPT_LEN)] for i in range(NUM_REQUESTS)]
    replies = asyncio.run(burst(port, prompts))
    statuses = sorted(status for status, _, _ in replies)
    served = [text for status, text, _ in replies if status == 200]
    refused = [(text, retry_after) for status, text, retry_after in replies if status == 429]
    assert len(served) + len(refused) == NUM_REQUESTS, statuses  # no 500, no 503
    assert 1 <= len(served) <= 2 and refused, statuses  # one runs, at most one waits
    assert all(json.loads(text)["usage"]["completion_tokens"] == 1 for text in served)
    for text, retry_after in refused:
        message = json.loads(text)["error"]["message"]
        assert "every prefill worker is full" in message and "--max-waiting-requests 1" in message, message
        assert retry_after == "1"
    # still healthy: served at once, nothing held
    [(status, text, _)] = asyncio.run(burst(port, prompts[:1]))
    assert status == 200, text
    seen = wait_all_blocks_free([cluster["prefill"], cluster["decode"]], timeout_s=10.0)
    assert all(free == total for free, total in seen.values()), seen
