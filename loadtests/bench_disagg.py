"""Why disaggregation exists: inter-token latency of short requests under periodic long prompts.

    python -m loadtests.bench_disagg [--duration-s 40] [--streams 4] [--long-every-s 4]

Runs the same workload twice, each against a fresh ``pdserve up`` on this machine's cores:
  colocated      one engine doing prefill and decode on all cores (chunked prefill);
  disaggregated  1 prefill + 1 decode worker pinned to different cores (--pin-cores).
Workload: ``--streams`` clients each send short decode-heavy requests back to back (a 24-token
prompt, 48 new tokens, greedy), while another client sends a long prompt (>= 2,000 tokens,
8 new tokens) every ``--long-every-s``. Reports, per mode: p50/p99 inter-token latency of the
short requests (gaps between streamed tokens), p50/p99 TTFT of short and long requests, and the
ratio disaggregated / colocated. Every loop is bounded by the duration and a request count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time

from loadtests import cluster as cluster_lib
from services.common.channels import public_aio_channel
from services.common.pb import generate_pb2, generate_pb2_grpc

LONG_TEXT = ("In the beginning the committee met every Tuesday to discuss the harbour, the roads, "
             "the school and the price of grain; minutes were kept by whoever arrived last. ")


def start_cluster(mode: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    flags = ["--transfer", "grpc", *extra, *(["--colocated"] if mode == "colocated" else ["--pin-cores"])]
    cluster = cluster_lib.start_cluster(flags)
    return cluster.proc, cluster.grpc_address


async def one_request(stub, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) in seconds for one streamed request."""
    params = generate_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = []
    async for chunk in stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, sampling_params=params),
                                     timeout=300):
        now = time.perf_counter()
        stamps += [now] * max(1, len(chunk.token_ids))  # tokens arriving together: gap 0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps


async def workload(address: str, args) -> dict:
    short_ttft, long_ttft, itl = [], [], []
    stop_at = time.perf_counter() + args.duration_s
    async with public_aio_channel(address, api_key=os.environ.get("PDSERVE_API_KEY", "").split(",")[0]) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        await one_request(stub, "Warm up.", 4)

        async def short_client(i: int) -> None:
            for n in range(1000):
                if time.perf_counter() > stop_at:
                    return
                ttft, gaps = await one_request(stub, f"Client {i} request {n}: list some fruits. ",
                                               args.short_tokens)
                short_ttft.append(ttft)
                itl.extend(gaps)

        async def long_client() -> None:
            text = LONG_TEXT * 60
            for n in range(1000):
                await asyncio.sleep(args.long_every_s)
                if time.perf_counter() > stop_at:
                    return
                ttft, _ = await one_request(stub, f"Document {n}. " + text, 8)
                long_ttft.append(ttft)

        await asyncio.gather(long_client(), *(short_client(i) for i in range(args.streams)))
    return {"itl": itl, "short_ttft": short_ttft, "long_ttft": long_ttft}


pct = cluster_lib.percentile


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--long-every-s", type=float, default=4.0)
    parser.add_argument("--up-args", default="", help="extra flags for pdserve up")
    args = parser.parse_args(argv)
    results = {}
    for mode in ("colocated", "disaggregated"):
        proc, address = start_cluster(mode, args.up_args.split())
        try:
            results[mode] = asyncio.run(workload(address, args))
        finally:
            cluster_lib.stop_cluster(proc)
    print(f"cores {len(os.sched_getaffinity(0))}, {args.streams} short streams "
          f"({args.short_tokens} tokens), a long prompt every {args.long_every_s:g} s, "
          f"{args.duration_s:g} s per mode")
    print(f"{'mode':14s} {'ITL p50 ms':>10s} {'ITL p99 ms':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'long TTFT p50':>13s} {'tokens':>7s} {'longs':>6s}")
    for mode, r in results.items():
        print(f"{mode:14s} {pct(r['itl'], .5) * 1e3:10.1f} {pct(r['itl'], .99) * 1e3:10.1f} "
              f"{pct(r['short_ttft'], .5) * 1e3:9.0f} {pct(r['short_ttft'], .99) * 1e3:9.0f} "
              f"{pct(r['long_ttft'], .5) * 1e3:13.0f} {len(r['itl']):7d} {len(r['long_ttft']):6d}")
    ratio = pct(results["disaggregated"]["itl"], .99) / pct(results["colocated"]["itl"], .99)
    print(f"p99 ITL disaggregated / colocated: {ratio:.2f}x "
          f"(mean ITL {statistics.fmean(results['disaggregated']['itl']) * 1e3:.1f} vs "
          f"{statistics.fmean(results['colocated']['itl']) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
