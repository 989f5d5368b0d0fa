"""One ``pdserve serve <role> ...`` child process owned by a Ray Serve replica: started on a
free port, awaited until grpc.health.v1 says SERVING, stopped with SIGTERM (drain) then SIGKILL.

The child dies with the replica's process (Linux ``PR_SET_PDEATHSIG``, as ``pdserve up`` does),
so a replica killed by Ray leaves nothing behind. Its output goes to ``<log_dir>/<name>.log``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.health import SERVING, check_health
from services.common.ports import free_port
from services.launcher import DEATHSIG_SHIM, REPO_ROOT

POLL_S = 0.5  # health polls while a child starts (bounded by the startup timeout)


class ServiceProcess:
    """``pdserve serve`` + ``argv`` with ``--host``/port flags added; ``address`` is what it
    serves gRPC on (``publish_host:port``)."""

    def __init__(self, name: str, argv: list[str], port_flags: tuple[str, ...], host: str,
                 publish_host: str, log_dir: Path, env: dict[str, str] | None = None,
                 is_public: bool = False) -> None:
        self.name = name
        self.is_public = is_public  # a router: its gRPC port is the public one (plaintext)
        self.ports = {flag: free_port() for flag in port_flags}
        flags = [word for flag, port in self.ports.items() for word in (flag, str(port))]
        self.argv = [*argv, "--host", host, *flags]
        grpc_port = self.ports.get("--grpc-port", self.ports.get("--port"))
        self.address = f"{publish_host}:{grpc_port}"
        self.local_address = f"127.0.0.1:{grpc_port}" if host in ("0.0.0.0", "127.0.0.1") \
            else self.address
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        child_env = {**os.environ, **(env or {})}
        child_env.setdefault("UCX_NET_DEVICES", "lo" if host == "127.0.0.1" else "all")
        pythonpath = child_env.get("PYTHONPATH", "")
        child_env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{pythonpath}" if pythonpath \
            else str(REPO_ROOT)
        shim = [sys.executable, "-c", DEATHSIG_SHIM, str(os.getpid())] \
            if sys.platform == "linux" else [sys.executable]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*shim, "-m", "services.cli", "serve", *self.argv],
                                         cwd=REPO_ROOT, env=child_env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def failure(self) -> str | None:
        """Why the child is gone (exit code and log tail), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"{self.name} exited with code {code}; last lines of {self.log_path}:\n" \
               f"{self.log_tail()}"

    async def is_serving(self) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            return await check_health(self.local_address, timeout_s=2.0,
                                      is_internal=not self.is_public) == SERVING
        except Exception:  # noqa: BLE001 - not answering is not serving
            return False

    async def wait_serving(self, timeout_s: float) -> None:
        """Until SERVING; RuntimeError with the log tail if the child exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failure = self.failure()
            if failure is not None:
                raise RuntimeError(failure)
            if await self.is_serving():
                return
            await asyncio.sleep(POLL_S)
        raise RuntimeError(f"{self.name} not SERVING after {timeout_s} s; last lines of "
                           f"{self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the service drains for up to ``grace_s``), then SIGKILL 5 s later."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
