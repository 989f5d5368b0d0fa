"""Golden cases of the router's plan (services/router/routing/route_plan.py) on recorded index states:
which decode worker, local or remote prefill, which prefill worker, and the reason."""

from __future__ import annotations

import pytest

from services.index.scripts import WorkerMatch
from services.router.routing.route_decisions import RouteDecisions
from services.router.routing.route_plan import RouteConfig, plan_route
from services.router.routing.worker_load import WorkerLoad

BS = 16


def load(name: str, free: int = 100, total: int = 100, running: int = 0, waiting: int = 0,
         prefill_tokens: int = 0) -> WorkerLoad:
    return WorkerLoad(address=f"127.0.0.1:{name}", num_free_blocks=free, num_total_blocks=total,
                      block_size=BS, num_running=running, num_waiting=waiting,
                      num_outstanding_prefill_tokens=prefill_tokens, worker_id=name)


def match(wid: str, device: int = 0, host: int = 0, kvstore: int = 0, role: str = "prefill",
          reserved: int = 0) -> WorkerMatch:
    return WorkerMatch(wid, device, host, kvstore, reserved, 0, 0, 0.0, role)


PREFILL = [load("p0"), load("p1")]
DECODE = [load("d0"), load("d1")]


def test_a_long_prompt_goes_to_the_prefill_worker_holding_its_prefix():
    # recorded: p1 holds 60 of the 64 blocks of a 1,024-token prompt on device
    matches = {"p1": match("p1", device=60), "p0": match("p0")}
    plan = plan_route(1024, BS, PREFILL, DECODE, matches)
    assert plan is not None
    assert (plan.path, plan.reason, plan.prefill_address) == ("remote", "prefix", "127.0.0.1:p1")
    assert plan.num_prefill_credit_tokens == 60 * BS
    assert plan.decode_address == "127.0.0.1:d0"  # no decode credit: the first of equal costs


def test_host_tier_credit_is_weighted_below_device():
    # p0: 40 blocks on host (credit 30), p1: 32 on device (credit 32): device wins
    matches = {"p0": match("p0", host=40), "p1": match("p1", device=32)}
    plan = plan_route(1024, BS, PREFILL, DECODE, matches)
    assert plan.prefill_address == "127.0.0.1:p1"
    # 48 host blocks (credit 36) beat 32 device blocks
    matches = {"p0": match("p0", host=48), "p1": match("p1", device=32)}
    assert plan_route(1024, BS, PREFILL, DECODE, matches).prefill_address == "127.0.0.1:p0"


def test_a_short_uncached_part_on_the_decode_worker_runs_locally():
    # d1 holds 62 of 64 blocks: 32 tokens uncached <= 64
    matches = {"d1": match("d1", device=62, role="decode"), "p0": match("p0", device=64)}
    plan = plan_route(1024, BS, PREFILL, DECODE, matches)
    assert (plan.path, plan.reason, plan.decode_address, plan.prefill_address) == (
        "local", "short_uncached", "127.0.0.1:d1", None)
    assert plan.num_decode_cached_tokens == 62 * BS


def test_a_short_prompt_runs_locally_even_without_the_index():
    plan = plan_route(40, BS, PREFILL, DECODE, None)
    assert (plan.path, plan.reason) == ("local", "short_uncached")
    assert plan_route(40, BS, PREFILL, DECODE, None, RouteConfig(local_prefill_max_tokens=0)).path == "remote"


def test_decode_holding_most_of_the_prompt_with_headroom_runs_locally():
    matches = {"d0": match("d0", device=52, role="decode")}  # 832 of 1,024 tokens (81 %)
    plan = plan_route(1024, BS, PREFILL, DECODE, matches)
    assert (plan.path, plan.reason, plan.decode_address) == ("local", "decode_holds_prefix",
                                                             "127.0.0.1:d0")
    # no headroom (12 blocks needed, 14 free of 100: less than 10 % left after) -> remote
    tight = [load("d0", free=14), load("d1", free=14)]
    plan = plan_route(1024, BS, PREFILL, tight, matches)
    assert (plan.path, plan.decode_address) == ("remote", "127.0.0.1:d0")
    # busy with queued prefill -> remote
    busy = [load("d0", prefill_tokens=4096), load("d1")]
    assert plan_route(1024, BS, PREFILL, busy, matches).path == "remote"


def test_a_decode_worker_busy_with_prefills_sends_even_a_short_suffix_remote():
    # d1 holds 62 of 64 blocks (32 tokens uncached) but has 3,000 prompt tokens queued; p0 holds
    # the whole prompt and is idle: waiting behind d1's queue is slower than p0's cache hit.
    busy = [load("d0", prefill_tokens=3000), load("d1", prefill_tokens=3000)]
    matches = {"d1": match("d1", device=62, role="decode"), "p0": match("p0", device=64)}
    plan = plan_route(1024, BS, PREFILL, busy, matches)
    assert (plan.path, plan.decode_address, plan.prefill_address) == (
        "remote", "127.0.0.1:d1", "127.0.0.1:p0")
    # no prefill worker holds anything: 32 + 3,000 queued tokens locally against an idle cold
    # 1,024-token prefill -> still remote; with 3,000 tokens queued on each prefill worker too,
    # the local suffix wins
    matches = {"d1": match("d1", device=62, role="decode")}
    assert plan_route(1024, BS, PREFILL, busy, matches).path == "remote"
    loaded = [load("p0", prefill_tokens=3000), load("p1", prefill_tokens=3000)]
    plan = plan_route(1024, BS, loaded, busy, matches)
    assert (plan.path, plan.reason, plan.decode_address) == ("local", "short_uncached", "127.0.0.1:d1")


