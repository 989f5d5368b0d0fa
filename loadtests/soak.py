"""``pdserve bench soak``: a bounded soak of a ``pdserve up`` cluster under mixed load: leaked
blocks, memory over time per process, errors. Not part of ``make test``.

    pdserve bench soak [--duration-s 600] [--clients 4] [--sample-s 30] [--json out.json]
                       [-- up flags, e.g. --prefill 1 --decode 1 --transfer grpc]

Each client loops until the duration is over (and at most ``--max-requests``), picking:

* ``ok`` (70 %): a streamed greedy completion (random prompt of 8..160 token ids, a third of
  them behind a shared 64-token prefix; 4..48 tokens); it must end with HTTP 200 and its tokens;
* ``cancel`` (20 %): the same, but the client hangs up after 1..4 chunks;
* ``bad`` (10 %): a bad request from a fixed list (empty prompt, max_tokens -1, malformed
  JSON, temperature NaN, n=10000, unknown token ids): it must be a 400, at once.

Every ``--sample-s`` it records each child's RSS (``/proc/<pid>/status`` VmRSS) and each
worker's KV block use (``GetStats``). After the load it waits (bounded) for the workers to go
idle and reports, per worker, the blocks still in use (a leak unless zero), per process the RSS
after warm-up, at the end and its maximum, and the error counts. Exit code 1 if any
unexpected error or leaked block was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from loadtests.cluster import running_cluster, stream_completion

BAD_BODIES = [  # (what, body or raw bytes); every one must answer 400
    ("empty prompt", {"prompt": "", "max_tokens": 4}),
    ("negative max_tokens", {"prompt": "Hello", "max_tokens": -1}),
    ("malformed JSON", b'{"prompt": "Hello", "max_tokens": '),
    ("NaN temperature", b'{"prompt": "Hello", "max_tokens": 4, "temperature": NaN}'),
    ("absurd n", {"prompt": "Hello", "max_tokens": 4, "n": 10000}),
    ("out-of-vocab token ids", {"prompt": [10**9, -5], "max_tokens": 4}),
]


def children(parent_pid: int) -> dict[int, str]:
    """{pid: name} of ``pdserve up``'s children ("prefill:PORT", "router", "kvstore", ...)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != parent_pid:
            continue
        if "serve" in argv:
            role = argv[argv.index("serve") + 1]
            port = argv[argv.index("--port") + 1] if "--port" in argv else ""
            found[int(entry.name)] = f"{role}:{port}" if role in ("prefill", "decode") else role
        else:
            found[int(entry.name)] = Path(argv[0]).name
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def block_use(names: dict[int, str]) -> dict[str, tuple[int, int, int]]:
    """{worker: (blocks in use, total blocks, running requests)} from each worker's GetStats."""
    import grpc

    from services.common.pb import worker_pb2, worker_pb2_grpc
    use = {}
    for name in names.values():
        if name.split(":")[0] not in ("prefill", "decode"):
            continue
        with grpc.insecure_channel(f"127.0.0.1:{name.split(':')[1]}") as channel:
            s = worker_pb2_grpc.WorkerServiceStub(channel).GetStats(worker_pb2.GetStatsRequest(),
                                                                    timeout=5)
        use[name] = (s.num_total_blocks - s.num_free_blocks, s.num_total_blocks,
                     s.num_running_requests + s.num_waiting_requests)
    return use


