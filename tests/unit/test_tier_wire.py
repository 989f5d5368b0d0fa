"""EngineStats.tiers on the wire (services/common/wire.py <-> worker.proto WorkerStats.tiers)."""

from __future__ import annotations

import pytest

from engine.kv_cache.events import Tier
from engine.stats import TierCounters, TierStats
from services.common.pb import worker_pb2
from services.common.wire import tier_stats_from_proto, tier_stats_to_proto


def test_every_tier_round_trips_through_worker_stats():
    tiers = (TierStats.of(Tier.DEVICE, 64, 12, 40, 28, TierCounters(30, 10, 160, 0, 0, 0)),
             TierStats.of(Tier.HOST, 512, 28, 28, 0, TierCounters(20, 6, 96, 1, 6 * 737280, 28 * 737280)),
             TierStats.of(Tier.KVSTORE, 0, 0, 9, 0, TierCounters(14, 5, 80, 2, 5 * 737280, 9 * 737280)))
    wire = worker_pb2.WorkerStats(worker_id="decode-0", tiers=tier_stats_to_proto(tiers))
    parsed = worker_pb2.WorkerStats.FromString(wire.SerializeToString())
    assert [t.tier for t in parsed.tiers] == [worker_pb2.CACHE_TIER_DEVICE, worker_pb2.CACHE_TIER_HOST,
                                              worker_pb2.CACHE_TIER_KVSTORE]
    assert tuple(tier_stats_from_proto(parsed.tiers)) == tiers
    assert tier_stats_from_proto(parsed.tiers)[2].num_miss_blocks == 9


@pytest.mark.parametrize("bad", [0, 3, 8])
def test_an_unknown_tier_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=f"tier.*{bad}"):
        tier_stats_from_proto([worker_pb2.TierStats(tier=bad)])
