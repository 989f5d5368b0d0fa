"""``free_port()``: a TCP port the OS reports free on a host, for a server about to start there.

The one definition for every process that starts servers on loopback: ``pdserve up`` (its router,
workers and embedded Redis), the Ray deployment's processes, the load tests' clusters and the
test fixtures. The port is free when returned; another process may take it before the caller
binds it, so callers bind (or start the child that binds) right away.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
