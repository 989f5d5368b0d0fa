"""``free_port()``: a TCP port the OS reports free on a host, for a server about to start there.

The one definition for every process that starts servers on loopback: ``pdserve up`` (its router,
workers and embedded Redis), the Ray deployment's processes, the load tests' clusters and the
test fixtures. The port is free when returned; another process may take it before the caller
binds it, so callers bind (or start the child that binds) right away.

It is drawn at random from below the OS's ephemeral range (Linux: ``ip_local_port_range``,
32768-60999 by default), not asked of the OS with port 0: that hands out an *ephemeral* port, the
kind every outgoing connection (a gRPC channel, a Redis client) takes as its source port, so one
of those could take it before the server binds it. Where the range cannot be read, port 0.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000  # above the well-known and most registered services' ports
MIN_POOL = 1_000  # fewer ports than this below the ephemeral range: use the OS's choice
MAX_TRIES = 100


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


def free_port(host: str = "127.0.0.1") -> int:
    pool = server_port_range()
    if pool is not None:
        for _ in range(MAX_TRIES):
            port = _bindable(host, random.choice(pool))
            if port is not None:
                return port
    port = _bindable(host, 0)
    if port is None:
        raise OSError(f"no free TCP port on {host}")
    return port
