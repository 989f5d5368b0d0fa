"""Cores shared by the busy engines of one machine: each step's thread count from who is busy.

``pdserve up`` runs its prefill and decode workers unpinned on the same cores. Each with a pool
as wide as the machine, a lone decode step gets every core (single-stream latency), but while
both compute, 2N threads share N cores and each OpenMP barrier waits for a thread the other
process holds: 1 prefill + 1 decode on 2 cores at concurrency 16 served 186-195 output tok/s so,
224-229 with one thread each (and single-stream ITL 10.5 ms against 5-6 ms). So each engine
takes, at the start of each step, its ``num_threads`` divided by the number of engines busy now.

The state is a small file that ``pdserve up`` creates (``create_share_file``) and every worker
maps (``--core-share PATH:SLOT``): one 16-byte slot per engine holding when its last step
started and ended (``time.monotonic_ns``, one clock for every process of the machine). An engine
counts as busy while in a step, or within ``GAP_NS`` of ending one (the pause between
back-to-back steps); a step started more than ``STALE_NS`` ago without an end is a dead
worker's (its restart clears the slot).
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable
from pathlib import Path

_SLOT = struct.Struct("<qq")  # step started, step ended (monotonic ns)
GAP_NS = 20_000_000  # 20 ms: an engine between two steps of its run is still busy
STALE_NS = 60_000_000_000  # 60 s: longer than any step; a slot "in a step" since then is dead


def create_share_file(path: Path, num_slots: int) -> Path:
    """A zeroed share file for ``num_slots`` engines (``pdserve up``, before its workers start)."""
    if num_slots < 1:
        raise ValueError(f"a core share needs at least one slot, got {num_slots}")
    path.write_bytes(bytes(num_slots * _SLOT.size))
    return path


def parse_share_spec(spec: str) -> tuple[str, int]:
    """'PATH:SLOT' -> (PATH, SLOT). Raises ValueError naming what is wrong."""
    path, sep, slot = spec.rpartition(":")
    if not sep or not path or not slot.isdigit():
        raise ValueError(f"--core-share must be PATH:SLOT (a file and a slot number), got {spec!r}")
    return path, int(slot)


def is_busy(started: int, ended: int, now: int) -> bool:
    """One slot's engine, as read at ``now`` (module docstring)."""
    if started > ended:
        return now - started < STALE_NS
    return ended > 0 and now - ended < GAP_NS


class CoreShare:
    """This engine's slot in a share file; ``step_started`` sets the thread count for the step
    through ``set_threads`` (called only when the count changes)."""

    def __init__(self, spec: str, num_threads: int, set_threads: Callable[[int], None]) -> None:
        path, slot = parse_share_spec(spec)
        with open(path, "r+b") as file:
            size = file.seek(0, 2)
            if size == 0 or size % _SLOT.size or slot >= size // _SLOT.size:
                raise ValueError(f"--core-share {spec!r}: slot {slot} is not in a share file of "
                                 f"{size} bytes ({size // _SLOT.size} slots)")
            self._map = mmap.mmap(file.fileno(), size)
        self._offset = slot * _SLOT.size
        self._num_slots = size // _SLOT.size
        self._num_threads = max(1, num_threads)
        self._set_threads = set_threads
        self._threads = self._num_threads
        self._started = self._ended = 0
        _SLOT.pack_into(self._map, self._offset, 0, 0)  # a restarted worker's slot starts idle

    @property
    def threads(self) -> int:
        """The thread count of the current (or last) step."""
        return self._threads

    def busy_engines(self, now: int) -> int:
        """Engines busy at ``now``, this one counted."""
        others = 0
        for offset in range(0, self._num_slots * _SLOT.size, _SLOT.size):
            if offset != self._offset:
                started, ended = _SLOT.unpack_from(self._map, offset)
                others += is_busy(started, ended, now)
        return 1 + others

    def step_started(self) -> None:
        self._started = now = time.monotonic_ns()
        _SLOT.pack_into(self._map, self._offset, self._started, self._ended)
        threads = max(1, self._num_threads // self.busy_engines(now))
        if threads != self._threads:
            self._threads = threads
            self._set_threads(threads)

    def step_ended(self) -> None:
        self._ended = time.monotonic_ns()
        _SLOT.pack_into(self._map, self._offset, self._started, self._ended)
