"""Served speed against engine speed, and the cluster under load, in one run.

    python -m loadtests.bench_serve [--modes colocated,nixl,grpc] [--itl-tokens 64]
                                    [--load-requests 32] [--load-concurrency 1,16]
                                    [--model PATH] [--device cuda] [--weight-format fp32]
    pdserve bench serve ...

1. Offline: the engine's own per-token decode time at batch 1 and 8 (``LLM.generate``, prefill
   excluded), at the thread count the serving decode engine gets (all cores when colocated; one
   core's share when ``pdserve up`` runs 1 prefill + 1 decode worker with ``--pin-cores``).
2. For each mode, a fresh ``pdserve up``: first the greedy tokens of 4 prompts of 100-1,000
   tokens, one request at a time, against the offline engine's (equal leading tokens: a KV push
   that lands wrong shows from the second token on; on a GPU, bf16 and random weights' near-flat
   logits may flip a late token where two processes picked other kernels); then streaming
   inter-token latency over HTTP (SSE) at
   concurrency 1 and 8, set against (1) at the same thread count; then the load: 196-token
   prompts, 128 new tokens, streaming, ``--load-requests`` requests at each concurrency
   (fewer at concurrency 1, ``--load-requests-c1``): output tokens/s, TTFT and ITL, and failed
   requests by HTTP status, set against the offline engine's output tok/s at the same
   concurrency (the same prompts, ``LLM.generate``). ``tok/chunk``: tokens per SSE chunk, above
   1 with speculation, or where the served path fell behind the engine and caught up in fewer
   writes (OutputQueue, services/common/async_engine.py); ITL is per chunk. And where the host's
   time went meanwhile: each process's CPU per output token, split into its main thread (a
   service's event loop: HTTP, gRPC, SSE), its engine thread and the rest (kernel threads,
   gRPC's pollers, copies); a main or engine thread near 100% of a core bounds the mode (GIL).

Modes: ``colocated`` (router + one engine on all cores); ``nixl`` and ``grpc`` (router + 1
prefill + 1 decode worker sharing every core, as ``pdserve up`` runs them, KV over that
transfer); ``nixl-pinned`` and ``grpc-pinned`` (the same with ``--pin-cores``: each worker on
its half of the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import Counter

from loadtests.cluster import host_cpu, host_cpu_by_role, percentile, running_cluster, stream_completion
from loadtests.prompts import distinct_prompts

MODES = {
    "colocated": ["--colocated"],
    "nixl": ["--transfer", "nixl"],
    "grpc": ["--transfer", "grpc"],  # on one host the KV goes through shared memory
    "grpc-bytes": ["--transfer", "grpc", "--worker-args", "--kv-shared-memory off"],  # as gRPC bytes
    # every prompt prefilled on the decode worker itself: the engine in a process of its own
    # beside the router's event loop (colocated shares one GIL between the two)
    "local": ["--transfer", "grpc", "--router-args", "--local-prefill-max-tokens 1000000"],
    "nixl-pinned": ["--transfer", "nixl", "--pin-cores"],
    "grpc-pinned": ["--transfer", "grpc", "--pin-cores"],
}


def decode_threads(mode: str) -> int:
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - cores // 2) if mode.endswith("-pinned") else cores


def offline_llm(loaded, num_threads: int, device: str, weight_format: str | None = None):
    from engine import LLM

    extra = {} if weight_format is None else {"weight_format": weight_format}
    return LLM(loaded, num_threads=num_threads, enable_prefix_caching=False, device=device, **extra)


def release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def offline_ms_per_token(llm, loaded, batches: tuple[int, ...], tokens: int) -> dict[int, float]:
    """Per-token decode time (ms, prefill excluded) of the offline engine at each batch size."""
    from engine import SamplingParams

    result = {}
    for batch in batches:
        batch_prompts = distinct_prompts(loaded.tokenizer, 24, batch, salt=batch)

        def run(n: int, batch_prompts: list[list[int]] = batch_prompts) -> float:
            t0 = time.perf_counter()
            llm.generate(batch_prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - t0
        run(2)
        first, full = min(run(1) for _ in range(2)), min(run(tokens + 1) for _ in range(2))
        result[batch] = (full - first) / tokens * 1e3
    return result


def offline_rate(llm, loaded, concurrency: int, num_requests: int, args) -> float:
    """Output tok/s of the offline engine on the load's prompts, ``concurrency`` at a time."""
    from engine import SamplingParams

    batch = distinct_prompts(loaded.tokenizer, args.load_prompt_len, num_requests, salt=1000 + concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.load_max_tokens, ignore_eos=True)
    started = time.perf_counter()
    for i in range(0, len(batch), concurrency):
        llm.generate(batch[i:i + concurrency], params)
    return len(batch) * args.load_max_tokens / (time.perf_counter() - started)


