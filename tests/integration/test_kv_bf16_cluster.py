"""A bfloat16 KV cache across a disaggregated pair (the int8 test of test_kv_quant_cluster.py,
mirrored for ``--kv-cache-dtype bf16``): one prefill and one decode worker behind a gRPC-transfer
router give the greedy tokens of the colocated bf16 engine for the parity prompts, requests one
at a time, the colocated engine on the prefill worker's thread count and 64-token chunks; where
they differ, only at a near-tie of the colocated engine's own logprobs (``_agrees``). The blocks
move as raw bytes, so the decode side reads exactly the bf16 values the prefill side wrote.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.integration.cluster_fixtures import one_thread, start_router, start_worker, stop_all, wait_serving
from tests.integration.test_cluster import PROMPTS, generate
from tests.integration.test_kv_quant_cluster import GREEDY, _agrees, assert_no_leaks

pytestmark = pytest.mark.slow

BF16 = ["--num-kv-blocks", "64", "--kv-cache-dtype", "bf16"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-bf16-cluster-logs")
    workers = [start_worker("prefill", log_dir, *BF16, "--max-num-batched-tokens", "64"),
               start_worker("decode", log_dir, *BF16)]
    router = start_router(log_dir, workers[:1], workers[1:], "grpc")
    try:
        wait_serving([*workers, router])
        yield workers, router
    finally:
        stop_all([router])
        stop_all(workers)


@pytest.fixture(scope="module")
def colocated_bf16(loaded_model):
    import torch

    from engine import LLM
    with one_thread():
        llm = LLM(loaded_model, num_kv_blocks=256, kv_cache_dtype="bf16", num_threads=1,
                  max_num_batched_tokens=64)
        assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        yield prompt_ids, [llm.generate([ids], GREEDY)[0].outputs[0] for ids in prompt_ids]


def test_bf16_disaggregated_equals_colocated_bf16(cluster, colocated_bf16):
    workers, router = cluster
    prompt_ids, expected = colocated_bf16

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            return [await generate(channel, p, GREEDY) for p in prompt_ids]  # one at a time

    results = [r[0][0] for r in asyncio.run(scenario())]
    verdicts = [_agrees(ours, theirs) for ours, theirs in zip(results, expected)]
    assert all(ok for ok, _ in verdicts), verdicts
    assert_no_leaks(workers)
