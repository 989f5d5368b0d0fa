"""The index's key schema and the ``meta`` settings every process must agree on.

Everything for one model lives under one scope, ``pds:v1:{<model>:<compat8>}:``; the braces are a
Redis hash tag so one scope stays in one cluster slot and a Lua script may touch all of its keys::

    <scope>meta            HASH   schema, hash_domain, hash_seed, block_size, compat_hash
    <scope>w:<wid>         HASH   epoch, last_seq, gen, role, node, grpc, load fields
    <scope>alive:<wid>     STRING the worker's epoch, PX lease_ms: the lease
    <scope>workers         SET    every registered worker id (the janitor walks it, never SCAN)
    <scope>b:<hash hex>    HASH   field <wid> -> "<epoch>:<tier mask>" (mask bits: engine Tier)
    <scope>wb:<wid>        SET    hash hexes this worker holds (clearing it is O(owned))
    <scope>snap:<wid>      HASH   staging area of a snapshot in progress (hash hex -> mask)
    <scope>load:<wid>      ZSET   router reservations: member request id, score expiry ms

A process whose ``IndexMeta`` differs from the stored one refuses the index with
``IndexMetaMismatch``: different hash settings would give a silent 0 % hit rate otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.hashing import DOMAIN, BlockHash, root_hash
from engine.kv_transfer.base import kv_compat_hash

SCHEMA_VERSION = 1
_COMPAT_PREFIX_LEN = 8


class IndexMetaMismatch(RuntimeError):
    """The index in Redis was written with other hash settings than this process uses."""


@dataclass(frozen=True)
class IndexMeta:
    """The settings that decide what a block hash means; equal in every process of a deployment.

    ``hash_seed`` is the seed of ``engine.kv_cache.hashing.root_hash``; ``compat_hash`` is the full
    ``kv_compat_hash`` hex (model, dtype, block size, layout)."""

    model: str
    compat_hash: str
    block_size: int
    hash_seed: str = ""
    hash_domain: str = DOMAIN.decode()
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.model or any(c in self.model for c in "{}"):
            raise ValueError(f"index model name must be non-empty without braces, got {self.model!r}")
        if len(self.compat_hash) < _COMPAT_PREFIX_LEN:
            raise ValueError(f"compat_hash must be a hex digest of >= {_COMPAT_PREFIX_LEN} chars, "
                             f"got {self.compat_hash!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def scope(self) -> str:
        """The key prefix of this model's index, e.g. ``pds:v1:{smollm2:1a2b3c4d}:``."""
        return f"pds:v{self.schema}:{{{self.model}:{self.compat_hash[:_COMPAT_PREFIX_LEN]}}}:"

    @property
    def root_hash(self) -> BlockHash:
        return root_hash(self.hash_seed)

    def fields(self) -> dict[str, str]:
        """The ``meta`` hash as stored (all values strings)."""
        return {"schema": str(self.schema), "hash_domain": self.hash_domain,
                "hash_seed": self.hash_seed, "block_size": str(self.block_size),
                "compat_hash": self.compat_hash}

    def check_stored(self, stored: dict[str, str]) -> None:
        """Raise ``IndexMetaMismatch`` naming every field where ``stored`` differs from this meta.
        An empty ``stored`` (no index yet) passes."""
        if not stored:
            return
        mine = self.fields()
        diffs = [f"{k}: index has {stored.get(k)!r}, this process {v!r}"
                 for k, v in mine.items() if stored.get(k) != v]
        if diffs:
            raise IndexMetaMismatch(
                f"prefix index {self.scope}meta disagrees with this process ({'; '.join(diffs)}); "
                "every router and worker must use the same hash seed, domain and block size "
                "(or flush the index)")


def index_meta_for(model_name: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int,
                   head_dim: int, hash_seed: str = "") -> IndexMeta:
    """The index settings of a model's KV cache, computed without torch (what a router needs to
    find the scope the workers write: the same ``kv_compat_hash`` they put in their handshake)."""
    compat = kv_compat_hash(model_name, dtype, block_size, num_layers, num_kv_heads, head_dim)
    return IndexMeta(model_name, compat, block_size, hash_seed)


@dataclass(frozen=True)
class WorkerInfo:
    """Who publishes: the worker id (unique per deployment), its role and where to reach it."""

    worker_id: str
    role: str
    node: str = ""
    grpc: str = ""

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id must be non-empty without spaces, got {self.worker_id!r}")


def hash_hex(block_hash: BlockHash | bytes) -> str:
    """The key form of a block hash: 64 lowercase hex characters."""
    return block_hash.hex()
