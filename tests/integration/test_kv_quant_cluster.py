"""An int8 KV cache across a disaggregated pair: one prefill and one decode worker, both
``--kv-cache-dtype int8``, behind a router per transfer (gRPC, NIXL), give the greedy tokens of
the colocated int8 engine (``engine.LLM`` in this process) for the parity prompts; and an int8
prefill worker asked to push into an fp32 cache is refused with FAILED_PRECONDITION naming the
dtype of each side, before any block is reserved, and leaks nothing.

Same arithmetic on both sides: requests go one at a time, and the colocated engine uses the
prefill worker's thread count and 64-token chunks. That matters more than with an fp32 cache:
a K/V value a float rounding away from a code boundary lands on the neighbouring int8 code, so
batch-dependent last-bit differences grow to ~1e-2 in the logits ("La capitale de l'Italie est"
has its top two first tokens 0.003 apart, and which wins depends on the batch it prefills in).
Where the tokens still differ, the colocated engine's own logprobs must show a near-tie there
(the disaggregated token within NEAR_TIE of its choice) and the comparison ends at that token.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.sampling_params import SamplingParams
from tests.integration.cluster_fixtures import (
    one_thread,
    prefill_into_receiver,
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)
from tests.integration.test_cluster import PROMPTS, generate

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
NEAR_TIE = 0.02  # nats
INT8 = ["--num-kv-blocks", "64", "--kv-cache-dtype", "int8"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kvq-cluster-logs")
    workers = [start_worker("prefill", log_dir, *INT8, "--max-num-batched-tokens", "64"),
               start_worker("decode", log_dir, *INT8)]
    routers = [start_router(log_dir, workers[:1], workers[1:], transfer) for transfer in ("grpc", "nixl")]
    try:
        wait_serving(workers + routers)
        yield workers, routers
    finally:
        stop_all(routers)
        stop_all(workers)


@pytest.fixture(scope="module")
def colocated_int8(loaded_model):
    import torch

    from engine import LLM
    with one_thread():
        llm = LLM(loaded_model, num_kv_blocks=256, kv_cache_dtype="int8", num_threads=1,
                  max_num_batched_tokens=64)
        assert llm.engine.runner.kv_cache.dtype == torch.int8
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        yield prompt_ids, [llm.generate([ids], GREEDY)[0].outputs[0] for ids in prompt_ids]


def assert_no_leaks(workers) -> None:
    seen = wait_all_blocks_free(workers, 2.0)
    assert all(free == total for free, total in seen.values()), f"blocks in use: {seen}"


@pytest.mark.parametrize("transfer", ["grpc", "nixl"])
def test_int8_disaggregated_equals_colocated_int8(cluster, colocated_int8, transfer):
    workers, routers = cluster
    prompt_ids, expected = colocated_int8
    router = next(r for r in routers if f"router-{transfer}-" in r.log_path.name)

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            return [await generate(channel, p, GREEDY) for p in prompt_ids]  # one at a time

    results = [r[0][0] for r in asyncio.run(scenario())]
    verdicts = [_agrees(ours, theirs) for ours, theirs in zip(results, expected)]
    assert all(ok for ok, _ in verdicts), verdicts
    assert_no_leaks(workers)


def _agrees(disaggregated: list[int], colocated) -> tuple[bool, str]:
    """Equal, or first different where the colocated engine's top choice beat the
    disaggregated token by at most NEAR_TIE."""
    theirs = colocated.token_ids
    if disaggregated == theirs:
        return True, "equal"
    at = next((i for i, (a, b) in enumerate(zip(disaggregated, theirs)) if a != b), None)
    if at is None:
        return False, f"lengths differ: {disaggregated} vs {theirs}"
    top = dict(colocated.logprobs[at].top)
    if disaggregated[at] not in top:
        return False, f"token {at}: {disaggregated[at]} not in the colocated top 5 {top}"
    gap = top[theirs[at]] - top[disaggregated[at]]
    return gap <= NEAR_TIE, f"first differs at token {at}, colocated logprob gap {gap:.2e}"


def test_an_fp32_decode_peer_is_refused_naming_both_dtypes(cluster, colocated_int8, loaded_model):
    import torch

    workers, _ = cluster
    prompt_ids, _ = colocated_int8
    config = loaded_model.config
    fp32_cache = torch.zeros(4, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    error = prefill_into_receiver(workers[0].address, "int8-to-fp32", prompt_ids[0], config.name, fp32_cache)
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype: receiver='float32' sender='int8'" in error.details()
    assert "model_name" not in error.details() and "head_dim" not in error.details()
    assert_no_leaks(workers)
