"""Chaos: a steady, bounded load through 1 router, 2 prefill and 2 decode workers (real
processes on loopback, gRPC KV transfer) while workers die and restart. Zero client requests
may fail, every greedy and seeded stream must equal the offline engine's, and no block may be
left in use on any worker afterwards.

The phases, in order, with the load running throughout:

1. decode worker A kills itself (SIGKILL) mid-stream: it runs with
   ``PDSERVE_FAULTS=kill:decode:after_tokens=6``, so the first stream it serves dies after six
   tokens were sent to the router.
2. prefill worker A kills itself (SIGKILL) just before sending the first token of its 4th
   request (``kill:prefill:before_first_token=4``). Both A workers are then restarted (side by
   side) without the faults.
3. a rolling restart, the prefill and the decode workers side by side as their two Deployments
   would roll: one worker of each role at a time gets SIGTERM (drain: ``--drain-grace-s 2``;
   streams that outlive it are cancelled and migrate), exits, comes back on its port, and is
   given time to be seen SERVING by the router before the next pair goes.

The test starts and restarts the processes itself (``pdserve up`` treats a dying child as
fatal). Each restart loads the model again, so the test takes a while on a busy machine.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import params_to_proto
from tests.integration.cluster_fixtures import (
    WorkerProcess,
    restart,
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 128
LEASE_MS = 10000
NUM_CLIENTS = 2
MAX_REQUESTS = 400  # per client: the load is bounded even if a phase hangs
# generous: on the shared 2-core machine a restarting worker (model load, kernel calibration)
# starves the others for minutes
CLIENT_TIMEOUT_S = 180.0
ROUTER_SEES_S = 2.5  # > reconnect backoff (<= 1 s) + 2 health polls: a restarted worker is routable
PROMPTS = [
    "The history of the lighthouse begins in the ancient world, where",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "1, 1, 2, 3, 5, 8, 13,",
    " ".join(["In the beginning the universe was created."] * 6) + " This has made",
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=16, ignore_eos=True),
]


@pytest.fixture(scope="module")
def llm(loaded_model):
    import torch

    from engine import LLM
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(loaded_model, num_kv_blocks=128)
    finally:
        torch.set_num_threads(threads)


async def generate(channel: grpc.aio.Channel, prompt: list[int], params: SamplingParams) -> list[int]:
    call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=params_to_proto(params)),
        timeout=CLIENT_TIMEOUT_S)
    return [t async for chunk in call for t in chunk.token_ids]


class Chaos:
    """The cluster, replaced process by process as the phases go."""

    def __init__(self, log_dir) -> None:
        common = ["--num-kv-blocks", str(NUM_BLOCKS)]
        self.prefill = [
            start_worker("prefill", log_dir, *common, transfer="grpc",
                         env={"PDSERVE_FAULTS": "kill:prefill:before_first_token=4"}),
            start_worker("prefill", log_dir, *common, transfer="grpc")]
        decode_args = [*common, "--reservation-lease-ms", str(LEASE_MS)]
        self.decode = [
            start_worker("decode", log_dir, *decode_args, transfer="grpc",
                         env={"PDSERVE_FAULTS": "kill:decode:after_tokens=6"}),
            start_worker("decode", log_dir, *decode_args, transfer="grpc")]
        self.router = start_router(log_dir, self.prefill, self.decode, "grpc")
        self.events: list[str] = []

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.prefill + self.decode

    def replace(self, exited: list[WorkerProcess]) -> None:
        """Restart the exited workers side by side; back once the router can route to them."""
        new = [restart(old) for old in exited]
        for old, worker in zip(exited, new):
            group = self.prefill if old.role == "prefill" else self.decode
            group[group.index(old)] = worker
        wait_serving(new)
        time.sleep(ROUTER_SEES_S)

    def wait_exit(self, worker: WorkerProcess, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while worker.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.proc.poll() is not None, f"{worker.address} did not exit:\n{worker.log_tail()}"
        return worker.proc.returncode

    def run_phases(self) -> None:
        """Blocking; runs on a thread next to the load."""
        victims = [self.decode[0], self.prefill[0]]  # phases 1 and 2: the faulted A workers die
        for victim in victims:
            self.events.append(f"{victim.role} A exited {self.wait_exit(victim)}")
        self.replace(victims)
        # phase 3: rolling restart, the prefill and the decode group side by side (as their two
        # Deployments roll), one worker of each at a time: the other one of each role serves
        for pair in zip(list(self.prefill), list(self.decode)):
            for worker in pair:
                worker.proc.send_signal(signal.SIGTERM)
            for worker in pair:
                self.events.append(f"{worker.role} {worker.address} drained, exit {self.wait_exit(worker)}")
            self.replace(list(pair))


def test_kills_and_a_rolling_restart_fail_no_request(tmp_path, llm):
    chaos = Chaos(tmp_path)
    try:
        wait_serving(chaos.workers + [chaos.router])
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        cases = list(itertools.product(range(len(PROMPTS)), range(len(PARAMS))))
        expected = {(i, j): llm.generate([prompt_ids[i]], PARAMS[j])[0].outputs[0].token_ids
                    for i, j in cases}
        results: list[tuple[tuple[int, int], list[int] | BaseException]] = []

        async def client(channel, offset: int, done: asyncio.Event) -> None:
            for n in range(MAX_REQUESTS):
                if done.is_set():
                    return
                case = cases[(offset + n) % len(cases)]
                try:
                    results.append((case, await generate(channel, prompt_ids[case[0]], PARAMS[case[1]])))
                except grpc.aio.AioRpcError as exc:
                    results.append((case, exc))

        async def scenario() -> None:
            done = asyncio.Event()
            async with grpc.aio.insecure_channel(chaos.router.address) as channel:
                clients = [asyncio.ensure_future(client(channel, k * 3, done))
                           for k in range(NUM_CLIENTS)]
                try:
                    await asyncio.to_thread(chaos.run_phases)
                finally:
                    done.set()
                    await asyncio.wait_for(asyncio.gather(*clients), 90)

        asyncio.run(scenario())
        failures = [(case, repr(r)) for case, r in results if isinstance(r, BaseException)]
        assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
        wrong = [(case, got) for case, got in results if got != expected[case]]
        assert not wrong, f"{len(wrong)} streams differ from offline, e.g. {wrong[:2]}"
        assert len(results) >= 20, chaos.events
        assert chaos.events[:2] == [f"decode A exited {-signal.SIGKILL}",
                                    f"prefill A exited {-signal.SIGKILL}"]
        assert all(e.endswith("exit 0") for e in chaos.events[2:]), chaos.events
        router_log = chaos.router.log_path.read_text()
        assert "migrating" in router_log  # the decode kill happened mid-stream
        seen = wait_all_blocks_free(chaos.workers, timeout_s=2 * LEASE_MS / 1000)
        assert all(free == total for free, total in seen.values()), f"blocks in use: {seen}"
    finally:
        stop_all([chaos.router])
        stop_all(chaos.workers)