async def one_request(session, url: str, model: str, rng: random.Random, prefix: list[int],
                      counts: dict[str, int], errors: list[str]) -> None:
    import aiohttp

    kind = rng.choices(["ok", "cancel", "bad"], weights=[7, 2, 1])[0]
    prompt = [rng.randrange(100, 20000) for _ in range(rng.randint(8, 160))]
    if rng.random() < 1 / 3:
        prompt = prefix + prompt
    max_tokens = rng.randint(4, 48)
    if kind == "ok":
        result = await stream_completion(session, url, model, prompt, max_tokens, timeout_s=120)
        counts["ok" if result.ok and result.completion_tokens == max_tokens else "failed"] += 1
        if not result.ok:
            errors.append(f"ok request: HTTP {result.status} {result.error}")
    elif kind == "cancel":
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        num_chunks = rng.randint(1, 4)
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=120)) as response:
            async for _ in response.content:
                num_chunks -= 1
                if num_chunks == 0:
                    break  # leaving the block closes the connection mid-stream
        counts["cancelled"] += 1
    else:
        what, body = rng.choice(BAD_BODIES)
        started = time.monotonic()
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(
            body, bytes) else {"json": {"model": model, **body}}
        async with session.post(f"{url}/v1/completions", timeout=aiohttp.ClientTimeout(total=30),
                                **kwargs) as response:
            status = response.status
            await response.read()
        if status == 400 and time.monotonic() - started < 5:
            counts["bad_rejected"] += 1
        else:
            counts["failed"] += 1
            errors.append(f"bad request ({what}): HTTP {status}")


async def run_load(url: str, model: str, args: argparse.Namespace, up_pid: int) -> dict:
    import aiohttp

    counts = {"ok": 0, "cancelled": 0, "bad_rejected": 0, "failed": 0}
    errors: list[str] = []
    samples: list[dict] = []
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, 20000) for _ in range(64)]
    names = children(up_pid)
    started = time.monotonic()
    stop_at = started + args.duration_s

    async def client(seed: int) -> None:
        client_rng = random.Random(seed)
        async with aiohttp.ClientSession() as session:
            for _ in range(args.max_requests):
                if time.monotonic() >= stop_at:
                    return
                try:
                    await one_request(session, url, model, client_rng, prefix, counts, errors)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    counts["failed"] += 1
                    errors.append(f"{type(exc).__name__}: {exc}")

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            samples.append({"t_s": round(time.monotonic() - started, 1),
                            "rss_mib": {n: round(rss_mib(p), 1) for p, n in names.items()},
                            "blocks": await asyncio.to_thread(block_use, names), **counts})
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
            await asyncio.sleep(min(args.sample_s, max(stop_at - time.monotonic(), 0)))

    await asyncio.gather(sampler(), *(client(args.seed * 1000 + k) for k in range(args.clients)))
    leaked: dict[str, tuple[int, int, int]] = {}
    for _ in range(30):  # idle within 15 s (reservation leases included)
        leaked = await asyncio.to_thread(block_use, names)
        if all(used == 0 and busy == 0 for used, _, busy in leaked.values()):
            break
        await asyncio.sleep(0.5)
    final = {n: round(rss_mib(p), 1) for p, n in names.items()}
    warm = samples[min(1, len(samples) - 1)]["rss_mib"] if samples else final
    return {"duration_s": round(time.monotonic() - started, 1), "counts": counts,
            "errors": errors[:20], "num_errors": len(errors),
            "blocks_in_use_after": {n: used for n, (used, _, _) in leaked.items()},
            "rss_mib": {n: {"warm": warm.get(n), "end": final[n],
                            "max": max([s["rss_mib"].get(n, 0) for s in samples] + [final[n]])}
                        for n in final},
            "samples": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--max-requests", type=int, default=100_000, help="per client")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write the full report (samples too) here")
    parser.add_argument("up_args", nargs=argparse.REMAINDER,
                        help="after --: flags for pdserve up (default: 1 prefill, 1 decode, grpc)")
    args = parser.parse_args(argv)
    up_args = [a for a in args.up_args if a != "--"] or ["--prefill", "1", "--decode", "1",
                                                          "--transfer", "grpc"]
    if args.duration_s <= 0 or args.clients < 1:
        parser.error("--duration-s must be > 0 and --clients >= 1")
    with running_cluster(up_args) as cluster:
        report = asyncio.run(run_load(cluster.http_url, cluster.model, args, cluster.proc.pid))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    leaked = sum(report["blocks_in_use_after"].values())
    sys.exit(1 if leaked or report["counts"]["failed"] else 0)


if __name__ == "__main__":
    main()
