"""A scheduler with a real host tier over a KV cache *tensor* of token ids, stepped like the engine.

The device cache is ``[num_blocks, block_size]`` float64 holding each slot's token id (-1: never
written), the host pool has the same block shape, and the real HostTier moves blocks between
them. Before writing a step's tokens the runner reads back every computed position of each
scheduled request, so a block offloaded too late (after its new owner wrote it), a reload into
the wrong block, or a failed load that is not recomputed shows up as a request reading someone
else's tokens.

``ManualCopier`` runs the real copy jobs only when told (or when the engine side waits for
one), so a test decides when each copy in flight lands: a fence that is missing lets the runner
write into a block before a late copy reads it, or a late load overwrite a reused block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import torch

from engine.config import ModelConfig, Role, SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiers.copier import Copier, CopyFn, CopyJob
from engine.kv_cache.tiers.host_pool import HostBlockPool
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_cache.tiers.load_cost import LoadCostModel
from engine.kv_cache.tiers.lower_stage import LowerTierStager
from engine.kv_cache.tiers.lower_tier import EvictedBlock
from engine.request import Request
from engine.scheduler.output import RequestOutput, SchedulerOutput
from engine.scheduler.scheduler import Scheduler
from tests.unit._scheduler_fakes import counting_token


class FlakyHostTier(HostTier):
    """A host tier whose copies up from the slots in ``failing_slots`` raise, and whose copies
    down raise while ``is_offload_failing``, as a failed DMA would (fault injection: every other
    part is the real one)."""

    failing_slots: set[int]
    is_offload_failing: bool = False

    def copy_to_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if self.is_offload_failing:
            raise RuntimeError(f"injected offload failure on host slots {list(slots)}")
        super().copy_to_host(slots, block_ids)

    def copy_to_device(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        if set(slots) & self.failing_slots:
            raise RuntimeError(f"injected load failure on host slots {sorted(set(slots) & self.failing_slots)}")
        super().copy_to_device(block_ids, slots)


class ManualCopier:
    """A Copier whose jobs run, in submission order, when ``run(n)`` says so, or when the engine
    side waits for one (then every job up to it runs, as on the real thread)."""

    def __init__(self) -> None:
        self.queue: deque[CopyJob] = deque()

    def submit(self, fn: CopyFn) -> CopyJob:
        job = CopyJob(fn)
        self.queue.append(job)
        return job

    def run(self, num_jobs: int | None = None) -> int:
        """Run the oldest ``num_jobs`` queued jobs (None: all); returns how many ran."""
        count = 0
        while self.queue and (num_jobs is None or count < num_jobs):
            job = self.queue.popleft()
            job.run()
            job.is_done = True
            count += 1
        return count

    def wait(self, job: CopyJob) -> bool:
        if job.is_done:
            return False
        while not job.is_done:
            if not self.run(1):
                raise RuntimeError("waiting for a job this copier never got")
        return True

    def close(self) -> None:
        self.run()


class MemoryLowerTier:
    """A LowerTier in this process's memory, standing in for the node's kvstore in the state
    machine (the real client against a real store is tested in tests/integration): an LRU of
    at most ``capacity`` blocks, copied in on ``offer`` and out on ``load``. ``lose`` forgets
    everything (the store restarted); ``max_load`` caps how many blocks a load writes (a store
    that dies mid-read)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self.max_load: int | None = None
        self.prefetched: list[list[BlockHash]] = []  # each prefetch's chain
        self.matched: list[list[BlockHash]] = []  # each match's hashes

    def offer(self, blocks: Sequence[EvictedBlock]) -> None:
        for block in blocks:
            self.blocks[block.block_hash] = block.data.clone()
            self.blocks.move_to_end(block.block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> None:
        self.prefetched.append(list(block_hashes))

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        self.matched.append(list(block_hashes))
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.blocks:
            n += 1
        return n

    def load(self, block_hashes: Sequence[BlockHash], dst: torch.Tensor, dst_slots: Sequence[int]) -> int:
        limit = len(dst_slots) if self.max_load is None else min(self.max_load, len(dst_slots))
        for i in range(limit):
            data = self.blocks.get(block_hashes[i])
            if data is None:
                return i
            dst[dst_slots[i]] = data
        return limit

    def lose(self) -> None:
        self.blocks.clear()


def make_tier_scheduler(*, num_blocks: int = 4, num_host_blocks: int = 8, block_size: int = 4,
                        max_num_batched_tokens: int = 64, max_num_seqs: int = 4,
                        max_model_len: int = 64, lower: MemoryLowerTier | None = None,
                        copier: Copier | None = None, num_ahead: int = 0
                        ) -> tuple[Scheduler, FlakyHostTier]:
    """A scheduler over a real block pool and host tier (copies inline unless ``copier``)."""
    model_config = ModelConfig("fake", vocab_size=1000, hidden_size=8, intermediate_size=16, num_layers=1,
                               num_heads=1, num_kv_heads=1, head_dim=8, max_model_len=max_model_len)
    pool = BlockPool(num_blocks, enable_caching=True, enable_events=True)
    device_cache = torch.full((num_blocks, block_size), -1.0, dtype=torch.float64)
    host_pool = HostBlockPool(num_host_blocks, (block_size,), torch.float64, event_sink=pool.queue_event)
    stager = None
    if lower is not None:
        stager = LowerTierStager(lower, host_pool, LoadCostModel(block_size))
        host_pool.set_eviction_listener(stager.offer)
    tier = FlakyHostTier(host_pool, device_cache, LoadCostModel(block_size), stager, copier)
    tier.failing_slots = set()
    tier.attach(pool, num_ahead)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, Role.COLOCATED), model_config,
                          KVCacheManager(pool, block_size), block_size, True, tier)
    return scheduler, tier


