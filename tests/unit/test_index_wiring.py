"""The index's plumbing without Redis: engine events -> ops, a pool's holdings equal the fold of
its events (what a snapshot sends), and ``pdserve up`` handing ``--redis-url`` to every child."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import Role
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import hash_request_blocks
from services.index.ops import events_to_ops

H = hash_request_blocks(list(range(80)), 4)  # twenty chained hashes


def test_events_become_ops_per_block_and_tier():
    events = [BlockStored(H[:2], None, list(range(8)), 4), BlockRemoved(H[:1], Tier.HOST),
              AllBlocksCleared(Tier.KVSTORE), AllBlocksCleared()]
    assert events_to_ops(events) == [("S", H[0].hex(), 1), ("S", H[1].hex(), 1),
                                     ("R", H[0].hex(), 2), ("C", "", 4), ("C", "", 7)]
    with pytest.raises(TypeError, match="not a KV cache event"):
        events_to_ops(["stored"])  # type: ignore[list-item]


def fold(events, held: set) -> set:
    for event in events:
        if isinstance(event, BlockStored):
            held |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held -= set(event.block_hashes)
        else:
            held.clear()
    return held


def test_pool_holdings_equal_the_fold_of_its_events():
    pool, held, rng = BlockPool(6), set(), random.Random(0)
    for _ in range(200):
        action = rng.random()
        if action < 0.6 and pool.num_free_blocks:
            (block,) = pool.get_new_blocks(1)  # may evict a cached block: BlockRemoved
            pool.cache_full_block(block, rng.choice(H), None, [0] * 4)  # False: hash already held
            pool.free_blocks([block])
        elif action < 0.95:
            pool.get_new_blocks(pool.num_free_blocks)
            pool.free_blocks([b for b in pool.blocks for _ in range(b.ref_cnt)])
        else:
            pool.reset_prefix_cache()
        held = fold(pool.take_events(), held)
        assert set(pool.cached_block_hashes()) == held
    pool.check_integrity()


def test_up_gives_the_redis_url_to_every_worker_and_the_router(tmp_path, monkeypatch):
    from services import launcher
    from services.router.__main__ import parse_args as router_args
    from services.worker.settings import worker_parser

    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://127.0.0.1:7/0")
    args = launcher.build_parser().parse_args(["--transfer", "grpc"])
    workers, router = launcher.plan(args, tmp_path)
    for worker in workers:
        serve = worker.argv.index("serve")
        role, flags = worker.argv[serve + 1], worker.argv[serve + 2:]
        assert worker_parser(Role(role), 0).parse_args(flags).redis_url == "redis://127.0.0.1:7/0"
    monkeypatch.delenv("PDSERVE_REDIS_URL")
    flags = router.argv[router.argv.index("router") + 1:]
    assert router_args(flags).redis_url == "redis://127.0.0.1:7/0"


def test_without_a_url_nothing_is_passed(tmp_path, monkeypatch):
    from services import launcher

    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    workers, router = launcher.plan(launcher.build_parser().parse_args([]), tmp_path)
    assert all("--redis-url" not in child.argv for child in [*workers, router])


def test_the_index_and_the_scoring_are_torch_free():
    import subprocess
    import sys

    code = ("import sys, services.index.client, services.index.publisher, services.index.redis_server, "
            "services.router.routing.prefix_scoring; assert 'torch' not in sys.modules, 'torch imported'")
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=repo)


def test_the_router_gives_its_index_lookups_the_budget_it_is_told(monkeypatch):
    from engine.args import EngineArgs
    from services.router.__main__ import parse_args as router_args
    from services.router.app import build_backend
    from services.router.routing.prefix_aware import ROUTER_CLIENT_CONFIG

    workers = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--redis-url", "redis://127.0.0.1:7/0"]
    assert router_args(workers).index_budget_ms == 5.0
    monkeypatch.setenv("PDSERVE_INDEX_BUDGET_MS", "40")
    assert router_args(workers).index_budget_ms == 40.0
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            router_args([*workers, "--index-budget-ms", bad])
    backend = build_backend(False, None, EngineArgs(), ["127.0.0.1:1"], ["127.0.0.1:2"], "grpc",
                            redis_url="redis://127.0.0.1:7/0", index_budget_s=0.04)
    policy = backend.policy  # type: ignore[attr-defined]
    assert policy.client_config.budget_s == 0.04
    assert policy.client_config.breaker == ROUTER_CLIENT_CONFIG.breaker
    default = build_backend(False, None, EngineArgs(), ["127.0.0.1:1"], ["127.0.0.1:2"], "grpc",
                            redis_url="redis://127.0.0.1:7/0")
    assert default.policy.client_config == ROUTER_CLIENT_CONFIG  # type: ignore[attr-defined]
