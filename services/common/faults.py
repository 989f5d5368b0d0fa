"""Fault injection for chaos tests: off unless the ``PDSERVE_FAULTS`` environment variable names
faults, parsed once per process, never reachable from any API.

    PDSERVE_FAULTS="kv_transfer:drop:0.5,kill:decode:after_tokens=5,redis:stall_ms=200"

Entries (comma-separated; each at most once):

=====================================  ==========================================================
``kv_transfer:drop:P``                 a KV send fails at once with probability P (never sent)
``kv_transfer:delay_ms:N``             every KV send starts N ms late
``kv_transfer:corrupt:P``              a gRPC KV push of bytes flips one payload byte with
                                       probability P (the receiver's crc32 check must reject
                                       it; a same-host push through shared memory has no
                                       transit to corrupt)
``kill:decode:after_tokens=N``         a decode worker SIGKILLs itself once it has streamed N
                                       tokens of one request (Decode or Generate)
``kill:prefill:before_first_token=N``  a prefill worker SIGKILLs itself at its N-th request,
                                       just before sending the first token
``redis:stall_ms=N``                   every prefix-index Redis call waits N ms first
``kill:kvstore:at_release=N``          the kvstore SIGKILLs itself when its N-th Release arrives
                                       (a worker's NIXL READ ran, its lease is still held)
``kvstore:progress_delay_ms=N``        the kvstore drives NIXL (UCX) progress only after N ms of
                                       a read lease (a stalled store: over UCX tcp, READs wait)
``seed=N``                             the random draws of drop / corrupt (default 0)
=====================================  ==========================================================

A bad spec raises ValueError naming the entry at the first ``faults()`` call (process start).
With the variable unset every hook returns at once and changes nothing.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

FAULTS_ENV = "PDSERVE_FAULTS"


@dataclass(frozen=True)
class FaultPlan:
    kv_drop_p: float = 0.0
    kv_corrupt_p: float = 0.0
    kv_delay_ms: float = 0.0
    kill_decode_after_tokens: int = 0  # 0: never
    kill_prefill_before_first_token: int = 0  # 0: never; N: at the N-th prefill request
    redis_stall_ms: float = 0.0
    kill_kvstore_at_release: int = 0  # 0: never; N: at the N-th Release
    kvstore_progress_delay_ms: float = 0.0
    seed: int = 0

    @property
    def is_active(self) -> bool:
        return self != FaultPlan(seed=self.seed)


_FIELDS = {  # entry key -> (field, parse)
    "kv_transfer:drop": ("kv_drop_p", "probability"),
    "kv_transfer:corrupt": ("kv_corrupt_p", "probability"),
    "kv_transfer:delay_ms": ("kv_delay_ms", "ms"),
    "kill:decode:after_tokens": ("kill_decode_after_tokens", "count"),
    "kill:prefill:before_first_token": ("kill_prefill_before_first_token", "count"),
    "redis:stall_ms": ("redis_stall_ms", "ms"),
    "kill:kvstore:at_release": ("kill_kvstore_at_release", "count"),
    "kvstore:progress_delay_ms": ("kvstore_progress_delay_ms", "ms"),
    "seed": ("seed", "int"),
}


def parse_faults(spec: str) -> FaultPlan:
    """The plan a ``PDSERVE_FAULTS`` value names (module docstring); "" is no fault.
    Raises ValueError naming the bad entry."""
    values: dict[str, Any] = {}  # field -> float or int, as _FIELDS' kind says
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        key, sep, raw = entry.rpartition("=") if "=" in entry else entry.rpartition(":")
        if not sep or key not in _FIELDS:
            raise ValueError(f"{FAULTS_ENV}: unknown fault {entry!r}; known: "
                             f"{', '.join(sorted(_FIELDS))} (see services/common/faults.py)")
        name, kind = _FIELDS[key]
        if name in values:
            raise ValueError(f"{FAULTS_ENV}: {key!r} given twice")
        values[name] = _parse_value(entry, raw, kind)
    return FaultPlan(**values)


def _parse_value(entry: str, raw: str, kind: str) -> float | int:
    try:
        value: float | int = float(raw) if kind in ("probability", "ms") else int(raw)
    except ValueError:
        raise ValueError(f"{FAULTS_ENV}: {entry!r}: {raw!r} is not a number") from None
    if kind == "probability" and not 0.0 <= value <= 1.0:
        raise ValueError(f"{FAULTS_ENV}: {entry!r}: a probability must be in [0, 1]")
    if kind == "ms" and not 0.0 <= value <= 60_000:
        raise ValueError(f"{FAULTS_ENV}: {entry!r}: ms must be in [0, 60000]")
    if kind == "count" and value < 1:
        raise ValueError(f"{FAULTS_ENV}: {entry!r}: a count must be >= 1")
    return value


class Faults:
    """The hooks; each is a no-op unless its fault is in the plan."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._num_prefills = 0
        self._num_releases = 0

    def kv_send_dropped(self) -> bool:
        """Before a KV send: True if this one must fail unsent; sleeps the configured delay."""
        if self.plan.kv_delay_ms:
            time.sleep(self.plan.kv_delay_ms / 1000)
        return bool(self.plan.kv_drop_p) and self._rng.random() < self.plan.kv_drop_p

    def kv_corrupted(self, data: bytes) -> bytes:
        """A gRPC KV chunk as sent: ``data``, or (with probability P) a copy with one byte flipped."""
        if not self.plan.kv_corrupt_p or not data or self._rng.random() >= self.plan.kv_corrupt_p:
            return data
        flipped = bytearray(data)
        flipped[self._rng.randrange(len(flipped))] ^= 0xFF
        return bytes(flipped)

    def after_decode_tokens(self, num_streamed: int) -> None:
        """A decode worker streamed ``num_streamed`` tokens of one request."""
        if self.plan.kill_decode_after_tokens and num_streamed >= self.plan.kill_decode_after_tokens:
            _kill_self()

    def before_first_token(self) -> None:
        """A prefill worker is about to send a request's first token."""
        if self.plan.kill_prefill_before_first_token:
            self._num_prefills += 1
            if self._num_prefills >= self.plan.kill_prefill_before_first_token:
                _kill_self()

    def at_kvstore_release(self) -> None:
        """The kvstore received a Release (before it releases the lease)."""
        if self.plan.kill_kvstore_at_release:
            self._num_releases += 1
            if self._num_releases >= self.plan.kill_kvstore_at_release:
                _kill_self()

    def redis_stall(self) -> None:
        """Before a prefix-index Redis call."""
        if self.plan.redis_stall_ms:
            time.sleep(self.plan.redis_stall_ms / 1000)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def faults() -> Faults:
    """This process's hooks, from ``PDSERVE_FAULTS`` read at the first call."""
    return Faults(parse_faults(os.environ.get(FAULTS_ENV, "")))
