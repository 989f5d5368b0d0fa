"""Keeps ``pdserve up``'s children running once the cluster is ready, as a local deployment
would: a child that dies (crash, OOM kill, SIGKILL) is started again with the same command line,
so on the same port(s), and the router, which knows its workers by those fixed addresses,
reconnects to it (its channels retry every <= 1 s; its health poll routes to it again once it
is SERVING). Meanwhile the survivors serve: the router migrates the streams of a lost worker.

    death ──▶ wait backoff ──▶ start ──▶ SERVING ──▶ (running)
                 ▲                          │ exits or hangs past the startup timeout
                 └──────────────────────────┘

Bounded: the k-th death within ``window_s`` waits ``initial_backoff_s * 2**(k-1)`` (at most
``max_backoff_s``); the death that would be restart ``max_restarts + 1`` within the window
ends the supervision with ChildFailed, and ``up`` exits. Each death and each restart is one
line on ``up``'s stderr; no metrics endpoint of its own (the router's metrics show the lost
worker's requests as migrated, not the restart).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.launcher.child import Child, ChildFailed, wait_exit, wait_serving


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # within window_s; 0: the first death ends `up`
    window_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def backoff_s(self, num_recent_deaths: int) -> float:
        """The wait before restarting after the ``num_recent_deaths``-th death in the window."""
        return min(self.initial_backoff_s * 2.0 ** (num_recent_deaths - 1), self.max_backoff_s)


class Supervisor:
    def __init__(self, children: Sequence[Child], env: dict[str, str], policy: RestartPolicy,
                 startup_timeout_s: float) -> None:
        self.children = list(children)
        self.env = env
        self.policy = policy
        self.startup_timeout_s = startup_timeout_s

    async def run(self) -> None:
        """Until cancelled (``up`` was asked to stop), or ChildFailed: a child's restarts ran out."""
        tasks = [asyncio.ensure_future(self._keep(child)) for child in self.children]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, child: Child) -> None:
        deaths: deque[float] = deque()
        while True:
            code = await wait_exit(child)
            now = time.monotonic()
            deaths.append(now)
            while deaths and deaths[0] < now - self.policy.window_s:
                deaths.popleft()
            if len(deaths) > self.policy.max_restarts:
                raise ChildFailed(child, (
                    f"{child.name} exited with code {code}, its death number {len(deaths)} within "
                    f"{self.policy.window_s:g} s (at most {self.policy.max_restarts} restarts); "
                    f"last lines of {child.log_path}:\n{child.log_tail()}"))
            delay = self.policy.backoff_s(len(deaths))
            say(f"{child.name} exited with code {code}; restarting it in {delay:g} s "
                 f"(restart {len(deaths)} of at most {self.policy.max_restarts} within "
                 f"{self.policy.window_s:g} s)")
            await asyncio.sleep(delay)
            await self._restart(child)

    async def _restart(self, child: Child) -> None:
        """Start ``child`` again and wait until it serves; one that hangs is killed (its exit
        is the next death)."""
        child.start(self.env)  # on the event loop's thread: see child.DEATHSIG_SHIM
        try:
            await wait_serving(child, time.monotonic() + self.startup_timeout_s)
        except ChildFailed:
            if child.proc is not None and child.exit_code() is None:
                child.proc.kill()
            return
        pid = child.proc.pid if child.proc is not None else 0
        say(f"{child.name} restarted (pid {pid}), serving again at {child.grpc_address}")


def say(line: str) -> None:
    """One line of ``up``'s own log (its stderr)."""
    print(f"pdserve up: {line}", file=sys.stderr, flush=True)