class TierRunner:
    """Steps a scheduler like EngineCore.step: schedule, flush offloads, copy-on-write, forward."""

    def __init__(self, scheduler: Scheduler, tier: HostTier,
                 next_token: Callable[[Request], int] = counting_token) -> None:
        self.scheduler, self.tier, self.next_token = scheduler, tier, next_token
        self.kv = tier.device_cache

    def step(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        sched = self.scheduler.schedule()
        self.tier.flush()
        for src, dst in sched.copy_ops:
            self.kv[dst] = self.kv[src]
        sampled: dict[str, list[int]] = {}
        for request in sched.scheduled:
            num_new = sched.num_scheduled_tokens[request.request_id]
            self._read_and_write(request, request.num_computed_tokens, num_new)
            if request.num_computed_tokens + num_new >= request.num_tokens:
                for r in [request, *sched.fork_children.get(request.request_id, ())]:
                    sampled[r.request_id] = [self.next_token(r)]
        return sched, self.scheduler.update(sched, sampled)

    def _read_and_write(self, request: Request, start: int, num_new: int) -> None:
        block_ids = self.scheduler.kv_manager.get_block_ids(request.request_id)
        bs = self.scheduler.block_size
        token_ids = request.all_token_ids
        assert len(block_ids) * bs >= start + num_new, (request, block_ids, start, num_new)
        seen = [int(self.kv[block_ids[p // bs], p % bs]) for p in range(start)]
        assert seen == token_ids[:start], (f"{request} reads KV of tokens {seen}, its tokens are "
                                           f"{token_ids[:start]} (table {block_ids})")
        for p in range(start, start + num_new):
            self.kv[block_ids[p // bs], p % bs] = token_ids[p]

    def run(self, request: Request, max_steps: int = 100) -> tuple[list[int], int]:
        """Add ``request`` and step until nothing is left: (its output tokens, its cached tokens)."""
        self.scheduler.add_request(request)
        tokens: list[int] = []
        num_cached = -1
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return tokens, num_cached
            for output in self.step()[1]:
                if output.request_id == request.request_id:
                    tokens += output.new_token_ids
                    num_cached = output.num_cached_tokens
        raise AssertionError(f"{request} unfinished after {max_steps} steps")
