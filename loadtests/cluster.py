"""Start and stop a ``pdserve up`` cluster for a benchmark, and stream OpenAI completions from it.

    with running_cluster(["--colocated"]) as cluster:        # waits for the `ready` line
        result = await stream_completion(session, cluster.http_url, prompt_ids, max_tokens=64)
        before = host_cpu(cluster.proc.pid)                  # CPU seconds of each process under it

Loopback only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from services.common.ports import free_port

READY_TIMEOUT_S = 300


@dataclass
class Cluster:
    proc: subprocess.Popen
    grpc_address: str
    http_url: str

    @property
    def model(self) -> str:
        """The served model's name (``GET /v1/models``)."""
        with urllib.request.urlopen(f"{self.http_url}/v1/models", timeout=10) as response:
            return json.load(response)["data"][0]["id"]


def start_cluster(up_args: Sequence[str]) -> Cluster:
    """``pdserve up`` with ``up_args`` on free loopback ports; returns once it prints ``ready``."""
    grpc_port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), *up_args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"pdserve up {' '.join(up_args)} exited with {proc.returncode}")
        if line.startswith("ready"):
            return Cluster(proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
    stop_cluster(proc)
    raise RuntimeError(f"pdserve up {' '.join(up_args)} not ready in {READY_TIMEOUT_S} s")


def stop_cluster(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def running_cluster(up_args: Sequence[str]) -> Iterator[Cluster]:
    cluster = start_cluster(up_args)
    try:
        yield cluster
    finally:
        stop_cluster(cluster.proc)


@dataclass
class StreamResult:
    """One streamed request: ``status`` is the HTTP status (or 0 if the connection failed),
    ``stamps`` the arrival time of every chunk that carried text, ``error`` why it failed."""

    status: int
    started: float
    stamps: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and bool(self.stamps)

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.started

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


async def stream_completion(session, base_url: str, model: str, prompt: str | list[int],
                            max_tokens: int, timeout_s: float = 600.0) -> StreamResult:
    """POST /v1/completions with ``stream: true`` (greedy, ignore_eos, usage included)."""
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult(0, time.perf_counter())
    try:
        async with session.post(f"{base_url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            result.status = response.status
            if response.status != 200:
                result.error = (await response.text())[:300]
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"])[:300]
                elif event.get("choices") and event["choices"][0].get("text"):
                    result.stamps.append(time.perf_counter())
                if event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# host_cpu: a process's role from its command line (``pdserve up`` starts each as `services.cli ...`)
_ROLES = (("serve router", "router"), ("serve prefill", "prefill"), ("serve decode", "decode"),
          ("serve kvstore", "kvstore"), ("redis-server", "redis"), ("services.cli up", "up"))
ENGINE_THREAD = "engine-loop"  # the OS name AsyncEngine gives its thread (services/common/async_engine.py)


@dataclass
class ProcessCpu:
    """CPU seconds (user + system) of one process so far: all threads, its main thread (a
    service's event loop), its engine thread (0 where none)."""

    role: str
    total_s: float
    main_s: float
    engine_s: float

    def minus(self, earlier: ProcessCpu | None) -> ProcessCpu:
        if earlier is None:
            return self
        return ProcessCpu(self.role, self.total_s - earlier.total_s, self.main_s - earlier.main_s,
                          self.engine_s - earlier.engine_s)


def _stat_cpu_s(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return _stat_cpu_s(f.read())


def thread_cpu_seconds(pid: int) -> dict[tuple[int, str], float]:
    """{(tid, OS thread name): CPU seconds so far} of ``pid``'s live threads."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            seconds[(int(tid), stat[stat.index("(") + 1:stat.rindex(")")])] = _stat_cpu_s(stat)
    return seconds


def host_cpu(root_pid: int) -> dict[int, ProcessCpu]:
    """``ProcessCpu`` of ``root_pid`` and every process under it, by pid (Linux /proc; empty
    elsewhere). Processes that end meanwhile are left out."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    tree, changed = {root_pid}, True
    while changed:
        grown = tree | {pid for pid, parent in parents.items() if parent in tree}
        changed, tree = grown != tree, grown
    result = {}
    for pid in tree:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ")
            total, threads = cpu_seconds(pid), thread_cpu_seconds(pid)
            main = sum(s for (tid, _), s in threads.items() if tid == pid)
            engine = sum(s for (_, name), s in threads.items() if name == ENGINE_THREAD)
            role = next((name for key, name in _ROLES if key in command), "other")
            result[pid] = ProcessCpu(role, total, main, engine)
    return result


def host_cpu_by_role(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> dict[str, ProcessCpu]:
    """The CPU each role's processes used between two ``host_cpu`` snapshots (summed per role)."""
    by_role: dict[str, ProcessCpu] = {}
    for pid, now in after.items():
        used = now.minus(before.get(pid))
        total = by_role.get(used.role)
        by_role[used.role] = used if total is None else ProcessCpu(
            used.role, total.total_s + used.total_s, total.main_s + used.main_s, total.engine_s + used.engine_s)
    return by_role