async def itl(base_url: str, model: str, concurrency: int, tokens: int, tokenizer) -> list[float]:
    """Gaps (s) between streamed chunks of ``concurrency`` concurrent requests, twice over."""
    import aiohttp

    gaps: list[float] = []
    async with aiohttp.ClientSession() as session:
        await stream_completion(session, base_url, model, "Warm up.", 4)
        for round_index in range(2):
            batch = distinct_prompts(tokenizer, 24, concurrency, salt=100 * round_index + concurrency)
            results = await asyncio.gather(*(stream_completion(session, base_url, model, p, tokens) for p in batch))
            failed = [r for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} ITL requests failed: {failed[0].status} {failed[0].error}")
            # the first gaps overlap the other requests' prefills: keep the steady state
            gaps += [g for r in results for g in r.gaps[4:]]
    return gaps


CHECK_PROMPT_LENS = (100, 200, 500, 1000)  # longer than the local path's 64: prefilled remotely
CHECK_TOKENS = 24


def check_prompts(tokenizer) -> list[list[int]]:
    return [distinct_prompts(tokenizer, n, 1, salt=5000 + n)[0] for n in CHECK_PROMPT_LENS]


def offline_tokens(llm, tokenizer) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    return [list(llm.generate([p], params)[0].token_ids) for p in check_prompts(tokenizer)]