def test_a_predicted_prefix_steers_the_decode_pick_but_never_the_local_path():
    # this router just sent the prompt's 62 blocks to d1 (RecentDecisions), the index has no
    # record yet: the KV may still be computing or in transfer, so d1 must not recompute it
    from services.router.routing.prefix_scoring import Candidate

    predicted = [Candidate("d0"), Candidate("d1", num_device_blocks=62)]
    plan = plan_route(1024, BS, PREFILL, DECODE, {}, decode_candidates=predicted)
    assert (plan.path, plan.decode_address) == ("remote", "127.0.0.1:d1")
    assert plan.num_decode_cached_tokens == 62 * BS  # the transfer skips what d1 will hold
    # once the index confirms it, the suffix runs locally
    plan = plan_route(1024, BS, PREFILL, DECODE, {"d1": match("d1", device=62, role="decode")},
                      decode_candidates=predicted)
    assert (plan.path, plan.reason, plan.decode_address) == ("local", "short_uncached", "127.0.0.1:d1")


def test_index_down_routes_by_load_and_says_so():
    prefill = [load("p0", prefill_tokens=900), load("p1", prefill_tokens=100)]
    plan = plan_route(1024, BS, prefill, DECODE, None)
    assert (plan.path, plan.reason, plan.prefill_address) == ("remote", "index_unavailable",
                                                              "127.0.0.1:p1")


def test_the_imbalance_guard_spreads_a_hot_prefix():
    # p0 holds the whole prompt but has 9,000 prompt tokens queued; p1 is idle
    prefill = [load("p0", prefill_tokens=9000), load("p1")]
    matches = {"p0": match("p0", device=64)}
    plan = plan_route(1024, BS, prefill, DECODE, matches)
    assert (plan.reason, plan.prefill_address) == ("imbalance", "127.0.0.1:p1")


def test_other_routers_reservations_count_as_queued_requests():
    from services.router.routing.route_plan import prefill_candidate

    candidates = [prefill_candidate(PREFILL[0], None, extra_requests=50),
                  prefill_candidate(PREFILL[1], None)]
    plan = plan_route(1024, BS, PREFILL, DECODE, {}, decode_candidates=None,
                      prefill_candidates=candidates)
    assert plan.prefill_address == "127.0.0.1:p1"


def test_a_decode_worker_without_room_is_skipped():
    decode = [load("d0", free=10), load("d1", free=90)]
    matches = {"d0": match("d0", device=30, role="decode")}
    plan = plan_route(1024, BS, PREFILL, decode, matches)
    assert plan.decode_address == "127.0.0.1:d1"


def test_a_prefill_worker_without_room_for_the_prompt_is_skipped():
    # p0 holds 30 of the 64 blocks but has 10 free: the other 34 would preempt what it runs
    prefill = [load("p0", free=10), load("p1", free=90)]
    matches = {"p0": match("p0", device=30)}
    plan = plan_route(1024, BS, prefill, DECODE, matches)
    assert (plan.path, plan.prefill_address) == ("remote", "127.0.0.1:p1")
    # with 34 free it fits (its 30 cached blocks are reused): the credit wins again
    prefill = [load("p0", free=34), load("p1", free=90)]
    assert plan_route(1024, BS, prefill, DECODE, matches).prefill_address == "127.0.0.1:p0"
    # no prefill worker has room: all are candidates, the cheapest is picked
    prefill = [load("p0", free=10), load("p1", free=5)]
    assert plan_route(1024, BS, prefill, DECODE, matches).prefill_address == "127.0.0.1:p0"


def test_no_workers_no_plan_and_bad_config_is_refused():
    assert plan_route(100, BS, PREFILL, [], None) is None
    assert plan_route(1024, BS, [], DECODE, None) is None  # remote needed, no prefill worker
    with pytest.raises(ValueError, match="local prefill limits"):
        RouteConfig(local_prefill_max_tokens=-1)
    with pytest.raises(ValueError, match="local_hold_fraction"):
        RouteConfig(local_hold_fraction=0.0)


def test_route_decisions_count_and_latency_quantiles():
    decisions = RouteDecisions(max_samples=3)
    for i, key in enumerate(["remote/prefix", "local/short_uncached", "remote/prefix", "remote/load"]):
        decisions.record(key, 0.001 * (i + 1))
    assert decisions.snapshot() == {"remote/prefix": 2, "local/short_uncached": 1, "remote/load": 1}
    assert len(decisions.latencies_s) == 3
    assert decisions.latency_quantile_s(0.99) == pytest.approx(0.004)
    with pytest.raises(ValueError, match="quantile"):
        decisions.latency_quantile_s(1.5)
