"""The router's prefix-index lookups in bursts: batched (one round trip for what queued) against
one round trip per lookup, in one run.

    python -m loadtests.bench_index_lookups [--bursts 20] [--burst 64] [--busy 0] [--json PATH]

An embedded redis-server holds 2 prefill + 2 decode workers, each with 4,096 blocks; a
``PrefixAwarePolicy`` in this process plans ``--burst`` requests at once (a closed-loop load's
requests finish together and come back together), ``--bursts`` times, alternating batched
(``INDEX_BATCH``: lookups, and reservation writes) and unbatched (batches of 1, the baseline)
burst by burst. Prompts are 196 tokens (12 blocks of 16); half of them are
held by a worker. Reported per mode: a burst's wall time and each lookup's wait (queue included)
p50/p99, lookups that fell back to load-only routing, and redis-server's CPU time per request
(``INFO commandstats``: its scripts, the lookup and its two reservations and releases, batched
alike).
``--busy N`` runs N busy-looping processes beside it (bounded by the run), as a host whose cores
are all taken: a 2-core VM serving a load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_transfer.base import KVCompat
from engine.sampling_params import SamplingParams
from services.index.redis_server import EmbeddedRedis
from services.index.schema import IndexMeta, WorkerInfo
from services.index.scripts import IndexScripts
from services.router.routing.prefix_aware import INDEX_BATCH, PrefixAwarePolicy
from services.router.routing.route_plan import RouteConfig
from services.router.routing.worker_load import WorkerLoad

BLOCK = 16
COMPAT = KVCompat("bench", "bfloat16", BLOCK, 24, 32, 64)
META = IndexMeta(COMPAT.model_name, COMPAT.hash, BLOCK)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
WORKERS = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def busy(until: float) -> None:
    while time.time() < until:
        pass


def populate(url: str, prompts: list[list[int]]) -> None:
    """Every worker registered; each holds 4,096 blocks, among them the prefixes of half the prompts."""
    scripts = IndexScripts(redis.Redis.from_url(url), META)
    rng = random.Random(3)
    for n, (wid, role) in enumerate(WORKERS.items()):
        scripts.register(WorkerInfo(wid, role), "e1", 3_600_000)
        held = [h.hex() for prompt in prompts[n::8] for h in hash_request_blocks(prompt, BLOCK)]
        held += [f"{rng.getrandbits(128):032x}" for _ in range(4096 - len(held))]
        for start in range(0, len(held), 512):
            scripts.apply(wid, "e1", start + 1, [("S", h, 1) for h in held[start:start + 512]])
    scripts.client.close()


async def burst(policy: PrefixAwarePolicy, prompts: list[list[int]], tag: str) -> tuple[float, list[float], int]:
    loads = [WorkerLoad(address=f"127.0.0.1:{w}", num_free_blocks=1000, num_total_blocks=1000,
                        block_size=BLOCK, worker_id=w) for w in WORKERS]
    prefill, decode = loads[:2], loads[2:]
    waits: list[float] = []

    async def one(i: int, prompt: list[int]) -> bool:
        started = time.perf_counter()
        plan = await policy.plan(f"{tag}-{i}", prompt, GREEDY, prefill, decode)
        waits.append(time.perf_counter() - started)
        return plan is not None and plan.reason == "index_unavailable"

    started = time.perf_counter()
    fell_back = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    for i in range(len(prompts)):
        policy.finish(f"{tag}-{i}")
    return wall, waits, sum(fell_back)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(196)] for _ in range(args.burst * 4)]
    result: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis.start() as server:
        populate(server.url, prompts)
        stats = redis.Redis.from_url(server.url)
        helpers = [multiprocessing.Process(target=busy, args=(time.time() + 600,), daemon=True)
                   for _ in range(args.busy)]
        for helper in helpers:
            helper.start()
        try:
            policies = {}
            for mode, size in (("batched", INDEX_BATCH), ("unbatched", 1)):
                policies[mode] = PrefixAwarePolicy(server.url, RouteConfig(local_prefill_max_tokens=0),
                                                   index_batch=size)
                policies[mode].configure(COMPAT)
                result[mode] = dict(walls=[], waits=[], fell_back=0, script_us=0.0, lookups=0)
            for b in range(args.bursts):
                for mode in (("batched", "unbatched") if b % 2 == 0 else ("unbatched", "batched")):
                    chosen = prompts[(b % 4) * args.burst:(b % 4 + 1) * args.burst]
                    stats.config_resetstat()
                    wall, waits, fell_back = asyncio.run(burst(policies[mode], chosen, f"{mode}{b}"))
                    policies[mode].flush(30.0)  # its reservations and releases too
                    script = stats.info("commandstats").get("cmdstat_evalsha", {})
                    r = result[mode]
                    r["walls"].append(wall)
                    r["waits"] += waits
                    r["fell_back"] += fell_back
                    r["script_us"] += script.get("usec", 0)
                    r["lookups"] += len(chosen)
            for policy in policies.values():
                policy.close()
        finally:
            for helper in helpers:
                helper.terminate()
        stats.close()
    print(f"{args.bursts} bursts of {args.burst} plans per mode, alternated; {args.busy} busy processes beside")
    print(f"{'mode':10} {'burst p50 ms':>12} {'wait p50 ms':>11} {'wait p99 ms':>11} {'fell back':>9} "
          f"{'redis us/request':>16}")
    summary = {}
    for mode, r in result.items():
        summary[mode] = dict(burst_p50_ms=statistics.median(r["walls"]) * 1e3, wait_p50_ms=pct(r["waits"], 0.5) * 1e3,
                             wait_p99_ms=pct(r["waits"], 0.99) * 1e3, fell_back=r["fell_back"], lookups=r["lookups"],
                             redis_us_per_request=r["script_us"] / r["lookups"])
        s = summary[mode]
        print(f"{mode:10} {s['burst_p50_ms']:12.2f} {s['wait_p50_ms']:11.2f} {s['wait_p99_ms']:11.2f} "
              f"{r['fell_back']:>5}/{r['lookups']:<4} {s['redis_us_per_request']:16.1f}")
    b, u = summary["batched"], summary["unbatched"]
    print(f"batched vs unbatched: burst {b['burst_p50_ms'] / u['burst_p50_ms']:.2f}x the time, "
          f"redis {b['redis_us_per_request'] / max(u['redis_us_per_request'], 1e-9):.2f}x the CPU per request")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
