"""Offload and reload off the step loop (engine/kv_cache/tiers/host_tier.py with a copier), over a KV
tensor of token ids (tests/unit/_tier_fakes.py). ``ManualCopier`` decides when each copy lands,
so the fences are checked exactly: a block whose copy down is in flight is not handed out while
other blocks are free, and waited for (counted) only when none is; the host announces a block
once its bytes are there; a host hit loads while other requests step; an abort during a load
gives the blocks back once it lands; ``clear`` waits for copies in flight. Then the real thread."""

from __future__ import annotations

import pytest

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_cache.tiers.copier import BackgroundCopier
from engine.request import RequestStatus
from tests.unit._scheduler_fakes import check_scheduler, make_request
from tests.unit._tier_fakes import ManualCopier, TierRunner, make_tier_scheduler

BS = 4
PROMPT_A = list(range(1, 14))  # 13 tokens: 3 full blocks and one more
PUSHER = list(range(201, 230))  # 29 tokens: 8 blocks, all of an 8-block pool
SHORT = list(range(51, 56))  # 5 tokens, shares nothing with the others
HA = hash_request_blocks(PROMPT_A, BS)


@pytest.fixture
def manual():
    copier = ManualCopier()
    scheduler, tier = make_tier_scheduler(num_blocks=8, num_host_blocks=16, block_size=BS,
                                          max_num_seqs=4, copier=copier)
    runner = TierRunner(scheduler, tier)
    yield scheduler, tier, runner, copier
    check_scheduler(scheduler)
    tier.check_integrity()


def events(scheduler):
    return scheduler.kv_manager.take_events()


def test_blocks_in_flight_are_taken_last_and_announced_when_their_bytes_land(manual):
    scheduler, tier, runner, copier = manual
    pool = scheduler.kv_manager.block_pool
    runner.run(make_request("a", PROMPT_A, max_tokens=1))
    events(scheduler)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]  # A's table tail first
    tier.attach(pool, num_ahead=8)
    tier.flush()  # copies A's 3 cached blocks down, ahead of any eviction
    assert len(copier.queue) == 1 and events(scheduler) == []  # nothing announced in flight
    assert tier.host_pool.match_prefix(HA) == []
    taken = pool.get_new_blocks(5)  # what is free and not in flight goes first: no wait
    assert [b.block_id for b in taken] == [4, 5, 6, 7, 3] and tier.stats.num_offload_waits == 0
    assert events(scheduler) == [] and len(copier.queue) == 1
    tier.check_integrity()
    taken += pool.get_new_blocks(1)  # only blocks in flight are left: wait for their copy
    assert taken[-1].block_id == 2 and tier.stats.num_offload_waits == 1
    assert events(scheduler) == [BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.HOST),
                                 BlockRemoved([HA[2]], Tier.DEVICE)]
    # Committed tail first (the tail leaves the host first); then the block that left the device
    # is the freshest on the host (its parents are still on the device too).
    assert tier.host_pool.cached_block_hashes() == [HA[1], HA[0], HA[2]]
    pool.free_blocks(taken)


def test_a_host_hit_loads_while_other_requests_step(manual):
    scheduler, tier, runner, copier = manual
    runner.run(make_request("a", PROMPT_A, max_tokens=1))
    runner.run(make_request("push", PUSHER, max_tokens=1))  # A goes down to the host
    assert set(HA[:3]) <= set(tier.host_pool.cached_block_hashes())
    scheduler.add_request(make_request("c", SHORT, max_tokens=3))  # 8 tokens: 2 blocks, no more
    a2 = make_request("a2", PROMPT_A, max_tokens=2)
    scheduler.add_request(a2)
    outputs: dict[str, list[int]] = {"c": [], "a2": []}
    for _ in range(3):
        sched, step_outputs = runner.step()
        for output in step_outputs:
            outputs[output.request_id] += output.new_token_ids
        assert [r.request_id for r in sched.scheduled] == ["c"]  # A2 waits for its load
        assert a2.status == RequestStatus.WAITING_FOR_HOST_KV
        check_scheduler(scheduler)
        tier.check_integrity()
    assert outputs["c"] == [100, 101, 102] and len(copier.queue) == 1
    copier.run()
    for _ in range(5):
        if not scheduler.has_unfinished_requests():
            break
        for output in runner.step()[1]:
            outputs[output.request_id] += output.new_token_ids
            assert output.num_cached_tokens == 12
    assert outputs["a2"] == [100, 101]  # the runner read A's loaded tokens back
    assert tier.counters.num_hit_blocks == 3 and tier.stats.num_load_jobs == 1


