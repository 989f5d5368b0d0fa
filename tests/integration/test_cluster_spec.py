"""Speculative decoding on a real decode worker, for each proposer: greedy output through the
disaggregated cluster equals the offline engine without speculation, and no block leaks."""

from __future__ import annotations

import grpc
import pytest

from engine import LLM, SamplingParams
from engine.models.default_model import default_model_path
from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.integration.cluster_fixtures import (
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow

CODE = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


SPEC_ARGS = {
    "ngram": ("--spec-method", "ngram"),
    # draft cost 0: speculate whatever the drafter costs (the target as its own draft never pays)
    "layer-skip": ("--spec-method", "layer-skip", "--spec-layers", "6", "--spec-draft-cost", "0"),
    "draft": ("--spec-method", "draft", "--draft-model", default_model_path(), "--spec-draft-cost", "0"),
}


COMMON = ("--num-kv-blocks", "128", "--max-model-len", "512")


@pytest.fixture(scope="module")
def prefill_worker(tmp_path_factory):
    """One prefill worker for every proposer: only the decode worker speculates. Not waited for
    here: it starts next to the first decode worker (``spec_cluster`` waits for both)."""
    worker = start_worker("prefill", tmp_path_factory.mktemp("spec-cluster-prefill"), *COMMON,
                          transfer="grpc")
    try:
        yield worker
    finally:
        stop_all([worker])


@pytest.fixture(scope="module", params=sorted(SPEC_ARGS))
def spec_cluster(request, prefill_worker, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"spec-cluster-{request.param}")
    decode = start_worker("decode", log_dir, *COMMON, *SPEC_ARGS[request.param], "--spec-k", "4",
                          transfer="grpc")
    processes = [decode]
    try:
        wait_serving([prefill_worker, decode])
        router = start_router(log_dir, [prefill_worker], [decode], "grpc")
        processes.append(router)
        wait_serving([router])
        yield router, [prefill_worker, decode]
    finally:
        stop_all(processes)


@pytest.fixture(scope="module")
def prompts(loaded_model) -> list[list[int]]:
    tok = loaded_model.tokenizer
    return [tok.encode_chat([{"role": "user", "content": "Repeat this code exactly:\n" + CODE}]),
            tok.encode("1, 2, 3, 4, 5, 6, 7, 8,"),
            tok.encode_chat([{"role": "user", "content": "Name three rivers."}])]


@pytest.fixture(scope="module")
def expected(loaded_model, prompts) -> list[list[int]]:
    """The offline engine's greedy tokens without speculation, once for every proposer."""
    params = SamplingParams(temperature=0, max_tokens=32)
    return [o.token_ids for o in LLM(loaded_model, max_model_len=512, num_kv_blocks=128)
            .generate(prompts, params)]


def test_speculation_through_the_cluster_equals_offline(spec_cluster, prompts, expected):
    router, workers = spec_cluster
    with grpc.insecure_channel(router.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for ids, want in zip(prompts, expected):
            chunks = list(stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=generate_pb2.TokenIds(ids=ids),
                sampling_params=generate_pb2.SamplingParams(temperature=0.0, max_tokens=32)),
                timeout=120))
            assert [t for c in chunks for t in c.token_ids] == want
    seen = wait_all_blocks_free(workers)
    assert all(free == total for free, total in seen.values()), seen
