"""Every engine flag of ``pdserve up`` reaches the engine of every process that runs one.

Two real clusters on loopback, each given every engine flag away from its default (all but
``--device``: this test runs on CPU): 1 prefill + 1 decode worker behind a router, then
``--colocated``. Each engine is read back over gRPC, from the running process: WorkerService
.GetStats names the settings it built its engine from (``engine_argv``) and reports the block
pool the engine built. The router's context-length limit is read back through Generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.args import EngineArgs
from services.common.channels import internal_sync_channel
from services.common.engine_flags import engine_argv, parse_engine_argv
from services.common.internal_auth import InternalAuth
from services.common.pb import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.cluster_fixtures import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240
FLAGS = EngineArgs(block_size=32, num_kv_blocks=48, kv_cache_memory=64_000_000,
                   enable_prefix_caching=False, max_num_seqs=7, max_num_batched_tokens=256,
                   max_model_len=384, dtype="bfloat16", num_threads=1, spec_method="ngram",
                   spec_k=3, spec_layers=6, spec_max_batch=8, spec_draft_cost=0.5,
                   cpu_offload_gb=0.25, kv_cache_dtype="int8",
                   weight_format="fp32",  # not the default (auto); dense bf16 either way here
                   gpu_memory_utilization=0.5, enforce_eager=True,  # CUDA-only: carried, no effect here
                   async_scheduling="on")  # off with speculation: carried, no effect here


TOKEN = "engine-flags-test-token"


@pytest.fixture(scope="module")
def flags(default_model_path) -> EngineArgs:
    flags = dataclasses.replace(FLAGS, draft_model=default_model_path)
    unchanged = [f.name for f in dataclasses.fields(EngineArgs) if getattr(flags, f.name) == f.default]
    assert unchanged == ["device"]  # a field added to EngineArgs gets a value here
    return flags


@contextlib.contextmanager
def running_up(log_dir: Path, *up_flags: str) -> Iterator[str]:
    """``pdserve up`` with ``up_flags``; yields the router's gRPC address once ``ready``, and
    at the end SIGTERMs it and checks it drained and exited 0."""
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PDSERVE_INTERNAL_TOKEN"] = TOKEN  # so this test may read its workers' stats
    with open(log_dir / "up.stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--drain-grace-s", "2", "--log-dir", str(log_dir),
             "--startup-timeout-s", str(STARTUP_TIMEOUT_S), *up_flags],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()  # `up` itself gives up after --startup-timeout-s
        assert line.startswith("ready"), (log_dir / "up.stderr").read_text()
        yield f"127.0.0.1:{grpc_port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (log_dir / "up.stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def worker_address(log_dir: Path, name: str) -> str:
    """The address in a worker's ``listening <role> <worker id> <host:port>`` line."""
    lines = (log_dir / f"{name}.log").read_text().splitlines()
    return next(line.split()[3] for line in lines if line.startswith("listening "))


def assert_engine_built_from(address: str, role: str, flags: EngineArgs) -> None:
    with internal_sync_channel(address, auth=InternalAuth(token=TOKEN)) as channel:
        stats = worker_pb2_grpc.WorkerServiceStub(channel).GetStats(
            worker_pb2.GetStatsRequest(), timeout=10)
    assert parse_engine_argv(stats.engine_argv) == flags, (role, list(stats.engine_argv))
    assert (stats.role, stats.block_size, stats.num_total_blocks) == (role, 32, 48)


def assert_context_length(router_address: str, max_model_len: int) -> None:
    """The router rejects a prompt that fills ``max_model_len``, naming that length."""
    request = generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=[100] * max_model_len),
        sampling_params=generate_pb2.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(router_address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum context length is {max_model_len} tokens" in error.value.details()


def test_every_engine_flag_reaches_both_workers(tmp_path, flags):
    with running_up(tmp_path, "--prefill", "1", "--decode", "1", "--transfer", "grpc",
                    *engine_argv(flags)) as router:
        for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert_engine_built_from(worker_address(tmp_path, name), role, flags)
        assert_context_length(router, 384)


def test_every_engine_flag_reaches_the_colocated_router(tmp_path, flags):
    with running_up(tmp_path, "--colocated", *engine_argv(flags)) as router:
        assert_engine_built_from(router, "colocated", flags)
        assert_context_length(router, 384)
