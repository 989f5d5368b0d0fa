"""A request's cached prefix at admission, and the loads that bring its lower-tier part back.

The prefix is the device blocks that continue the request's hash chain, then the host tier's
continuation (and the lower tier's, the node's kvstore, staged through host slots:
``engine/kv_cache/tiers/``), loaded into fresh blocks when that is estimated faster than
recomputing. The scheduler drives it in three calls around its allocation::

    hit = prefix.find(request)                       # device blocks + pinned host entries
    if not allocate(request, hit.num_tokens + num_new, hit.device_blocks, hit.num_tokens):
        prefix.release(hit)                          # nothing changed
    num_computed = prefix.admit(request, hit)        # None: its prefix is loading

A host hit's load runs off the step loop: the request waits (WAITING_FOR_HOST_KV, holding its
blocks, the load's targets held against reuse) while the others step, and once the load has
landed (``settle``, first thing in each schedule) it is WAITING again with the loaded blocks as
computed and cached. A short load recomputes from the first block that did not load (no new
lookup for it, else it would load again). A request aborted meanwhile gives its blocks back,
the targets only once the load has landed. A DECODE reservation loads before it returns
(``load_now``): its reply states what is cached.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiers.host_pool import HostEntry
from engine.kv_cache.tiers.protocol import HostLoad, HostTierProtocol
from engine.request import Request, RequestStatus
from engine.stats import TierCounters


@dataclass(slots=True, eq=False)
class PrefixHit:
    """A request's cached prefix: device blocks (no reference taken), then host entries
    continuing the chain (pinned: ``admit`` / ``load_now`` loads them, ``release`` unpins)."""

    device_blocks: list[KVBlock]
    host_entries: list[HostEntry]
    num_tokens: int  # tokens both cover; without a lookup, those the request has computed
    num_lookup: int  # blocks looked up, for the tier counters (the last token is always computed)
    is_lookup: bool = True


@dataclass(slots=True, eq=False)
class _PrefixLoad:
    """A queued request's host hit being loaded into its blocks."""

    request: Request
    load: HostLoad
    hit: PrefixHit

    @property
    def is_short(self) -> bool:
        return self.load.num_loaded < len(self.load.entries)


