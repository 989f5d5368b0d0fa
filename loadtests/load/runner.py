"""Drive one run: send a scenario's requests to one target under one arrival pattern.

    result = asyncio.run(run_load(url, model, requests, Arrival.poisson(1.0), LoadBounds(), seed=0))
    summarize(result.records, SLO())

Bounded: no request is sent after ``bounds.max_duration_s``; each request gives up after
``bounds.request_timeout_s``; an open loop keeps at most ``bounds.max_in_flight`` in flight. A
multi-turn request waits for its previous turn to finish (a failed turn still releases it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from loadtests.load.arrivals import Arrival
from loadtests.load.client import stream_request
from loadtests.load.prompts import RequestSpec
from loadtests.load.record import RequestRecord


@dataclass(frozen=True)
class LoadBounds:
    """Seconds and counts that bound a run."""

    max_duration_s: float = 300.0
    request_timeout_s: float = 300.0
    max_in_flight: int = 256


@dataclass
class RunResult:
    """The records of the requests sent (in send order) and how many the time bound skipped."""

    started: float
    records: list[RequestRecord] = field(default_factory=list)
    num_not_sent: int = 0


async def run_load(base_url: str, model: str, requests: Sequence[RequestSpec], arrival: Arrival,
                   bounds: LoadBounds, seed: int, count_tokens: Callable[[str], int] | None = None,
                   progress: bool = False) -> RunResult:
    """Send ``requests`` to ``base_url``; ``count_tokens`` counts output tokens of a server that
    reports no usage."""
    from tqdm import tqdm

    result = RunResult(started=time.perf_counter())
    deadline = result.started + bounds.max_duration_s
    done = {spec.index: asyncio.Event() for spec in requests}
    limit = arrival.concurrency if not arrival.is_open else bounds.max_in_flight
    bar = tqdm(total=len(requests), desc=arrival.label, unit="req", disable=not progress, leave=False)
    # One connection per request: a server that closes kept-alive connections on its own terms
    # (llama.cpp's llama-server) otherwise fails requests sent on a connection it just closed
    # ("Can not write request body", "Server disconnected"). The extra loopback connect per
    # request is the same for every target (not measured separately).
    connector = aiohttp.TCPConnector(limit=limit, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        semaphore = asyncio.Semaphore(limit)

        async def send(spec: RequestSpec) -> None:
            try:
                if spec.after is not None and spec.after in done:
                    await asyncio.wait_for(done[spec.after].wait(), max(0.0, deadline - time.perf_counter()))
                async with semaphore:
                    if time.perf_counter() >= deadline:
                        result.num_not_sent += 1
                        return
                    record = await stream_request(session, base_url, model, spec, bounds.request_timeout_s)
                if record.ok and record.tokens_from != "usage" and count_tokens is not None:
                    record.completion_tokens, record.tokens_from = count_tokens(record.text), "tokenizer"
                result.records.append(record)
            except TimeoutError:
                result.num_not_sent += 1
            finally:
                done[spec.index].set()
                bar.update(1)

        if arrival.is_open:
            offsets = arrival.send_offsets(len(requests), seed)

            async def send_at(spec: RequestSpec, offset: float) -> None:
                await asyncio.sleep(max(0.0, min(result.started + offset, deadline) - time.perf_counter()))
                await send(spec)

            await asyncio.gather(*(send_at(spec, offset) for spec, offset in zip(requests, offsets)))
        else:
            queue = list(reversed(requests))

            async def worker() -> None:
                while queue:
                    await send(queue.pop())

            await asyncio.gather(*(worker() for _ in range(arrival.concurrency)))
    bar.close()
    result.records.sort(key=lambda r: r.sent)
    return result
