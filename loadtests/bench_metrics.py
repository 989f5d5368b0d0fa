"""What worker metrics cost: decode throughput with metrics on vs off, interleaved in one run.

    python -m loadtests.bench_metrics [--streams 8] [--max-tokens 64] [--rounds 6] [--num-threads 1]

One AsyncEngine (COLOCATED role, the embedded model) serves ``--streams`` concurrent greedy
requests (``ignore_eos``) per round, the way a worker's handler drives it. Rounds alternate
off / on. "on" is what a worker with ``--metrics-port`` does: a ``RequestTimer`` per request
(``on_scheduled``, ``on_output`` per engine output, ``on_finished``) on the request histograms,
plus a scraper thread rendering the whole registry (EngineCollector included) every
``--scrape-interval-s`` (default 0.25 s, 60x more often than a 15 s Prometheus scrape). "off" is
``WorkerMetrics.disabled()``: NullRequestTimer, no scrapes. Prints the generated tokens/s of
each round, the median of each mode and the ratio on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from services.common.async_engine import AsyncEngine
from services.common.metrics import render
from services.worker.request_timer import WorkerMetrics


async def one_round(engine: AsyncEngine, metrics: WorkerMetrics, num_streams: int, max_tokens: int,
                    round_id: int) -> float:
    """Generated tokens per second of ``num_streams`` concurrent requests."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def stream(i: int) -> int:
        timer = metrics.request()
        prompt = [100 + (i * 37 + j) % 800 for j in range(24)]
        num_tokens = 0
        timer.on_scheduled()
        async for output in engine.generate(f"r{round_id}-{i}", prompt, params):
            timer.on_output(len(output.new_token_ids))
            num_tokens += len(output.new_token_ids)
            if output.finished:
                timer.on_finished(output.finish_reason, len(prompt))
        return num_tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(stream(i) for i in range(num_streams)))
    return sum(counts) / (time.perf_counter() - started)


def scraper(metrics: WorkerMetrics, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        render(metrics.registry)


async def main(args: argparse.Namespace) -> None:
    from engine.models.loader import load_model

    engine = AsyncEngine()

    def make_core() -> EngineCore:
        import torch

        torch.set_num_threads(args.num_threads)
        loaded = load_model(None)
        config = EngineArgs(num_kv_blocks=256).build(loaded.config, Role.COLOCATED)
        return EngineCore(config, loaded)

    core = await engine.build(make_core)
    on = WorkerMetrics.create(engine, core.config.model.name, "bench", "colocated")
    off = WorkerMetrics.disabled()
    await one_round(engine, off, args.streams, 8, -1)  # warm-up
    results: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds * 2):
        mode = "off" if r % 2 == 0 else "on"
        stop = threading.Event()
        thread = threading.Thread(target=scraper, args=(on, args.scrape_interval_s, stop), daemon=True)
        if mode == "on":
            thread.start()
        tps = await one_round(engine, on if mode == "on" else off, args.streams, args.max_tokens, r)
        stop.set()
        if mode == "on":
            thread.join()
        results[mode].append(tps)
        print(f"round {r:2d} metrics {mode:3s}: {tps:7.1f} generated tokens/s", flush=True)
    engine.stop()
    med = {mode: statistics.median(v) for mode, v in results.items()}
    print(f"median off {med['off']:.1f} tok/s, on {med['on']:.1f} tok/s, on/off = {med['on'] / med['off']:.3f} "
          f"(load average {os.getloadavg()[0]:.1f})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode (alternating)")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--scrape-interval-s", type=float, default=0.25)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
