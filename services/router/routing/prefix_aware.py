"""PrefixAwarePolicy: KV-aware routing through the Redis prefix index (``services/index``).

Per request (``plan``): hash the prompt's full blocks once (the workers' hash: block size and
seed from the index meta, ``SamplingParams.block_hash_extra_keys`` as extra keys), one
``IndexClient.match`` in a worker thread (bounded by the client's budget, a few ms), fold in
this router's recent decisions (``RecentDecisions``, one memory per role), then
``route_plan.plan_route``. Other routers' in-flight requests come from the index's reservation
counts: this router reserves each chosen worker in Redis (in the background, never awaited)
and releases it when the request ends (``finish``).

Metrics (``routing``, the router's ``RoutingRecorder``, set before ``configure``): the lookup
time of every answered ``match``, the index's availability after each, and every fallback.

Redis slow or down: ``match`` answers None (budget, circuit breaker) and the plan is load-only
(reason ``index_unavailable``); no request waits for Redis or fails because of it.

The index meta comes from the workers' KV compatibility (``WorkerStats.kv_compat``), given to
``configure``; an index written with other hash settings raises at startup
(``IndexMetaMismatch``), and is refused later (load-only, logged) if it changes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

import redis

from engine.kv_cache.hashing import BlockHash, hash_request_blocks
from engine.kv_transfer.base import KVCompat
from engine.sampling_params import SamplingParams
from services.index.batches import BatchingThread
from services.index.breaker import BreakerConfig
from services.index.client import IndexClient
from services.index.config import IndexClientConfig
from services.index.schema import IndexMeta
from services.index.scripts import WorkerMatch
from services.router.routing.policy import CurrentLoads, LoadPolicy
from services.router.routing.prefix_scoring import RecentDecisions
from services.router.routing.route_decisions import RouteDecisions
from services.router.routing.route_plan import (
    RouteConfig,
    RoutePlan,
    decode_candidate,
    plan_route,
    prefill_candidate,
)

log = logging.getLogger(__name__)
# A batch's lookups run in one script, its reservations in one pipeline: at most this many, so
# that one round trip stays well inside the budget (32 lookups of 12 blocks each, none held:
# ~0.2 ms of Redis time on a 2-core EPYC VM; all held: ~1.5 ms).
INDEX_BATCH = 32
# A probe costs one lookup budget (a few ms): after an outage the router retries the index at
# least every 2 s, so routing is KV-aware again within seconds of Redis coming back.
ROUTER_CLIENT_CONFIG = IndexClientConfig(breaker=BreakerConfig(failure_threshold=3, base_backoff_s=0.5,
                                                               max_backoff_s=2.0))


class PrefixAwarePolicy(LoadPolicy):
    """See the module docstring. ``pick_prefill`` / ``pick_decode`` (retries after a worker
    failed) are the load policy's."""

    plan_stage = "index_lookup"

    def __init__(self, redis_url: str, config: RouteConfig | None = None,
                 client_config: IndexClientConfig | None = None,
                 decisions: RouteDecisions | None = None, index_batch: int = INDEX_BATCH) -> None:
        """``index_batch``: the most lookups, or reservation writes, sent in one round trip."""
        super().__init__(decisions)
        self.redis_url = redis_url
        self.config = config = config or RouteConfig()
        self.client_config = client_config or ROUTER_CLIENT_CONFIG
        self.index: IndexClient | None = None
        self.meta: IndexMeta | None = None
        scoring = config.scoring
        self.recent = {role: RecentDecisions(scoring.memory_ttl_s, scoring.max_memory_entries)
                       for role in ("prefill", "decode")}
        # worker id -> this router's reservations there, until Redis has them released: a
        # release runs in the background, and a lookup reading the reservation still in Redis
        # while it was no longer counted here saw one request of "another router" on the worker
        self._own: dict[str, int] = {}
        self._own_lock = threading.Lock()
        self._reserved: dict[str, list[str]] = {}  # request id -> worker ids reserved
        # Lookups get a thread of their own: the background reservation writes (two per request,
        # never awaited) must not queue in front of the lookup a request is waiting on. Each
        # thread sends what queued during its last round trip in one (services/index/batches.py).
        self._lookups: BatchingThread[Sequence[BlockHash], dict[str, WorkerMatch] | None] = \
            BatchingThread(self._match_many, "prefix-lookup", index_batch)
        self._reservations: BatchingThread[tuple[str, str, str], int | None] = \
            BatchingThread(self._reserve_many, "prefix-reserve", index_batch)

    def configure(self, compat: KVCompat) -> None:
        """Open the index for a model with this KV compatibility. Raises IndexMetaMismatch when
        the index holds other hash settings; Redis being unreachable only logs (advisory)."""
        meta = IndexMeta(compat.model_name, compat.hash, compat.block_size)
        index = IndexClient(self.redis_url, meta, self.client_config)
        if self.routing is not None:
            index.on_fallback = self.routing.fallback
            self.routing.set_index_available(index.is_available)
        try:
            index.check_meta()
        except redis.RedisError as exc:
            log.warning("prefix index at %s not reachable at startup (%r); routing by load until "
                        "it is", self.redis_url, exc)
        self.meta, self.index = meta, index
        log.info("KV-aware routing through the prefix index %s", meta.scope)

    @property
    def is_configured(self) -> bool:
        return self.index is not None

    def block_hashes(self, prompt: Sequence[int], params: SamplingParams) -> list[BlockHash]:
        assert self.meta is not None, "configure() first"
        return hash_request_blocks(prompt, self.meta.block_size, params.block_hash_extra_keys,
                                   self.meta.root_hash)

    async def plan(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                   loads: CurrentLoads) -> RoutePlan | None:
        """Where ``request_id`` runs (route_plan.py); None when no worker fits the path. The
        loads are read after the index lookup: the plans of a burst wait for their lookups
        together, and each must see what the ones before it began."""
        started = time.perf_counter()
        hashes: list[BlockHash] = []
        matches: dict[str, WorkerMatch] | None = None
        if self.index is not None:
            hashes = self.block_hashes(prompt, params)
            lookup_started = time.perf_counter()
            matches = await self._lookups.call(hashes)
            if self.routing is not None:
                if matches is not None:
                    self.routing.index_lookup(time.perf_counter() - lookup_started)
                self.routing.set_index_available(self.index.is_available)
        prefill, decode = loads()
        block_size = self.meta.block_size if self.meta is not None else (decode or prefill)[0].block_size
        found = matches or {}
        decode_cands = self.recent["decode"].with_predictions(
            [decode_candidate(w, found.get(w.worker_id), self._others(found, w.worker_id))
             for w in decode], hashes)
        prefill_cands = self.recent["prefill"].with_predictions(
            [prefill_candidate(w, found.get(w.worker_id), self._others(found, w.worker_id))
             for w in prefill], hashes)
        plan = plan_route(len(prompt), block_size, prefill, decode, matches, self.config,
                          decode_cands, prefill_cands)
        if plan is None:
            return None
        ids = {w.address: w.worker_id or w.address for w in (*prefill, *decode)}
        chosen = [ids[plan.decode_address]]
        self.recent["decode"].record(hashes, chosen[0])
        if plan.prefill_address is not None:
            chosen.append(ids[plan.prefill_address])
            self.recent["prefill"].record(hashes, chosen[1])
        self._reserve(request_id, chosen)
        self.decisions.record(plan.key, time.perf_counter() - started)
        return plan

    def _others(self, matches: dict[str, WorkerMatch], worker_id: str) -> int:
        """Requests other routers have in flight on ``worker_id`` (the index's reservations
        less this router's own)."""
        match = matches.get(worker_id)
        return max(match.num_reserved - self._own.get(worker_id, 0), 0) if match is not None else 0

    def _match_many(self, chains: list[Sequence[BlockHash]]) -> list[dict[str, WorkerMatch] | None]:
        assert self.index is not None  # plan looks up only with one
        return self.index.match_many(chains)

    def _reserve_many(self, ops: list[tuple[str, str, str]]) -> list[int | None]:
        assert self.index is not None  # _reserve records nothing without one
        replies = self.index.reservations(ops)
        return [None] * len(ops) if replies is None else list(replies)

    def _reserve(self, request_id: str, worker_ids: list[str]) -> None:
        if self.index is None:
            return
        self._reserved[request_id] = worker_ids
        with self._own_lock:
            for wid in worker_ids:
                self._own[wid] = self._own.get(wid, 0) + 1
        for wid in worker_ids:
            self._reservations.submit(("reserve", wid, request_id))

    def finish(self, request_id: str) -> None:
        """The request ended (any way): release its reservations (in the background, after its
        reserve calls: one queue; each stays counted as this router's until its release is done,
        or failed)."""
        for wid in self._reserved.pop(request_id, []):
            self._reservations.submit(("release", wid, request_id), functools.partial(self._released, wid))

    def _released(self, worker_id: str, _: object) -> None:
        """On the reservation thread, after the release's round trip: no longer ours."""
        with self._own_lock:
            self._own[worker_id] = max(self._own.get(worker_id, 0) - 1, 0)

    def flush(self, timeout_s: float) -> None:
        """Wait until the index calls made so far (lookups, reservation writes) are done."""
        self._lookups.flush(timeout_s)
        self._reservations.flush(timeout_s)

    def close(self) -> None:
        self._lookups.shutdown()
        self._reservations.shutdown()
        if self.index is not None:
            self.index.close()
