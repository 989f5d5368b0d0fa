"""Route decisions and prefix-index lookups of a served c=64 load (the raw file's served runs).

    cd <tree> && MODEL=<HF dir> ROOT=<tree> python docs/cpu/index_lookups_s16_route.py

`pdserve up --transfer grpc` on MODEL (a 2-layer random-weight Llama here), 16 warm-up
requests, then ROUNDS rounds of N distinct 196-token prompts x TOK tokens at CONC concurrent;
per round, from the router's /metrics: route decisions, index fallbacks by reason, answered
lookups with their mean time (queue included) and the index_lookup TTFT stage's mean.
"""

import asyncio
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.environ.get("ROOT", "."))
import aiohttp  # noqa: E402

from loadtests.cluster import running_cluster, stream_completion  # noqa: E402
from loadtests.prompts import distinct_prompts  # noqa: E402

MODEL = os.environ.get("MODEL", "/work/prof/tiny/model")
CONC, N, TOK = (int(os.environ.get(k, d)) for k, d in (("CONC", 64), ("N", 256), ("TOK", 64)))
ROUNDS = int(os.environ.get("ROUNDS", 2))
KEYS = ("pdserve_route_decisions_total", "pdserve_index_fallback_total", "pdserve_index_lookup_seconds_sum",
        "pdserve_index_lookup_seconds_count", 'pdserve_ttft_stage_seconds_sum{stage="index_lookup"',
        'pdserve_ttft_stage_seconds_count{stage="index_lookup"')


def scrape(url):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(KEYS))}


async def load(url, model, prompts):
    gate = asyncio.Semaphore(CONC)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONC)) as session:
        async def one(prompt):
            async with gate:
                return await stream_completion(session, url, model, prompt, max_tokens=TOK)
        return await asyncio.gather(*(one(p) for p in prompts))


def main():
    from engine.models.loader import load_model

    tokenizer = load_model(MODEL).tokenizer
    with running_cluster(["--model", MODEL, "--transfer", "grpc"]) as cluster:
        asyncio.run(load(cluster.http_url, cluster.model, distinct_prompts(tokenizer, 196, 16, salt=99)))
        for r in range(ROUNDS):
            before = scrape(cluster.http_url)
            started = time.perf_counter()
            prompts = distinct_prompts(tokenizer, 196, N, salt=7 + r)
            results = asyncio.run(load(cluster.http_url, cluster.model, prompts))
            wall = time.perf_counter() - started
            after = scrape(cluster.http_url)
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            tokens = sum(x.completion_tokens for x in results if x.ok)
            decisions = {re.search(r'path="([^"]+)",reason="([^"]+)"', k).group(0): int(v)
                         for k, v in d.items() if k.startswith(KEYS[0]) and v}
            fallbacks = {k.split("{")[1][:-1]: int(v) for k, v in d.items() if k.startswith(KEYS[1]) and v}
            n, s = d.get(KEYS[3], 0), d.get(KEYS[2], 0)
            stage_sum = next((v for k, v in d.items() if k.startswith(KEYS[4])), 0.0)
            stage_count = next((v for k, v in d.items() if k.startswith(KEYS[5])), 0.0)
            stage = stage_sum / stage_count * 1e3 if stage_count else float("nan")
            print(f"round {r}: {tokens / wall:.0f} tok/s failed {sum(not x.ok for x in results)}; "
                  f"decisions {decisions}; fallbacks {fallbacks}; lookups answered {int(n)} mean "
                  f"{s / max(n, 1) * 1e3:.2f} ms; index_lookup stage mean {stage:.2f} ms", flush=True)


main()
