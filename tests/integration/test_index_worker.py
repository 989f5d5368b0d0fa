"""A real prefill worker publishes its prefix cache to a real redis-server (``--redis-url``):
after a request, the index's ``match`` of the prompt's block hashes names that worker with the
prompt's full blocks on DEVICE; after the worker is SIGKILLed its lease lapses and ``match`` no
longer names it. The test's scope is computed independently (model name + kv_compat_hash), so it
also checks that a router would find the workers' keys."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from engine.kv_cache.hashing import hash_request_blocks
from engine.sampling_params import SamplingParams
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import params_to_proto
from services.index.client import IndexClient, IndexClientConfig
from services.index.schema import index_meta_for
from tests.integration.cluster_fixtures import start_worker, stop_all, wait_serving

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
HEARTBEAT_S = 0.5  # lease 1.5 s
PROMPT = [1000 + (i * 104729) % 40000 for i in range(70)]  # 4 full blocks + 6 tokens


def prefill(worker_address: str, decode_address: str) -> None:
    async def call() -> None:
        async with grpc.aio.insecure_channel(worker_address) as channel:
            stream = worker_pb2_grpc.PrefillServiceStub(channel).Prefill(worker_pb2.PrefillRequest(
                request_id="idx-1", prompt_token_ids=PROMPT,
                sampling_params=params_to_proto(SamplingParams(temperature=0.0, max_tokens=2)),
                decode=worker_pb2.DecodeTarget(address=decode_address),
                transfer_method=worker_pb2.KV_TRANSFER_METHOD_GRPC), timeout=120)
            async for _ in stream:
                pass

    asyncio.run(call())


def test_a_prefill_worker_is_found_by_its_prompt_until_it_dies(redis_server, default_model_path,
                                                                tmp_path):
    model_name = Path(default_model_path).name.removesuffix(".gguf")
    meta = index_meta_for(model_name, "float32", BLOCK_SIZE, 30, 3, 64)  # as a router computes it
    index = ["--redis-url", redis_server.url, "--index-heartbeat-s", str(HEARTBEAT_S),
             "--num-kv-blocks", "64"]
    prefill_worker = start_worker("prefill", tmp_path, *index, transfer="grpc")
    decode_worker = start_worker("decode", tmp_path, "--num-kv-blocks", "64", transfer="grpc")
    client = IndexClient(redis_server.url, meta, IndexClientConfig(budget_s=0.5))
    workers = [prefill_worker, decode_worker]
    try:
        wait_serving(workers)
        client.check_meta()
        prefill(prefill_worker.address, decode_worker.address)
        hashes = hash_request_blocks(PROMPT, BLOCK_SIZE)
        assert len(hashes) == 4
        prefill_id = f"prefill-{prefill_worker.address.rpartition(':')[2]}"
        found = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            found = client.match(hashes) or {}
            if prefill_id in found and found[prefill_id].num_device_blocks == 4:
                break
            time.sleep(0.05)
        assert found[prefill_id].num_device_blocks == 4, (found, prefill_worker.log_tail())
        assert found[prefill_id].role == "prefill"
        assert found[prefill_id].grpc_address == prefill_worker.address

        prefill_worker.proc.send_signal(signal.SIGKILL)
        prefill_worker.proc.wait(10)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 5:
            found = client.match(hashes) or {}
            if prefill_id not in found:
                break
            time.sleep(0.1)
        assert prefill_id not in found
        assert time.monotonic() - killed_at <= 3 * HEARTBEAT_S + 0.5
    finally:
        client.close()
        stop_all(workers)
