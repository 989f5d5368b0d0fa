"""No block leaks on any tier: a hypothesis state machine interleaving add, step (which evicts,
offloads and reloads), abort, finish, failing loads and offloads, a cost gate that flips, host
loss, reset, and (when the machine has one) a lower tier below the host (an in-memory kvstore
stand-in) that is lost or dies mid-load, over the real scheduler, block pool, host tier and
lower-tier stager on a KV tensor of token ids. The copies run inline, or on a copier whose jobs
land when a rule says (``land``) or when the engine side waits for one, so copies in flight
meet every other rule, with blocks copied ahead of eviction or not.

Checked after every rule: the scheduler's invariants (tests/unit/_scheduler_fakes.py), the host
pool's integrity (its pins are exactly those of the copies in flight), both capacities, and that every hash the
host holds was announced Stored(HOST) and not removed since (the event stream replays to the
pool's state). Every step the runner reads back each request's computed tokens from the device
tensor, so a reload of the wrong bytes fails at once. At the end every request finishes and
every device block is free.
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.request import Request, RequestStatus
from tests.unit._scheduler_fakes import check_scheduler, make_request
from tests.unit._tier_fakes import ManualCopier, MemoryLowerTier, TierRunner, make_tier_scheduler

EOS = 0
MAX_MODEL_LEN = 32


def fake_token(request: Request) -> int:
    return zlib.crc32(f"{request.request_id}:{request.num_output_tokens}".encode()) % 6


prompts = st.lists(st.integers(1, 3), min_size=1, max_size=10)  # few symbols: prefix hits


class TierMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(4, 7),
                num_host_blocks=st.integers(1, 8), budget=st.integers(2, 16), max_num_seqs=st.integers(1, 3),
                lower_capacity=st.sampled_from([0, 3, 16]), is_deferred=st.booleans(),
                num_ahead=st.integers(0, 3))
    def setup(self, block_size, num_blocks, num_host_blocks, budget, max_num_seqs, lower_capacity,
              is_deferred, num_ahead):
        self.lower = MemoryLowerTier(lower_capacity) if lower_capacity else None
        self.copier = ManualCopier() if is_deferred else None
        self.scheduler, self.tier = make_tier_scheduler(
            num_blocks=num_blocks, num_host_blocks=num_host_blocks, block_size=block_size,
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
            lower=self.lower, copier=self.copier, num_ahead=num_ahead)
        self.runner = TierRunner(self.scheduler, self.tier, fake_token)
        self.ids = 0
        self.on_host: set[bytes] = set()  # replayed from the events
        self.prompts: list[list[int]] = []

    def _fits(self, request: Request) -> bool:
        max_len = min(request.num_prompt_tokens + request.sampling_params.max_tokens, MAX_MODEL_LEN)
        return -(-max_len // self.scheduler.block_size) <= self.scheduler.kv_manager.block_pool.num_blocks

    @rule(batch=st.lists(st.tuples(st.one_of(prompts, st.integers(0, 7)), st.integers(1, 3)),
                         min_size=1, max_size=4))
    def add(self, batch):
        """Add requests: new prompts, or (an int) one of the earlier ones again, for host hits."""
        for prompt, limit in batch:
            if isinstance(prompt, int):
                if not self.prompts:
                    continue
                prompt = self.prompts[prompt % len(self.prompts)]
            self.prompts.append(prompt)
            self.ids += 1
            request = make_request(f"r{self.ids}", prompt, limit, eos_token_ids=(EOS,))
            if self._fits(request):
                self.scheduler.add_request(request)

    @rule()
    def step(self):
        self.runner.step()

    @rule()
    def drain(self):
        """Step until idle: finished requests leave cached blocks for the next ones to evict."""
        for _ in range(100):
            if not self.scheduler.has_unfinished_requests():
                break
            self.runner.step()
        assert not self.scheduler.has_unfinished_requests()

    @rule(prompt=st.lists(st.integers(1, 3), min_size=5, max_size=10), others=st.integers(1, 3))
    def round_trip(self, prompt, others):
        """Run ``prompt``, then enough other prompts to push it off the device, then it again:
        a device -> host -> device round trip (if the cost gate and the failing slots let it)."""
        other = [4 + i % 3 for i in range(len(prompt))]
        for tokens in [prompt] + [other[i:] + other[:i] for i in range(others)] + [prompt]:
            self.add([(tokens, 2)])
            self.drain()

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.abort_request(request_id)
        assert self.scheduler.kv_manager.get_block_ids(request_id) == []

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    @rule(data=st.data())
    def fail_loads(self, data):
        """Make some host slots fail to load (or heal them all)."""
        slots = range(self.tier.host_pool.num_blocks)
        self.tier.failing_slots = data.draw(st.sets(st.sampled_from(slots), max_size=2))

    @rule(slow=st.booleans())
    def cost(self, slow):
        cost = self.tier.cost
        cost.load_us_per_block = cost.recompute_us_per_block * (10 if slow else 0.01)
        if self.tier.lower is not None:
            lower_cost = self.tier.lower.cost
            lower_cost.load_us_per_block = lower_cost.recompute_us_per_block * (10 if slow else 0.01)

    @precondition(lambda self: self.copier is not None and self.copier.queue)
    @rule(num_jobs=st.integers(1, 3))
    def land(self, num_jobs):
        """Copies in flight land (the engine side books them at its next look)."""
        self.copier.run(num_jobs)

    @rule(is_failing=st.booleans())
    def fail_offloads(self, is_failing):
        """Copies down fail from now on (or work again)."""
        self.tier.is_offload_failing = is_failing

    @rule()
    def lose_host(self):
        """The host tier is dropped (as a reset of that tier alone would)."""
        self.tier.clear(emit=True)

    @precondition(lambda self: self.lower is not None)
    @rule()
    def lose_kvstore(self):
        """The kvstore restarted: every block below the host is gone (a miss, then recompute)."""
        self.lower.lose()

    @precondition(lambda self: self.lower is not None)
    @rule(max_load=st.one_of(st.none(), st.integers(0, 2)))
    def kvstore_dies_mid_load(self, max_load):
        """Loads from the kvstore stop after ``max_load`` blocks (None: heal)."""
        self.lower.max_load = max_load

    @rule()
    def reset(self):
        self.tier.clear(emit=False)
        self.scheduler.kv_manager.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if not hasattr(self, "scheduler"):
            return
        check_scheduler(self.scheduler)
        self.tier.check_integrity()
        host = self.tier.host_pool
        assert host.num_cached_blocks <= host.num_blocks
        if self.lower is not None:
            assert len(self.lower.blocks) <= self.lower.capacity
        for event in self.scheduler.kv_manager.take_events():
            if isinstance(event, BlockStored) and event.tier == Tier.HOST:
                assert not set(event.block_hashes) & self.on_host, "stored twice on the host"
                self.on_host.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.tier == Tier.HOST:
                assert set(event.block_hashes) <= self.on_host, "removed from the host, never stored"
                self.on_host.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared) and event.tier in (None, Tier.HOST):
                self.on_host.clear()
        assert self.on_host == set(host.cached_block_hashes())

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(500):
            if not self.scheduler.has_unfinished_requests():
                break
            self.runner.step()
        assert not self.scheduler.has_unfinished_requests()
        self.consistent()
        pool = self.scheduler.kv_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks


TierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestTierMachine = TierMachine.TestCase
