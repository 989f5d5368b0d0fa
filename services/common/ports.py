"""``free_port()``: a TCP port the OS reports free on a host, for a server about to start there.

The one definition for every process that starts servers on loopback: ``pdserve up`` (its router,
workers and embedded Redis), the Ray deployment's processes, the load tests' clusters and the
test fixtures. The port is free when returned; another process may take it before the caller
binds it, so callers bind (or start the child that binds) right away.

It is drawn at random from below the OS's ephemeral range (Linux: ``ip_local_port_range``,
32768-60999 by default), not asked of the OS with port 0: that hands out an *ephemeral* port, the
kind every outgoing connection (a gRPC channel, a Redis client) takes as its source port, so one
of those could take it before the server binds it. Where the range cannot be read, port 0.

A port handed out is also *reserved* for RESERVE_S seconds in a directory every process on the
machine shares (a file named after the port, created with O_EXCL): the bind check alone cannot
see a port another process drew but has not bound yet, as when a test draws the router's ports
and ``pdserve up`` then draws its workers' before the router starts (seen in CI: the router found
its gRPC port taken).
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000  # above the well-known and most registered services' ports
MIN_POOL = 1_000  # fewer ports than this below the ephemeral range: use the OS's choice
MAX_TRIES = 100
RESERVE_S = 120.0  # long enough for a cluster to start and bind what it drew


def reservation_dir() -> Path:
    """Where handed-out ports are reserved: ``$PDSERVE_PORTS_DIR``, else a per-user temp folder."""
    default = Path(tempfile.gettempdir()) / f"pdserve-ports-{os.getuid()}"
    return Path(os.environ.get("PDSERVE_PORTS_DIR") or default)


def server_port_range() -> range | None:
    """The ports ``free_port`` draws from: from LOWEST_PORT to below the ephemeral range."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOWEST_PORT, low) if low - LOWEST_PORT >= MIN_POOL else None


def _bindable(host: str, port: int) -> int | None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return None
        bound: int = sock.getsockname()[1]
        return bound


def _reserve(port: int) -> bool:
    """True when no process reserved ``port`` in the last RESERVE_S seconds; reserves it.
    Best effort: where the directory cannot be written, every port counts as unreserved."""
    folder = reservation_dir()
    path = folder / str(port)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < RESERVE_S:
                return False
            os.utime(path)  # a stale reservation: take it over
            return True
        except OSError:
            return False  # removed or touched meanwhile: draw another
    except OSError:
        return True


def free_port(host: str = "127.0.0.1") -> int:
    pool = server_port_range()
    if pool is not None:
        for _ in range(MAX_TRIES):
            candidate = random.choice(pool)
            if _bindable(host, candidate) is not None and _reserve(candidate):
                return candidate
    port = _bindable(host, 0)
    if port is None:
        raise OSError(f"no free TCP port on {host}")
    return port
