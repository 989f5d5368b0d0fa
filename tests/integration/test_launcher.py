"""``pdserve up`` (services/launcher.py) as a user runs it: a real process tree on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.integration.cluster_fixtures import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
HAS_ROUTER = (REPO / "services" / "router" / "__main__.py").exists()


def _up(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_up_fails_with_the_childs_exit_code_and_log_tail(tmp_path):
    proc = _up("--model", "/nonexistent/model.gguf", "--transfer", "grpc",
               "--log-dir", str(tmp_path))
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert stdout == ""  # no ready line
    assert "exited with code 1" in stderr
    assert "model path '/nonexistent/model.gguf' does not exist" in stderr


@pytest.mark.skipif(not HAS_ROUTER, reason="the router's __main__ has not landed yet")
def test_up_serves_then_drains_on_sigterm_without_orphans(tmp_path, loaded_model):
    from services.common.pb import generate_pb2, generate_pb2_grpc

    http_port, grpc_port = free_port(), free_port()
    proc = _up("--prefill", "1", "--decode", "1", "--transfer", "grpc", "--pin-cores",
               "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--worker-args", "--num-kv-blocks 64", "--drain-grace-s", "2",
               "--log-dir", str(tmp_path))
    try:
        line = proc.stdout.readline()
        assert line == f"ready http=127.0.0.1:{http_port} grpc=127.0.0.1:{grpc_port}\n", \
            proc.stderr.read() if proc.poll() is not None else line
        children = _children(proc.pid)
        assert len(children) == 5  # kvstore, prefill, decode, router, and the index's redis-server
        assert [Path(f"/proc/{pid}/comm").read_text().strip() for pid in children].count("redis-server") == 1

        prompt = loaded_model.tokenizer.encode("The capital of France is")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            chunks = list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                generate_pb2.GenerateRequest(
                    prompt_token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling_params=generate_pb2.SamplingParams(temperature=0.0, max_tokens=4)),
                timeout=120))
        from engine import LLM, SamplingParams
        expected = LLM(loaded_model, num_kv_blocks=64).generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids
        assert [t for c in chunks for t in c.token_ids] == expected

        if len(os.sched_getaffinity(0)) >= 2:  # --pin-cores: prefill and decode apart
            cpus = {}
            for pid in children:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                if "serve" in argv and argv[argv.index("serve") + 1] in ("prefill", "decode"):
                    status = Path(f"/proc/{pid}/status").read_text()
                    cpus[argv[argv.index("serve") + 1]] = status.split("Cpus_allowed_list:")[1].split()[0]
            assert len(cpus) == 2 and cpus["prefill"] != cpus["decode"], cpus

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
