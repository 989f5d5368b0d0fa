"""The kvstore's Prometheus metrics, read from ``BlockStore.stats()`` when scraped.

The kvstore is the lowest prefix-cache tier (``tier="kvstore"``): its lookups and hits are the
node-wide view of what workers could load from it. Names: ``pdserve_kvstore_*`` plus the
per-tier ``pdserve_kv_evictions_total{tier="kvstore"}`` of METRICS.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.kvstore.config import StoreStats

STATS_TIMEOUT_S = 2.0


def on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], StoreStats]) -> Callable[[], StoreStats]:
    """``read`` run on ``loop`` (the store is the event loop's alone; ``stats()`` expires leases)
    and waited for from the scrape thread, at most STATS_TIMEOUT_S."""
    async def read_async() -> StoreStats:
        return read()

    def read_from_scrape_thread() -> StoreStats:
        return asyncio.run_coroutine_threadsafe(read_async(), loop).result(STATS_TIMEOUT_S)

    return read_from_scrape_thread


class StoreCollector(Collector):
    """Samples of one store; ``read_stats`` is called once per scrape, on the scrape thread
    (wrap it with ``on_loop``)."""

    def __init__(self, read_stats: Callable[[], StoreStats]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.read_stats()
        counters = {
            "pdserve_kvstore_lookup_hit_blocks": ("Looked-up blocks the store held.", stats.num_hits),
            "pdserve_kvstore_lookup_miss_blocks": ("Looked-up blocks it did not hold.", stats.num_misses),
            "pdserve_kvstore_stored_blocks": ("Blocks stored.", stats.num_stored),
            "pdserve_kvstore_bytes_in": ("Block bytes written into the store.", stats.bytes_in),
            "pdserve_kvstore_bytes_out": ("Block bytes read from the store.", stats.bytes_out),
            "pdserve_kvstore_leases_granted": ("Read leases granted.", stats.num_leases_granted),
            "pdserve_kvstore_leases_expired": ("Read leases that ran out.", stats.num_leases_expired),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        evictions = CounterMetricFamily("pdserve_kv_evictions", "Blocks that left each tier to make room.",
                                        labels=("tier",))
        evictions.add_metric(["kvstore"], stats.num_evicted)
        yield evictions
        gauges = {
            "pdserve_kvstore_blocks": ("Blocks held now.", stats.num_blocks),
            "pdserve_kvstore_used_bytes": ("Bytes of the blocks held now.", stats.used_bytes),
            "pdserve_kvstore_capacity_bytes": ("Capacity in bytes.", stats.capacity_bytes),
            "pdserve_kvstore_live_leases": ("Read leases live now.", stats.num_leases),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
