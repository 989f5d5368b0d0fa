"""``pdserve up`` outlives a worker: 1 prefill + 2 decode workers (gRPC KV transfer), a decode
worker SIGKILLed under load is restarted on its port, no request fails (two of the four streams
decode under a JSON schema: they migrate, stay exact and validate; every schema of
tests/integration/schemas.py is in flight too, greedy and seeded, and validates), and requests
sent right after the kill are served. Then the other decode worker is killed: the requests sent
right after it can only be served by the restarted one, so the router reaches it again. ``up``
logs each death and restart, and still exits 0 on SIGTERM (a restart in progress included),
leaving no process.

Bounded: short streams (the schemas' replies are short); every wait has a limit. The workers get
256 KV blocks, so all streams fit on one decode worker after a kill.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import params_to_proto
from tests.integration.cluster_fixtures import free_port
from tests.integration.schemas import validate
from tests.integration.structured_checks import PROMPT, SCHEMA_REQUESTS, max_tokens_for

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(300 + 7 * i, 340 + 7 * i)) for i in range(4)]
# two plain greedy streams and two under a JSON schema: a constrained stream that migrates to the
# other decode worker goes on under the matcher rebuilt from its tokens so far
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2 + [
    SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": SCHEMA})] * 2
# in flight at the first kill too: every schema of tests/integration/schemas.py, greedy and
# seeded; each must validate (its exactness across the migration is the two streams' above)
SCHEMA_STREAMS = [(r.schema, SamplingParams(temperature=r.temperature, seed=r.seed, max_tokens=max_tokens_for(r.schema),
                                             structured_outputs={"json": r.schema})) for r in SCHEMA_REQUESTS]
STEP_TIMEOUT_S = 240.0  # each wait (ready, a restart) on a busy 2-core machine


class Up:
    """The ``pdserve up`` process, its stderr collected line by line on a thread."""

    def __init__(self, tmp_path: Path, http_port: int, grpc_port: int) -> None:
        self.log_dir = tmp_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "2",
             "--transfer", "grpc", "--kvstore-gib", "0", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--worker-args", "--num-kv-blocks 256",
             "--drain-grace-s", "2", "--log-dir", str(tmp_path)],
            cwd=REPO, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, pattern: str, path: Path | None = None, count: int = 1) -> None:
        """Until ``pattern`` occurs ``count`` times in up's stderr (or the file at ``path``)."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace") if path else "".join(self.stderr)
            if len(re.findall(pattern, text)) >= count:
                return
            assert self.proc.poll() is None, f"up exited {self.proc.returncode}:\n{''.join(self.stderr)}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} after {STEP_TIMEOUT_S} s:\n{''.join(self.stderr)}")

    def children(self) -> list[int]:
        return [int(c) for t in Path(f"/proc/{self.proc.pid}/task").iterdir()
                for c in (t / "children").read_text().split()]

    def workers(self) -> dict[str, tuple[int, str]]:
        """{worker id: (pid, gRPC port)} of up's worker children."""
        found = {}
        for pid in self.children():
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if "--worker-id" in argv:
                found[argv[argv.index("--worker-id") + 1]] = (pid, argv[argv.index("--port") + 1])
        return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def _stream(channel: grpc.aio.Channel, prompt: list[int], params: SamplingParams,
                  started: asyncio.Event | None = None) -> list[int]:
    call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=params_to_proto(params)),
        timeout=STEP_TIMEOUT_S)
    return await _read(call, params, started)


async def _schema_stream(channel: grpc.aio.Channel, schema: dict, params: SamplingParams) -> list[int]:
    call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt=PROMPT, sampling_params=params_to_proto(params)), timeout=STEP_TIMEOUT_S)
    return await _read(call, params, schema=schema)


async def _read(call, params: SamplingParams, started: asyncio.Event | None = None,
                schema: dict = SCHEMA) -> list[int]:
    tokens: list[int] = []
    text = ""
    async for chunk in call:
        tokens += chunk.token_ids
        text += chunk.text
        if started is not None and len(tokens) >= 3:
            started.set()
    if params.structured_outputs is not None:
        validate(text, schema)
    return tokens


async def _load_with_kill(address: str, pid: int, with_schemas: bool = False,
                         ) -> tuple[list[list[int]], list[list[int]]]:
    """Streams of every prompt (and ``with_schemas``, SCHEMA_STREAMS after them: each validates);
    once each prompt's has its first tokens, SIGKILL ``pid`` and send every prompt again at once.
    Both rounds' tokens."""
    async with grpc.aio.insecure_channel(address) as channel:
        started = [asyncio.Event() for _ in PROMPTS]
        during = [asyncio.ensure_future(_stream(channel, p, q, e)) for p, q, e in zip(PROMPTS, PARAMS, started)]
        during += [asyncio.ensure_future(_schema_stream(channel, s, q)) for s, q in SCHEMA_STREAMS if with_schemas]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), STEP_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)
        after = [asyncio.ensure_future(_stream(channel, p, q)) for p, q in zip(PROMPTS, PARAMS)]
        return list(await asyncio.gather(*during)), list(await asyncio.gather(*after))


async def _all(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        return list(await asyncio.gather(*(_stream(channel, p, q) for p, q in zip(PROMPTS, PARAMS))))


def test_a_killed_decode_worker_is_restarted_and_no_request_fails(tmp_path):
    http_port, grpc_port = free_port(), free_port()
    up = Up(tmp_path, http_port, grpc_port)
    address = f"127.0.0.1:{grpc_port}"
    try:
        ready = up.proc.stdout.readline()
        assert ready == f"ready http=127.0.0.1:{http_port} grpc={address}\n", "".join(up.stderr)
        expected = asyncio.run(_all(address))  # undisturbed
        first = up.workers()
        assert sorted(first) == ["decode-0", "decode-1", "prefill-0"]

        during, after = asyncio.run(_load_with_kill(address, first["decode-0"][0], with_schemas=True))
        assert during[:len(PROMPTS)] == expected and after == expected  # the schemas' validated
        up.wait_for("decode-0 exited with code -9; restarting it in 0.5 s")
        up.wait_for(r"decode-0 restarted \(pid \d+\), serving again")
        again = up.workers()
        assert again["decode-0"][0] != first["decode-0"][0]
        assert again["decode-0"][1] == first["decode-0"][1]  # the same port: the router's address
        assert again["decode-1"] == first["decode-1"] and again["prefill-0"] == first["prefill-0"]

        # The router sees the restarted worker (its log line), then it must serve alone.
        decode_0 = f"127.0.0.1:{again['decode-0'][1]}"
        up.wait_for(rf"decode worker {re.escape(decode_0)} \(decode-0\) is healthy", tmp_path / "router.log", 2)
        _, after_second_kill = asyncio.run(_load_with_kill(address, again["decode-1"][0]))
        assert after_second_kill == expected
        up.wait_for("decode-1 exited with code -9")
        lines = [line for line in up.stderr if "exited with code" in line or "restarted" in line]
        assert len([line for line in lines if "decode-0" in line]) == 2, lines  # one death, one restart

        children = up.children()  # the workers, the router and the index's redis-server
        up.proc.send_signal(signal.SIGTERM)  # decode-1 may be restarting: up still exits 0
        assert up.proc.wait(60) == 0, "".join(up.stderr)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