async def served_tokens(base_url: str, model: str, tokenizer) -> list[list[int]]:
    """Greedy token ids of the check prompts through the served path, one request at a time."""
    import aiohttp

    tokens = []
    async with aiohttp.ClientSession() as session:
        for prompt in check_prompts(tokenizer):
            body = {"model": model, "prompt": prompt, "max_tokens": CHECK_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            async with session.post(f"{base_url}/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=300)) as response:
                reply = await response.json()
            if response.status != 200:
                raise RuntimeError(f"check request failed: {response.status} {str(reply)[:300]}")
            tokens.append(list(reply["choices"][0]["token_ids"]))
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def load(base_url: str, model: str, concurrency: int, num_requests: int, tokenizer, args) -> dict:
    """``num_requests`` streamed requests, at most ``concurrency`` in flight."""
    import aiohttp

    batch = distinct_prompts(tokenizer, args.load_prompt_len, num_requests, salt=1000 + concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(prompt):
            async with semaphore:
                return await stream_completion(session, base_url, model, prompt, args.load_max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in batch))
        elapsed = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    return {"elapsed": elapsed, "ok": len(ok),
            "failed": Counter(r.status for r in results if not r.ok),
            "errors": [r.error for r in results if not r.ok][:3],
            "tokens": sum(r.completion_tokens for r in ok), "chunks": sum(len(r.stamps) for r in ok),
            "ttft": [r.ttft for r in ok], "itl": [g for r in ok for g in r.gaps]}


def router_summary(base_url: str) -> tuple[dict[str, int], dict[str, float]]:
    """({path/reason: requests}, {TTFT stage: mean seconds}) from the router's ``/metrics``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    decisions: Counter[str] = Counter()
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_route_decisions_total":
                decisions[f"{sample.labels['path']}/{sample.labels['reason']}"] += int(sample.value)
            elif sample.name == "pdserve_ttft_stage_seconds_sum":
                sums[sample.labels["stage"]] += sample.value
            elif sample.name == "pdserve_ttft_stage_seconds_count":
                counts[sample.labels["stage"]] += int(sample.value)
    return dict(decisions), {stage: sums[stage] / n for stage, n in counts.items() if n}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="colocated,nixl,grpc,nixl-pinned,grpc-pinned")
    parser.add_argument("--itl-tokens", type=int, default=64)
    parser.add_argument("--load-requests", type=int, default=32)
    parser.add_argument("--load-requests-c1", type=int, default=4)
    parser.add_argument("--load-concurrency", default="1,16")
    parser.add_argument("--load-prompt-len", type=int, default=196)
    parser.add_argument("--load-max-tokens", type=int, default=128)
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--up-args", default="", help="extra flags for every pdserve up")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--device", default="cpu", help="torch device of the engines (cuda: one GPU for all)")
    parser.add_argument("--weight-format", default=None,
                        help="the engines' --weight-format, offline and served alike (default: the engine's)")
    args = parser.parse_args(argv)
    from engine.models.loader import load_model
    from kernels.cpu import cpu_identity

    modes = args.modes.split(",")
    loaded = load_model(args.model)
    concurrencies = [] if args.skip_load else list(map(int, args.load_concurrency.split(",")))
    offline, offline_load, reference = {}, {}, {}
    for threads in sorted({decode_threads(m) for m in modes}):
        llm = offline_llm(loaded, threads, args.device, args.weight_format)
        reference[threads] = offline_tokens(llm, loaded.tokenizer)
        offline[threads] = offline_ms_per_token(llm, loaded, (1, 8), args.itl_tokens)
        offline_load[threads] = {
            c: offline_rate(llm, loaded, c, args.load_requests_c1 if c == 1 else args.load_requests, args)
            for c in concurrencies}
        del llm
        release_device_memory()  # the clusters below are other processes on the same device
    up_args = [*(["--model", args.model] if args.model else []), "--device", args.device,
               *(["--weight-format", args.weight_format] if args.weight_format else []), *args.up_args.split()]
    served: dict[str, dict] = {}
    for mode in modes:
        with running_cluster([*MODES[mode], *up_args]) as cluster:
            row: dict = {}
            try:  # a check that fails is reported; the timings still run
                row["tokens"] = asyncio.run(served_tokens(cluster.http_url, cluster.model, loaded.tokenizer))
            except Exception as exc:  # noqa: BLE001
                row["tokens"] = f"{type(exc).__name__}: {exc}"[:300]
            row |= {c: asyncio.run(itl(cluster.http_url, cluster.model, c, args.itl_tokens, loaded.tokenizer))
                    for c in (1, 8)}
            if not args.skip_load:
                for c in concurrencies:
                    n = args.load_requests_c1 if c == 1 else args.load_requests
                    cpu_before = host_cpu(cluster.proc.pid)
                    row[f"load {c}"] = asyncio.run(load(cluster.http_url, cluster.model, c, n, loaded.tokenizer, args))
                    row[f"load {c}"]["cpu"] = host_cpu_by_role(cpu_before, host_cpu(cluster.proc.pid))
            row["router"] = router_summary(cluster.http_url)
            served[mode] = row

    print(f"{len(os.sched_getaffinity(0))} CPUs: {cpu_identity()}; engines on {args.device}")
    print(f"\ngreedy tokens through pdserve up, one request at a time, against the offline engine's: equal "
          f"leading tokens of {CHECK_TOKENS}, prompts of {'/'.join(map(str, CHECK_PROMPT_LENS))} tokens (prefilled "
          f"on the prefill worker when there is one, so its KV is pushed); also against colocated")
    for mode in modes:
        mine, base = served[mode]["tokens"], reference[decode_threads(mode)]
        if isinstance(mine, str):
            print(f"{mode:10s} failed: {mine}")
            continue
        line = f"{mode:10s} vs offline {[common_prefix(a, b) for a, b in zip(mine, base)]}"
        colocated = served.get("colocated", {}).get("tokens")
        if mode != "colocated" and isinstance(colocated, list):
            line += f"  vs colocated {[common_prefix(a, b) for a, b in zip(mine, colocated)]}"
        print(line)
    print("\nstreaming ITL through pdserve up vs the offline engine's per-token time (same threads)")
    print(f"{'mode':10s}{'threads':>8s}{'batch':>6s}{'offline ms':>11s}{'ITL p50 ms':>11s}"
          f"{'ITL mean':>9s}{'p50/offline':>12s}")
    for mode in modes:
        threads = decode_threads(mode)
        for c in (1, 8):
            gaps_ms = [g * 1e3 for g in served[mode][c]]
            base = offline[threads][c]
            p50 = percentile(gaps_ms, 0.5)
            print(f"{mode:10s}{threads:8d}{c:6d}{base:11.1f}{p50:11.1f}{statistics.fmean(gaps_ms):9.1f}"
                  f"{p50 / base:11.2f}x")
    if args.skip_load:
        return
    print(f"\nload: {args.load_prompt_len}-token prompts, {args.load_max_tokens} new tokens, streaming")
    print(f"{'mode':10s}{'conc':>5s}{'reqs':>5s}{'failed':>16s}{'out tok/s':>10s}{'TTFT p50 s':>11s}"
          f"{'TTFT p99 s':>11s}{'ITL p50 ms':>11s}{'tok/chunk':>10s}")
    colocated_rate = {}
    for mode in modes:
        for key, r in served[mode].items():
            if not str(key).startswith("load"):
                continue
            c = int(key.split()[1])
            rate = r["tokens"] / r["elapsed"]
            if mode == "colocated":
                colocated_rate[c] = rate
            failed = ",".join(f"{n}x{s or 'conn'}" for s, n in r["failed"].items()) or "0"
            ratio = f"  ({rate / offline_load[decode_threads(mode)][c]:.2f}x offline"
            ratio += (f", {rate / colocated_rate[c]:.2f}x colocated)"
                      if mode != "colocated" and colocated_rate.get(c) else ")")
            print(f"{mode:10s}{c:5d}{r['ok'] + sum(r['failed'].values()):5d}{failed:>16s}{rate:10.1f}"
                  f"{percentile(r['ttft'], .5):11.2f}{percentile(r['ttft'], .99):11.2f}"
                  f"{percentile(r['itl'], .5) * 1e3:11.1f}{r['tokens'] / max(r['chunks'], 1):10.2f}{ratio}")
            for error in r["errors"]:
                print(f"    failure: {error}")
    print("\nhost CPU per output token during each load, by process: us of CPU per token (and % of one "
          "core): all threads = main thread (the event loop) + engine thread + the others")
    print(f"{'mode':10s}{'conc':>5s}  {'process':9s}{'all us':>8s}{'main':>7s}{'engine':>8s}{'other':>7s}"
          f"{'% core':>8s}{'main %':>8s}")
    for mode in modes:
        for key, r in served[mode].items():
            if not str(key).startswith("load") or not r["tokens"]:
                continue
            for role, used in sorted(r["cpu"].items(), key=lambda kv: -kv[1].total_s):
                if used.total_s < 0.01 * r["elapsed"]:
                    continue  # idle beside the load (redis, the launcher)
                us = 1e6 / r["tokens"]
                other = used.total_s - used.main_s - used.engine_s
                print(f"{mode:10s}{key.split()[1]:>5s}  {role:9s}{used.total_s * us:8.0f}{used.main_s * us:7.0f}"
                      f"{used.engine_s * us:8.0f}{other * us:7.0f}{used.total_s / r['elapsed'] * 100:7.0f}%"
                      f"{used.main_s / r['elapsed'] * 100:7.0f}%")
    print("\nthe router's /metrics after each mode's runs: route decisions; mean seconds per TTFT stage")
    for mode in modes:
        decisions, stages = served[mode]["router"]
        print(f"{mode:10s} {dict(sorted(decisions.items()))}")
        print(f"{'':10s} " + " ".join(f"{stage}={mean:.3f}" for stage, mean in stages.items()))


if __name__ == "__main__":
    main()
