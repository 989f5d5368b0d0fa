"""One child process of ``pdserve up``: its command line, log file and address; started with
PR_SET_PDEATHSIG (it dies with ``up``), awaited until SERVING, stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.health import SERVING, check_health

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Run in each child before exec: die with the launcher (the setting survives execv). The
# signal comes when the *thread* that forked the child ends, so children are started on the
# launcher's main thread (the event loop), never from a worker thread.
DEATHSIG_SHIM = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                 "os.getppid() == int(sys.argv[1]) or sys.exit(70); "
                 "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
POLL_S = 0.2  # health polls while a child starts; exit polls while it runs


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


@dataclass
class Child:
    """``argv`` is the same at every start, so a restarted child serves on the same port(s)."""

    name: str
    argv: list[str]
    grpc_address: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's (e.g. API keys)
    http_port: int | None = None  # the router's: SERVING also needs its HTTP /health to be 200

    def start(self, env: dict[str, str]) -> None:
        env = {**env, **self.env}
        with open(self.log_path, "ab") as log:
            if sys.platform == "linux":
                argv = [sys.executable, "-c", DEATHSIG_SHIM, str(os.getpid()), *self.argv]
            else:
                argv = [sys.executable, *self.argv]
            # Own session: a terminal's Ctrl-C reaches only `up`, which stops the children in
            # order (router first); PDEATHSIG still ties them to `up`.
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def exit_code(self) -> int | None:
        """None while it runs (or before it started)."""
        return self.proc.poll() if self.proc else None

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def failure(self) -> ChildFailed | None:
        code = self.exit_code()
        if code is None:
            return None
        return ChildFailed(self, f"{self.name} exited with code {code}; last lines of "
                                 f"{self.log_path}:\n{self.log_tail()}")


async def wait_serving(child: Child, deadline: float) -> None:
    """Until ``child`` is SERVING (and its HTTP /health is 200); ChildFailed if it exits."""
    last = "no answer"
    while time.monotonic() < deadline:
        failure = child.failure()
        if failure is not None:
            raise failure
        try:
            is_internal = child.http_port is None  # the router's gRPC port is its public one
            if await check_health(child.grpc_address, timeout_s=1.0, is_internal=is_internal) == SERVING:
                if child.http_port is None or await asyncio.to_thread(_http_ok, child.http_port):
                    return
                last = "gRPC SERVING, HTTP /health not yet 200"
            else:
                last = "NOT_SERVING"
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = f"{type(exc).__name__}"
        await asyncio.sleep(POLL_S)
    raise ChildFailed(child, f"{child.name} not ready after the startup timeout ({last}); last "
                             f"lines of {child.log_path}:\n{child.log_tail()}")


async def wait_exit(child: Child) -> int:
    """Until ``child`` exits (polled, so a cancel needs no thread to end); its exit code."""
    while (code := child.exit_code()) is None:
        await asyncio.sleep(POLL_S)
    return code


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1.0) as reply:
            is_ok: bool = reply.status == 200
            return is_ok
    except OSError:
        return False


def stop_children(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM all of ``children``, wait up to ``grace_s`` + 5 s, then SIGKILL the rest."""
    for child in children:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 5
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