class PrefixLoads:
    def __init__(self, kv_manager: KVCacheManager, host_tier: HostTierProtocol, block_size: int,
                 enable_prefix_caching: bool) -> None:
        self.kv_manager = kv_manager
        self.host_tier = host_tier
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device_counters = TierCounters()  # the device tier's hits and misses at admission
        self._loads: list[_PrefixLoad] = []  # in flight, oldest first (aborted requests' included)
        self._short_loaded: set[str] = set()  # their load came up short: recompute, no new lookup

    # ---- admission -------------------------------------------------------------------

    def find(self, request: Request) -> PrefixHit:
        """The cached prefix of a queued request about to be admitted. Only a request with
        nothing computed looks up, and not when it wants prompt logprobs (they need the logits
        of every prompt position) or its last load came up short."""
        if (request.num_computed_tokens == 0 and self.enable_prefix_caching
                and request.sampling_params.prompt_logprobs is None
                and request.request_id not in self._short_loaded):
            return self._lookup(request)
        return PrefixHit([], [], request.num_computed_tokens, 0, is_lookup=False)

    def find_for_reservation(self, request: Request) -> PrefixHit:
        """The cached prefix of a prompt whose KV another worker sends (DECODE)."""
        if self.enable_prefix_caching:
            return self._lookup(request)
        return PrefixHit([], [], 0, 0, is_lookup=False)

    def release(self, hit: PrefixHit) -> None:
        """The admission did not happen: unpin the host entries."""
        self.host_tier.release(hit.host_entries)

    def admit(self, request: Request, hit: PrefixHit) -> int | None:
        """The request's blocks for ``hit`` are allocated: load its host entries into the fresh
        blocks after the device hit. Returns the request's computed tokens, or None when it now
        waits for the load (WAITING_FOR_HOST_KV); the request is admitted otherwise."""
        if hit.host_entries:
            if not self._start(request, hit):
                return None
            return request.num_computed_tokens
        if hit.is_lookup:
            self._record(hit, hit.num_tokens)
        self._short_loaded.discard(request.request_id)
        return hit.num_tokens

    def load_now(self, request: Request, hit: PrefixHit) -> int:
        """A reservation's hit, its blocks allocated: copy the host entries into the fresh
        blocks after the device hit and cache them there (Stored(DEVICE)). Returns the computed
        tokens: through the last block that loaded (the rest is recomputed, as if never hit)."""
        num_computed = hit.num_tokens
        if hit.host_entries:
            num_loaded = self.host_tier.load(hit.host_entries, self._targets(request, hit))
            num_computed = (len(hit.device_blocks) + num_loaded) * self.block_size
            self.kv_manager.cache_blocks(request.request_id, request.block_hashes, num_computed,
                                         request.token_view)
        if hit.is_lookup:
            self._record(hit, num_computed)
        return num_computed

    def forget(self, request_id: str) -> None:
        """``request_id`` finished or was aborted."""
        self._short_loaded.discard(request_id)

    # ---- the step --------------------------------------------------------------------

    def settle(self) -> None:
        """Book the loads that have landed: their requests are queued for admission again."""
        if not self._loads:
            return
        self.host_tier.poll()
        landed = [p for p in self._loads if p.load.is_settled]
        self._loads = [p for p in self._loads if not p.load.is_settled]
        for prefix_load in landed:
            self._finish(prefix_load)
            request = prefix_load.request
            if request.status == RequestStatus.WAITING and prefix_load.is_short:
                self._short_loaded.add(request.request_id)  # else a lookup would load it again
                if request.num_computed_tokens == 0:
                    self.kv_manager.free(request.request_id)  # nothing loaded: admitted afresh

    def wait_for_oldest(self) -> bool:
        """Block until the oldest load in flight has landed and book it; False if there is none."""
        if not self._loads:
            return False
        self.host_tier.wait_for_load(self._loads[0].load)
        self.settle()
        return True

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prefix to load (they hold a seat)."""
        return sum(1 for p in self._loads if p.request.status == RequestStatus.WAITING_FOR_HOST_KV)

    @property
    def has_loads_in_flight(self) -> bool:
        """Loads not booked yet (their targets come back once booked)."""
        return bool(self._loads)

    # ---- helpers ---------------------------------------------------------------------

    def _lookup(self, request: Request) -> PrefixHit:
        """Device blocks, then the host tier's continuation of the chain; the last token is
        always left to compute."""
        device_blocks, num_device_tokens = self.kv_manager.get_computed_blocks(request.block_hashes,
                                                                              request.num_tokens)
        num_lookup = min(max(request.num_tokens - 1, 0) // self.block_size, len(request.block_hashes))
        start = len(device_blocks)
        host_entries = self.host_tier.match(
            request.block_hashes[start:num_lookup], request.block_hashes[start - 1] if start else None,
            request.token_view[start * self.block_size:max(num_lookup, start) * self.block_size])
        return PrefixHit(device_blocks, host_entries, num_device_tokens + len(host_entries) * self.block_size,
                         num_lookup)

    def _targets(self, request: Request, hit: PrefixHit) -> list[int]:
        """The fresh blocks after the device hit in the request's table, one per host entry."""
        start = len(hit.device_blocks)
        return self.kv_manager.get_block_ids(request.request_id)[start:start + len(hit.host_entries)]

    def _start(self, request: Request, hit: PrefixHit) -> bool:
        """Start loading, holding the targets until the load lands. Returns True when it already
        has (the request's computed tokens are set); else the request now waits for it."""
        targets = self._targets(request, hit)
        self.kv_manager.hold_blocks(targets)
        prefix_load = _PrefixLoad(request, self.host_tier.start_load(hit.host_entries, targets), hit)
        request.status = RequestStatus.WAITING_FOR_HOST_KV
        self.host_tier.poll()
        if prefix_load.load.is_settled:
            self._finish(prefix_load)
            self._short_loaded.discard(request.request_id)
            return True
        self._loads.append(prefix_load)
        return False

    def _finish(self, prefix_load: _PrefixLoad) -> None:
        """A landed load: its targets are released, and (unless the request went meanwhile)
        the request's computed tokens run through the last block that loaded, cached there
        (Stored(DEVICE)); it is WAITING again."""
        request, load, hit = prefix_load.request, prefix_load.load, prefix_load.hit
        self.kv_manager.release_blocks(load.block_ids)
        if request.status != RequestStatus.WAITING_FOR_HOST_KV:  # aborted or finished meanwhile
            return
        num_computed = (len(hit.device_blocks) + load.num_loaded) * self.block_size
        request.num_computed_tokens = num_computed
        self.kv_manager.cache_blocks(request.request_id, request.block_hashes, num_computed,
                                     request.token_view)
        self._record(hit, num_computed, load.num_host_run)
        request.status = RequestStatus.WAITING

    def _record(self, hit: PrefixHit, num_computed: int, num_host_run: int | None = None) -> None:
        """Count one admission's lookup: ``hit.num_lookup`` blocks asked of the device tier, what
        it missed asked of the host tier (``num_host_run``: see ``HostTier.record_query``)."""
        num_device_blocks = len(hit.device_blocks)
        num_host_blocks = num_computed // self.block_size - num_device_blocks
        self.device_counters.num_queried_blocks += hit.num_lookup
        self.device_counters.num_hit_blocks += num_device_blocks
        self.device_counters.num_hit_tokens += num_device_blocks * self.block_size
        self.host_tier.record_query(hit.num_lookup - num_device_blocks, num_host_blocks, self.block_size,
                                    num_host_run)
