"""Golden cases of the KV-aware cost on recorded index states (block size 16, an 80-token prompt
= 5 blocks), the imbalance guard, and the router-local memory of recent decisions."""

from __future__ import annotations

import pytest

from engine.kv_cache.hashing import hash_request_blocks
from services.router.routing.prefix_scoring import (
    Candidate,
    Decision,
    PrefixScoringConfig,
    RecentDecisions,
    choose_worker,
    is_imbalanced,
)

BS, L = 16, 80
CONFIG = PrefixScoringConfig()


def pick(*candidates: Candidate) -> Decision | None:
    return choose_worker(candidates, BS, L, CONFIG)


@pytest.mark.parametrize(("state", "expected"), [
    # idle workers: the one holding 4 of 5 blocks on device computes 16 tokens
    ([Candidate("a", num_device_blocks=4), Candidate("b")], Decision("a", 16.0, 64.0, "prefix")),
    # its prefix does not pay for 200 queued prompt tokens
    ([Candidate("a", 4, num_queued_prefill_tokens=200), Candidate("b")], Decision("b", 80.0, 0.0, "load")),
    # host blocks earn 0.75: 4 host (48 tokens) beat 2 device (32 tokens)
    ([Candidate("a", 2), Candidate("b", 0, 4)], Decision("b", 32.0, 48.0, "prefix")),
    # kvstore blocks earn 0.5
    ([Candidate("a", 0, 0, 5), Candidate("b", 2)], Decision("a", 40.0, 40.0, "prefix")),
    # a queued request costs one block; decode load counts in tokens
    ([Candidate("a", 1, num_queued_requests=2), Candidate("b", 1, num_decode_tokens=20)],
     Decision("b", 84.0, 16.0, "prefix")),
    # no prefix anywhere: least loaded
    ([Candidate("a", num_decode_tokens=30), Candidate("b", num_decode_tokens=10)],
     Decision("b", 90.0, 0.0, "load")),
    # equal costs: the first listed
    ([Candidate("a", 2), Candidate("b", 2)], Decision("a", 48.0, 32.0, "prefix")),
    # a full match credits at most the prompt
    ([Candidate("a", 9)], Decision("a", 0.0, 80.0, "prefix")),
])
def test_golden_decisions(state, expected):
    assert pick(*state) == expected


def test_imbalance_guard_routes_by_load_only():
    hot = Candidate("a", num_device_blocks=5, num_decode_tokens=2000)
    cold = Candidate("b", num_decode_tokens=100)
    assert pick(hot, cold) == Decision("b", 180.0, 0.0, "imbalance")
    # under the absolute threshold (64 blocks of load apart) credits count
    assert pick(Candidate("a", 5, num_decode_tokens=50), Candidate("b")) == Decision("a", 50.0, 80.0, "prefix")
    # the guard needs both: more than 64 blocks of load apart and more than 1.5x
    assert not is_imbalanced([Candidate("a", num_decode_tokens=4000),
                              Candidate("b", num_decode_tokens=2900)], CONFIG)
    assert not is_imbalanced([Candidate("a", num_decode_tokens=1000), Candidate("b")], CONFIG)
    assert is_imbalanced([Candidate("a", num_decode_tokens=1100), Candidate("b")], CONFIG)


def test_empty_and_bad_input():
    assert choose_worker([], BS, L) is None
    with pytest.raises(ValueError, match="block_size"):
        choose_worker([Candidate("a")], 0, L)
    with pytest.raises(ValueError, match="tier credits"):
        PrefixScoringConfig(host_credit=1.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_recent_decisions_make_a_burst_stick_until_they_expire():
    clock = Clock()
    memory = RecentDecisions(ttl_s=2.0, max_entries=100, clock=clock)
    hashes = hash_request_blocks(list(range(L)), BS)
    empty_index = [Candidate("a"), Candidate("b")]
    assert choose_worker(memory.with_predictions(empty_index, hashes), BS, L).worker_id == "a"
    memory.record(hashes, "b")  # this router sent the first request of the burst to b
    assert memory.num_predicted_blocks(hashes, "b") == 5
    decision = choose_worker(memory.with_predictions(empty_index, hashes), BS, L)
    assert (decision.worker_id, decision.reason) == ("b", "prefix")
    clock.now = 2.5
    assert memory.num_predicted_blocks(hashes, "b") == 0


def test_recent_decisions_are_bounded_oldest_first():
    memory = RecentDecisions(ttl_s=60.0, max_entries=3, clock=Clock())
    hashes = hash_request_blocks(list(range(L)), BS)
    memory.record(hashes, "a")
    assert len(memory) == 3
    assert memory.num_predicted_blocks(hashes, "a") == 0  # the leading blocks were dropped
    assert memory.num_predicted_blocks(hashes[2:], "a") == 3