def test_an_abort_during_a_load_gives_the_blocks_back_once_it_lands(manual):
    scheduler, tier, runner, copier = manual
    pool = scheduler.kv_manager.block_pool
    runner.run(make_request("a", PROMPT_A, max_tokens=1))
    runner.run(make_request("push", PUSHER, max_tokens=1))
    scheduler.add_request(make_request("a2", PROMPT_A, max_tokens=2))
    scheduler.add_request(make_request("c", SHORT, max_tokens=3))
    runner.step()
    targets = scheduler.kv_manager.get_block_ids("a2")[:3]
    scheduler.abort_request("a2")
    assert scheduler.kv_manager.get_block_ids("a2") == []
    assert all(pool.blocks[b].ref_cnt == 1 for b in targets)  # held by the load in flight
    check_scheduler(scheduler)
    tier.check_integrity()
    for _ in range(5):  # c runs to the end, then the step waits for the load instead of spinning
        if not scheduler.has_unfinished_requests():
            break
        runner.step()
    assert not scheduler.has_unfinished_requests() and not copier.queue
    assert pool.num_free_blocks == pool.num_blocks and tier.host_pool.pinned_slots() == {}


def test_flush_walks_the_free_queue_again_only_when_it_or_the_host_pool_changed(manual, monkeypatch):
    scheduler, tier, runner, copier = manual
    pool = scheduler.kv_manager.block_pool
    walks = []
    walk = pool.offload_ahead
    monkeypatch.setattr(pool, "offload_ahead", lambda n: (walks.append(n), walk(n)))
    runner.run(make_request("a", PROMPT_A, max_tokens=1))
    events(scheduler)
    tier.attach(pool, num_ahead=8)
    walks.clear()
    tier.flush()
    assert len(walks) == 1 and len(copier.queue) == 1  # A's 3 cached blocks go down
    tier.flush()
    assert len(walks) == 1 and len(copier.queue) == 1  # nothing changed: no walk, no second copy
    copier.run()
    tier.flush()  # no walk, but the landed copy is booked
    assert len(walks) == 1
    for num_ahead in (6, 8):  # another span: walked again, though nothing else changed
        tier.attach(pool, num_ahead=num_ahead)
        tier.flush()
    assert walks == [8, 6, 8] and len(copier.queue) == 0
    del walks[1:]
    assert events(scheduler) == [BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.HOST)]
    # the host pool lets go of A's last block: the device's free copy needs a copy again
    tier.host_pool.discard(tier.host_pool.get(HA[2]))
    tier.flush()
    assert len(walks) == 2 and len(copier.queue) == 1
    copier.run()
    tier.flush()
    assert len(walks) == 2 and set(tier.host_pool.cached_block_hashes()) == set(HA[:3])
    # new cached blocks join the free queue: walked, and copied down
    runner.run(make_request("b", SHORT + PROMPT_A[:7], max_tokens=1))
    tier.flush()
    assert len(walks) >= 3 and len(copier.queue) == 1
    copier.run()
    tier.flush()
    assert set(hash_request_blocks(SHORT + PROMPT_A[:7], BS)) <= set(tier.host_pool.cached_block_hashes())


def test_clear_waits_for_the_copies_in_flight(manual):
    scheduler, tier, runner, copier = manual
    runner.run(make_request("a", PROMPT_A, max_tokens=1))
    events(scheduler)
    tier.attach(scheduler.kv_manager.block_pool, num_ahead=8)
    tier.flush()
    assert copier.queue
    tier.clear(emit=True)
    assert not copier.queue and tier.host_pool.num_cached_blocks == 0
    assert events(scheduler) == [BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.HOST),
                                 AllBlocksCleared(Tier.HOST)]


def test_the_background_thread_gives_the_outputs_of_inline_copies():
    outputs = {}
    for name, copier in [("inline", None), ("thread", BackgroundCopier())]:
        scheduler, tier = make_tier_scheduler(num_blocks=8, num_host_blocks=16, block_size=BS,
                                              copier=copier, num_ahead=0 if copier is None else 2)
        runner = TierRunner(scheduler, tier)
        outputs[name] = [runner.run(make_request(f"r{i}", prompt, max_tokens=3))
                         for i, prompt in enumerate([PROMPT_A, PUSHER, PROMPT_A, PUSHER, PROMPT_A])]
        tier.close()
        check_scheduler(scheduler)
        tier.check_integrity()
    assert outputs["thread"] == outputs["inline"]
    assert [num_cached for _, num_cached in outputs["inline"]] == [0, 0, 12, 28, 12]
