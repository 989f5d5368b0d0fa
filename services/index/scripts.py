"""Typed calls of the index's Lua scripts (``lua.py``) on one Redis connection.

Each script runs by EVALSHA; on NOSCRIPT (a restarted or flushed Redis) redis-py loads it again
and retries, so no process needs a warm-up. The scope prefix is every script's first argument.
Redis errors (connection refused, timeout) propagate as ``redis.RedisError``: the publisher and
the client decide what a failure means for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from services.index.lua import SCRIPTS
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo

ApplyOp = tuple[str, str, int]
"""One index op: ("S" | "R" | "C", hash hex ("" for C), tier mask)."""


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """One live worker's view for a request: how many leading blocks of the request it holds,
    split by the fastest tier holding each block, plus its published load."""

    worker_id: str
    num_device_blocks: int
    num_host_blocks: int
    num_kvstore_blocks: int
    num_reserved: int
    num_running: int
    num_waiting: int
    kv_usage: float
    role: str
    grpc_address: str = ""  # where the router reaches it (its --prefill/--decode address)

    @property
    def num_matched_blocks(self) -> int:
        """Length of the worker's cached prefix of the request, any tier, in blocks."""
        return self.num_device_blocks + self.num_host_blocks + self.num_kvstore_blocks


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class IndexScripts:
    """The index scripts bound to one ``redis.Redis`` client and one ``IndexMeta`` scope."""

    def __init__(self, client: redis.Redis, meta: IndexMeta) -> None:
        self.client = client
        self.meta = meta
        self.scope = meta.scope
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}

    def _run(self, name: str, *args: str | float, client: Any = None) -> Any:  # redis replies are untyped
        """Run script ``name``; ``client``: a pipeline to queue it on instead (None: run it now)."""
        return self._scripts[name](keys=[], args=[self.scope, *args], client=client)

    def register(self, worker: WorkerInfo, epoch: str, lease_ms: int) -> None:
        """(Re)register ``worker`` with ``epoch``: drops its previous entries, resets last_seq and
        gen to 0, writes ``meta`` if absent and starts the lease. Raises ``IndexMetaMismatch``."""
        meta = [x for kv in self.meta.fields().items() for x in kv]
        info = ["role", worker.role, "node", worker.node, "grpc", worker.grpc]
        reply = self._run("register", worker.worker_id, epoch, lease_ms, len(meta) // 2, *meta, *info)
        status = [_text(x) for x in reply]
        if status[0] == "META":
            self.meta.check_stored(self.stored_meta())
            raise IndexMetaMismatch(f"prefix index {self.scope}meta field {status[1]!r} is "
                                    f"{status[2]!r}; this process expects another value")

    def registered_epoch(self, worker_id: str) -> str | None:
        """The epoch ``worker_id`` is registered with, or None if it is not registered."""
        epoch = self.client.hget(f"{self.scope}w:{worker_id}", "epoch")
        return None if epoch is None else _text(epoch)

    def stored_meta(self) -> dict[str, str]:
        raw = self.client.hgetall(self.scope + "meta")
        return {_text(k): _text(v) for k, v in raw.items()}

    def apply(self, worker_id: str, epoch: str, seq_first: int, ops: Sequence[ApplyOp]) -> str:
        """Apply ops numbered ``seq_first..seq_first+len(ops)-1``: 'OK', 'DUP', 'GAP' or 'FENCED'."""
        flat = [x for op in ops for x in op]
        return _text(self._run("apply", worker_id, epoch, seq_first, *flat))

    def snapshot(self, worker_id: str, epoch: str, seq_at: int, holdings: Iterable[tuple[str, int]],
                 chunk_size: int = 1024) -> str:
        """Replace the worker's entries with ``holdings`` (hash hex, tier mask), as of event
        ``seq_at``: 'OK', 'FENCED' or 'STALE' (a newer snapshot or newer events won)."""
        gen = self.snapshot_begin(worker_id, epoch)
        if gen is None:
            return "FENCED"
        chunk: list[str | int] = []
        for hash_hex, mask in holdings:
            if mask:
                chunk += [hash_hex, mask]
            if len(chunk) >= 2 * chunk_size:
                status = self.snapshot_chunk(worker_id, epoch, gen, chunk)
                if status != "OK":
                    return status
                chunk = []
        if chunk:
            status = self.snapshot_chunk(worker_id, epoch, gen, chunk)
            if status != "OK":
                return status
        return self.snapshot_commit(worker_id, epoch, gen, seq_at)

    def snapshot_begin(self, worker_id: str, epoch: str) -> int | None:
        """Start a snapshot: its generation, or None when the epoch is fenced."""
        reply = self._run("snapshot_begin", worker_id, epoch)
        return reply if isinstance(reply, int) else None

    def snapshot_chunk(self, worker_id: str, epoch: str, gen: int, pairs: Sequence[str | int]) -> str:
        return _text(self._run("snapshot_chunk", worker_id, epoch, gen, *pairs))

    def snapshot_commit(self, worker_id: str, epoch: str, gen: int, seq_at: int) -> str:
        return _text(self._run("snapshot_commit", worker_id, epoch, gen, seq_at))

    def heartbeat(self, worker_id: str, epoch: str, lease_ms: int,
                  load: dict[str, str | float]) -> str:
        """Renew the lease and publish load fields: 'OK' or 'FENCED' (re-register)."""
        flat = [x for kv in load.items() for x in kv]
        return _text(self._run("heartbeat", worker_id, epoch, lease_ms, *flat))

    def remove(self, worker_id: str, epoch: str) -> str:
        """A leaving worker drops all its entries: 'OK' or 'FENCED' (a newer incarnation owns them)."""
        return _text(self._run("remove", worker_id, epoch))

    def reap(self, lock_ms: int = 0) -> int:
        """Janitor: forget every worker whose lease lapsed; returns how many. With ``lock_ms``,
        only if no other process reaped in the last ``lock_ms`` (else -1): one janitor per period."""
        return int(self._run("reap", lock_ms))

    def match(self, hash_hexes: Sequence[str]) -> dict[str, WorkerMatch]:
        """Per live worker, its cached prefix of the chain ``hash_hexes`` and its load."""
        return self.match_many([hash_hexes])[0]

    def match_many(self, chains: Sequence[Sequence[str]]) -> list[dict[str, WorkerMatch]]:
        """``match`` of each chain, in one call: one round trip, the workers' load read once."""
        args: list[str | float] = []
        for chain in chains:
            args.append(len(chain))
            args.extend(chain)
        rows, runs = self._run("match", *args)
        loads = [(_text(r[0]), int(r[1]), int(float(_text(r[2]) or 0)), int(float(_text(r[3]) or 0)),
                  float(_text(r[4]) or 0), _text(r[5]), _text(r[6])) for r in rows]
        result = []
        for flat in runs:
            held = {_text(flat[j]): (int(flat[j + 1]), int(flat[j + 2]), int(flat[j + 3]))
                    for j in range(0, len(flat), 4)}
            result.append({wid: WorkerMatch(wid, *held.get(wid, (0, 0, 0)), reserved, running, waiting,
                                            kv_usage, role, grpc)
                           for wid, reserved, running, waiting, kv_usage, role, grpc in loads})
        return result

    def reservations(self, ops: Sequence[tuple[str, str, str]], ttl_ms: int) -> list[int]:
        """Several ``reserve`` / ``release`` calls, in order, in one round trip (a pipeline):
        ``ops`` are ("reserve" | "release", worker id, request id); each reply as they give it."""
        pipe = self.client.pipeline(transaction=False)
        for op, worker_id, request_id in ops:
            if op not in ("reserve", "release"):
                raise ValueError(f"reservation op must be reserve or release, got {op!r}")
            self._run(op, worker_id, request_id, *([ttl_ms] if op == "reserve" else []), client=pipe)
        return [int(reply) for reply in pipe.execute()]

    def reserve(self, worker_id: str, request_id: str, ttl_ms: int) -> int:
        """Count ``request_id`` as in flight on ``worker_id`` for ``ttl_ms``; returns the worker's
        live reservation count (all routers)."""
        return int(self._run("reserve", worker_id, request_id, ttl_ms))

    def release(self, worker_id: str, request_id: str) -> bool:
        return bool(self._run("release", worker_id, request_id))
