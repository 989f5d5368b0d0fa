"""KV-aware versus load-only routing on a multi-tenant workload, in one run.

    pdserve bench routing [--requests 64] [--rate 0.4] [--num-kv-blocks 320]
                          [--prefill-kv-blocks N] [--decode-kv-blocks N] [--cpu-offload-gb GIB]
                          [--rounds 1] [--json PATH]

Starts an embedded redis-server and 2 prefill + 2 decode workers (``--transfer grpc``, one
thread each, all publishing to the prefix index), warms every worker up with a few requests
(first-request costs: allocation, lazy init), then drives the same workload through the router's
backend, in this process: with ``PrefixAwarePolicy`` (KV-aware, conditional disaggregation on)
and with the load policy, ``--rounds`` times each in ABBA order (kv, load, load, kv, ...) so
neither mode always runs first. Each phase uses its own ``cache_salt``, so no phase reuses
another's cached blocks (each starts cold on the same workers); a mode's rounds are pooled.

Workload: 8 tenants, each with a ~1,000-token system prompt; each request is one tenant's
system prompt plus a short user turn (20-60 tokens), greedy, 4 new tokens; Poisson arrivals at
``--rate`` per second, ``--requests`` per phase, the same seeded sequence in both phases.
Reports per phase: prefix hit rate (cached prompt tokens / prompt tokens, as the workers
report them with the first token), TTFT p50/p99 (request sent -> first token event), failures,
the route decisions, the slowest requests with their TTFT stages (where the time went), and
for KV-aware the router's added latency per request (hashing, the index lookup and scoring:
``RouteDecisions``) p50/p99, under the workload and "solo" (200 plans in a row before it,
nothing else running in this process). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.sampling_params import SamplingParams
from loadtests.cluster import free_port
from services.common.health import SERVING, check_health
from services.index.redis_server import EmbeddedRedis
from services.router.backends.disaggregated import DisaggregatedBackend
from services.router.routing.prefix_aware import PrefixAwarePolicy

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
NUM_TENANTS = 8
SYSTEM_TOKENS = 1000


@dataclass
class PhaseResult:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    routes: dict[str, int] = field(default_factory=dict)
    decision_p50_ms: float = 0.0
    decision_p99_ms: float = 0.0
    solo_p50_ms: float = 0.0
    solo_p99_ms: float = 0.0
    wall_s: float = 0.0
    records: list[dict] = field(default_factory=list)  # per request: route, TTFT, cache, stages

    def merge(self, other: PhaseResult) -> None:
        """Pool another round of the same mode into this one (decision times: the worse)."""
        self.ttft_s += other.ttft_s
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.failures += other.failures
        for key, count in other.routes.items():
            self.routes[key] = self.routes.get(key, 0) + count
        self.decision_p50_ms = max(self.decision_p50_ms, other.decision_p50_ms)
        self.decision_p99_ms = max(self.decision_p99_ms, other.decision_p99_ms)
        self.wall_s += other.wall_s
        self.records += other.records

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def tenant_prompt(tenant: int) -> list[int]:
    rng = random.Random(1000 + tenant)
    return [rng.randrange(1000, 41000) for _ in range(SYSTEM_TOKENS)]


def workload(num_requests: int, rate: float, seed: int = 7) -> list[tuple[float, list[int]]]:
    """[(arrival offset s, prompt token ids)]: Poisson arrivals, a random tenant each."""
    rng = random.Random(seed)
    systems = [tenant_prompt(t) for t in range(NUM_TENANTS)]
    at, out = 0.0, []
    for _ in range(num_requests):
        at += rng.expovariate(rate)
        user = [rng.randrange(1000, 41000) for _ in range(rng.randint(20, 60))]
        out.append((at, systems[rng.randrange(NUM_TENANTS)] + user))
    return out


def start_workers(redis_url: str, log_dir: Path, blocks: dict[str, int],
                  cpu_offload_gb: float | None = None) -> list[tuple[subprocess.Popen, str]]:
    """2 prefill then 2 decode workers; ``blocks``: KV blocks per worker of each role;
    ``cpu_offload_gb``: each one's host tier (None: the workers' default, sized from free memory)."""
    host_tier = [] if cpu_offload_gb is None else ["--cpu-offload-gb", str(cpu_offload_gb)]
    procs = []
    for role in ("prefill", "prefill", "decode", "decode"):
        num_blocks = blocks[role]
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", "serve", role, "--port", str(port),
                "--worker-id", f"{role}-{port}", "--transfer", "grpc", "--num-threads", "1",
                "--num-kv-blocks", str(num_blocks), "--redis-url", redis_url,
                "--index-heartbeat-s", "1", "--drain-grace-s", "2", *host_tier]
        with open(log_dir / f"{role}-{port}.log", "wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, f"127.0.0.1:{port}"))
    return procs


async def wait_serving(procs: list[tuple[subprocess.Popen, str]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = {address for _, address in procs}
    while pending and time.monotonic() < deadline:
        for proc, address in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {address} exited with {proc.returncode}")
            if address in pending:
                try:
                    if await check_health(address, timeout_s=1.0) == SERVING:
                        pending.discard(address)
                except Exception:  # noqa: BLE001 - not up yet
                    pass
        await asyncio.sleep(0.5)
    if pending:
        raise TimeoutError(f"workers not SERVING after {START_TIMEOUT_S} s: {sorted(pending)}")


async def solo_decisions(backend: DisaggregatedBackend, requests: list[tuple[float, list[int]]],
                         num: int = 200) -> list[float]:
    """Decision times (s) of ``num`` plans in a row with nothing else running in this process:
    the router's own cost, apart from the workload's contention. Counts are reset after."""
    policy = backend.policy
    assert isinstance(policy, PrefixAwarePolicy)
    params = SamplingParams(temperature=0.0, max_tokens=4, cache_salt="bench-solo")
    times = []
    for i in range(num):
        prompt = requests[i % len(requests)][1]
        loads = {r: [w.load() for w in backend.pool.healthy(r)] for r in ("prefill", "decode")}
        started = time.perf_counter()
        await policy.plan(f"solo-{i}", prompt, params, loads["prefill"], loads["decode"])
        times.append(time.perf_counter() - started)
        policy.finish(f"solo-{i}")
    backend.route_decisions.counts.clear()
    backend.route_decisions.latencies_s.clear()
    return times


async def run_phase(backend: DisaggregatedBackend, requests: list[tuple[float, list[int]]],
                    salt: str) -> PhaseResult:
    result = PhaseResult()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)

    async def one(i: int, prompt: list[int]) -> None:
        sent = time.perf_counter()
        first = True
        try:
            async def consume() -> None:
                nonlocal first
                async for event in backend.generate(f"{salt}-{i}", prompt, params):
                    if first:
                        ttft = time.perf_counter() - sent
                        result.ttft_s.append(ttft)
                        result.prompt_tokens += len(prompt)
                        result.cached_tokens += event.num_cached_tokens
                        result.records.append({
                            "request": i, "sent_s": sent - started, "ttft_ms": ttft * 1e3,
                            "route": event.route, "prompt_tokens": len(prompt),
                            "cached_tokens": event.num_cached_tokens,
                            "stages_ms": {k: v * 1e3 for k, v in (event.ttft_stages or {}).items()}})
                        first = False
            await asyncio.wait_for(consume(), REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            result.failures.append(f"{i}: {exc!r}")

    started = time.perf_counter()
    tasks = []
    for i, (at, prompt) in enumerate(requests):
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(i, prompt)))
    await asyncio.gather(*tasks)
    result.wall_s = time.perf_counter() - started
    decisions = backend.route_decisions
    result.routes = decisions.snapshot()
    result.decision_p50_ms = decisions.latency_quantile_s(0.5) * 1e3
    result.decision_p99_ms = decisions.latency_quantile_s(0.99) * 1e3
    return result


async def warm_up(backend: DisaggregatedBackend, num: int = 8) -> None:
    """A few short requests in a row through the load policy, so every worker has served one
    (first-request costs do not land in the first phase's TTFT)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="bench-warmup")
    for i in range(num):
        prompt = [1000 + (7 * i + j) % 40000 for j in range(64 + 96 * (i % 3))]
        async for _ in backend.generate(f"warmup-{i}", prompt, params):
            pass


def phase_order(rounds: int) -> list[str]:
    """kv, load, load, kv, kv, load, ... (ABBA), ``2 * rounds`` phases."""
    pairs = [("kv_aware", "load_only"), ("load_only", "kv_aware")]
    return [mode for r in range(rounds) for mode in pairs[r % 2]]


async def bench(args: argparse.Namespace) -> dict[str, PhaseResult]:
    requests = workload(args.requests, args.rate)
    results: dict[str, PhaseResult] = {}
    with EmbeddedRedis.start() as redis_server, tempfile.TemporaryDirectory() as log_dir:
        procs = start_workers(redis_server.url, Path(log_dir),
                              {"prefill": args.prefill_kv_blocks, "decode": args.decode_kv_blocks},
                              args.cpu_offload_gb)
        try:
            await wait_serving(procs)
            prefill = [a for _, a in procs[:2]]
            decode = [a for _, a in procs[2:]]
            warm = DisaggregatedBackend(prefill, decode, "grpc", poll_interval_s=0.2)
            await warm.start()
            try:
                await asyncio.wait_for(warm_up(warm), START_TIMEOUT_S)
            finally:
                await warm.close()
            for round_index, mode in enumerate(phase_order(args.rounds)):
                policy = PrefixAwarePolicy(redis_server.url) if mode == "kv_aware" else None
                backend = DisaggregatedBackend(prefill, decode, "grpc", policy=policy,
                                               poll_interval_s=0.2)
                await backend.start()
                try:
                    solo = await solo_decisions(backend, requests) if policy is not None else []
                    result = await run_phase(backend, requests, salt=f"bench-{mode}-{round_index}")
                    result.solo_p50_ms = pct(solo, 0.5) * 1e3
                    result.solo_p99_ms = pct(solo, 0.99) * 1e3
                finally:
                    await backend.close()
                if mode in results:
                    results[mode].merge(result)
                    results[mode].solo_p99_ms = max(results[mode].solo_p99_ms, result.solo_p99_ms)
                else:
                    results[mode] = result
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc, _ in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench routing", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per phase")
    parser.add_argument("--rate", type=float, default=0.4, help="Poisson arrivals per second")
    parser.add_argument("--num-kv-blocks", type=int, default=320,
                        help="KV blocks per worker (320 x 16 tokens: about 5 tenants' prompts)")
    parser.add_argument("--prefill-kv-blocks", type=int, default=0,
                        help="KV blocks per prefill worker (0: --num-kv-blocks)")
    parser.add_argument("--decode-kv-blocks", type=int, default=0,
                        help="KV blocks per decode worker (0: --num-kv-blocks)")
    parser.add_argument("--cpu-offload-gb", type=float, default=None,
                        help="each worker's host tier in GiB (0: off, so the device pool is the only "
                             "cache; default: the workers' own default)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="phases per mode, in ABBA order (pooled per mode)")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    args.prefill_kv_blocks = args.prefill_kv_blocks or args.num_kv_blocks
    args.decode_kv_blocks = args.decode_kv_blocks or args.num_kv_blocks
    if min(args.requests, args.rate, args.prefill_kv_blocks, args.decode_kv_blocks, args.rounds) <= 0:
        parser.error("--requests, --rate, --rounds and the KV block counts must be positive")
    results = asyncio.run(bench(args))
    print(f"{NUM_TENANTS} tenants x {SYSTEM_TOKENS}-token system prompt, {args.requests} requests "
          f"per phase x {args.rounds} round(s) at {args.rate:g}/s (Poisson), 2 prefill + 2 decode, "
          f"{args.prefill_kv_blocks}/{args.decode_kv_blocks} KV blocks per prefill/decode worker, "
          f"host tier {'default' if args.cpu_offload_gb is None else f'{args.cpu_offload_gb:g} GiB'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'routing':10s} {'hit rate':>8s} {'TTFT p50 ms':>11s} {'TTFT p99 ms':>11s} "
          f"{'fail':>4s} {'decide p50/p99 ms':>17s} {'solo p50/p99 ms':>15s}  routes")
    for mode, r in results.items():
        print(f"{mode:10s} {r.hit_rate:8.1%} {pct(r.ttft_s, .5) * 1e3:11.0f} "
              f"{pct(r.ttft_s, .99) * 1e3:11.0f} {len(r.failures):4d} "
              f"{r.decision_p50_ms:8.2f}/{r.decision_p99_ms:<8.2f} "
              f"{r.solo_p50_ms:7.2f}/{r.solo_p99_ms:<7.2f}  {r.routes}")
    kv, load = results["kv_aware"], results["load_only"]
    print(f"hit rate x{kv.hit_rate / max(load.hit_rate, 1e-9):.2f}; TTFT p99 "
          f"{pct(kv.ttft_s, .99) / max(pct(load.ttft_s, .99), 1e-9):.2f} of load-only")
    for mode, r in results.items():
        for failure in r.failures[:5]:
            print(f"{mode} failure {failure}")
        for rec in sorted(r.records, key=lambda rec: -rec["ttft_ms"])[:3]:
            stages = ", ".join(f"{k} {v:.0f}" for k, v in rec["stages_ms"].items())
            print(f"{mode} slow: request {rec['request']} at {rec['sent_s']:.1f} s, TTFT "
                  f"{rec['ttft_ms']:.0f} ms, {rec['route']}, {rec['cached_tokens']}/"
                  f"{rec['prompt_tokens']} cached; stages ms: {stages}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {m: {**r.__dict__, "hit_rate": r.hit_rate, "ttft_p50_s": pct(r.ttft_s, .5),
                 "ttft_p99_s": pct(r.ttft_s, .99)} for m, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
