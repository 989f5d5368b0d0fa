"""The router's CPU per streamed token, alone: what caps served throughput once the engine is fast.

    python -m loadtests.bench_router_cpu [--concurrency 64] [--requests 256] [--tokens 128]
                                         [--step-ms 4] [--reps 5] [--model PATH]

A real router (HTTP server, admission, Generation, detokenizer, SSE rendering, metrics) in its
own process, over a backend that hands every running request one token per ``--step-ms`` (as a
decode engine's step would; no model runs). This process streams ``--requests`` completions at
``--concurrency`` through aiohttp and reads the router's CPU seconds (user + system, from
/proc) around each repetition. The baseline is the budget a step gives: ``step-ms /
concurrency`` of one core per token. The router needs more than that to keep up, and on a GPU
(steps of a few ms at 64) the event loop and the engine thread share one GIL (colocated), so
the ratio is the share of a core the serving path takes at that step rate. Median and min of
``--reps``. Tokens are real ids of the model's tokenizer (its detokenizer does real work).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time

from loadtests.cluster import cpu_seconds
from services.common.ports import free_port


def _serve(model: str | None, port: int, step_s: float) -> None:
    """The router process: a real Router over the paced backend, until SIGTERM."""
    from services.router.app import Router, RouterConfig
    from services.router.backends.backend import Backend, TokenEvent

    class PacedBackend(Backend):
        def __init__(self) -> None:
            self.waiters: dict[str, asyncio.Queue[None]] = {}

        async def start(self) -> None:
            self._steps = asyncio.ensure_future(self._run())

        async def _run(self) -> None:
            while True:
                await asyncio.sleep(step_s)
                for queue in list(self.waiters.values()):
                    queue.put_nowait(None)

        async def is_healthy(self) -> bool:
            return True

        async def generate(self, request_id, prompt_token_ids, params):  # type: ignore[no-untyped-def,override]
            queue: asyncio.Queue[None] = asyncio.Queue()
            self.waiters[request_id] = queue
            text = list(prompt_token_ids)
            try:
                for i in range(params.max_tokens):
                    await queue.get()
                    yield TokenEvent(index=0, token_ids=[text[i % len(text)]],
                                     finish_reason="length" if i == params.max_tokens - 1 else None,
                                     num_prompt_tokens=len(text))
            finally:
                del self.waiters[request_id]

    async def run() -> None:
        router = Router(RouterConfig(http_port=port, grpc_port=0, model=model), PacedBackend())
        await router.start()
        print("ready", flush=True)
        await router.serve_until_signal()

    asyncio.run(run())


async def _load(url: str, model: str, prompt: str, n: int, concurrency: int, tokens: int) -> int:
    import aiohttp

    from loadtests.cluster import stream_completion

    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one() -> int:
            async with limit:
                result = await stream_completion(session, url, model, prompt, max_tokens=tokens,
                                                 timeout_s=120)
                if not result.ok:
                    raise RuntimeError(f"a stream failed: {result.error}")
                return result.completion_tokens
        return sum(await asyncio.gather(*(one() for _ in range(n))))


def main(args: argparse.Namespace) -> None:
    from engine.models.loader import load_tokenizer
    from services.router.model_info import read_model_info

    model_name = read_model_info(args.model).name
    text = load_tokenizer(args.model).decode(list(range(1000, 1000 + 200)))  # prose-like ids
    port = free_port()
    argv = [sys.executable, "-m", "loadtests.bench_router_cpu", "--serve", "--port", str(port),
            "--step-ms", str(args.step_ms), *(["--model", args.model] if args.model else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the router did not start")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_load(url, model_name, text, args.concurrency, args.concurrency, 8))  # warm
        budget_us = args.step_ms * 1000 / args.concurrency
        print(f"router CPU per streamed token, c={args.concurrency}, one token per request every "
              f"{args.step_ms} ms (budget {budget_us:.1f} us of one core per token)")
        per_token = []
        for rep in range(args.reps):
            before, started = cpu_seconds(proc.pid), time.perf_counter()
            tokens = asyncio.run(_load(url, model_name, text, args.requests, args.concurrency, args.tokens))
            wall, cpu = time.perf_counter() - started, cpu_seconds(proc.pid) - before
            per_token.append(cpu / tokens * 1e6)
            print(f"  rep {rep + 1}: {tokens} tokens in {wall:.2f} s ({tokens / wall:,.0f} tok/s), "
                  f"router {per_token[-1]:.1f} us/token = {per_token[-1] / budget_us:.2f}x the budget")
        per_token.sort()
        median = per_token[len(per_token) // 2]
        print(f"router CPU: median {median:.1f} us/token ({median / budget_us:.2f}x the budget), "
              f"min {per_token[0]:.1f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the embedded one)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.concurrency, args.requests, args.tokens, args.reps) < 1 or not args.step_ms > 0:
        parser.error("counts must be >= 1 and --step-ms positive")
    return args


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.serve:
        _serve(parsed.model, parsed.port, parsed.step_ms / 1000)
    else:
        main(parsed)
