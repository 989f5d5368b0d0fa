"""``pdserve bench load``: one scenario against one OpenAI-compatible server, over a sweep.

    pdserve bench load --base-url http://127.0.0.1:8000 --scenario long-context-mix \\
        --arrival poisson --rate 0.5,1,2 --slo-ttft-ms 2000 --slo-tpot-ms 100 --out results/
    pdserve bench load --scenario synthetic-chat --arrival closed --concurrency 1,4,16

Writes one JSON per run, ``table.md`` and PNG plots (latency CDFs, the sweep) under ``--out``.
Loopback targets only unless ``--allow-remote``. Scenarios: a shipped name (see --help) or a file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.load.arrivals import MODES, Arrival, parse_arrivals
from loadtests.load.prompts import RequestSpec, build_requests
from loadtests.load.record import EMPTY, RequestRecord
from loadtests.load.report import machine_info, markdown_table, run_document, write_run
from loadtests.load.runner import LoadBounds, run_load
from loadtests.load.scenario import Scenario, load_scenario, shipped_scenarios
from loadtests.load.stats import SLO, summarize


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``bench load`` and ``bench compare``."""
    parser.add_argument("--scenario", default="synthetic-chat",
                        help=f"a shipped scenario ({', '.join(shipped_scenarios())}) or a .yaml/.json path")
    parser.add_argument("--arrival", choices=MODES, default="closed")
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop sweep, e.g. 1,4,16")
    parser.add_argument("--rate", default="0.5,1,2", help="open-loop sweep in requests/s, e.g. 0.5,1,2")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    parser.add_argument("--num-requests", type=int, default=None, help="per run (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--max-duration-s", type=float, default=300.0, help="no request is sent after this")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--tokenizer", default=None,
                        help="GGUF file or HF dir whose tokenizer makes the prompts (default: pdserve's default model)")
    parser.add_argument("--out", default=None, help="output folder (default: bench-results/<scenario>-<time>)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback base URL")


class LoadPlan:
    """Everything a sweep needs that does not depend on the target."""

    def __init__(self, args: argparse.Namespace) -> None:
        from engine.models.loader import load_tokenizer

        self.scenario: Scenario = load_scenario(args.scenario)
        values = args.concurrency if args.arrival == "closed" else args.rate
        self.arrivals: list[Arrival] = parse_arrivals(args.arrival, values, args.burstiness)
        self.seed: int = args.seed
        self.slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        self.bounds = LoadBounds(args.max_duration_s, args.request_timeout_s)
        tokenizer = load_tokenizer(args.tokenizer)
        self.count_tokens: Callable[[str], int] = lambda text: len(tokenizer.encode(text))
        self._tokenizer, self._num_requests = tokenizer, args.num_requests
        self._requests: dict[int, list[RequestSpec]] = {}
        # The warm-up's prompts come from a seed no run uses, so nothing a run sends is cached by it.
        self.warm_up_requests: list[RequestSpec] = build_requests(self.scenario, tokenizer, -1 - args.seed,
                                                                  args.num_requests)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out_dir = Path(args.out or f"bench-results/{self.scenario.name}-{stamp}")
        self.progress = not args.no_progress and sys.stderr.isatty()
        self.x_label = "concurrency (closed loop)" if args.arrival == "closed" else "request rate (req/s)"

    def requests(self, repeat: int, run: int) -> list[RequestSpec]:
        """The requests of run ``run`` (index into ``arrivals``) of repeat ``repeat``: drawn with
        seed ``seed + repeat * len(arrivals) + run``, so every target gets the same requests for a
        run, and no run resends an earlier run's prompts (a server's prefix cache would turn the
        later points of a sweep into cache hits)."""
        seed = self.seed + repeat * len(self.arrivals) + run
        if seed not in self._requests:
            self._requests[seed] = build_requests(self.scenario, self._tokenizer, seed, self._num_requests)
        return self._requests[seed]


async def _warm_up(base_url: str, model: str, requests: Sequence[RequestSpec], timeout_s: float = 300.0) -> None:
    """A short request and the scenario's longest prompt (4 output tokens) until both succeed (at
    most ``timeout_s``), so first-use costs (kernel builds and calibration for long prefills,
    allocations, a worker still settling) stay out of the measured runs."""
    deadline = time.monotonic() + timeout_s
    longest = max(requests, key=lambda spec: spec.num_prompt_tokens)
    warm = [RequestSpec(-1, "warm-up", 4, 2, prompt="Hello there"),
            dataclasses.replace(longest, index=-2, class_name="warm-up", max_tokens=4, after=None)]
    while time.monotonic() < deadline:
        left = max(1.0, deadline - time.monotonic())
        result = await run_load(base_url, model, warm, Arrival.closed(1), LoadBounds(left, left), seed=0)
        # a complete 200 answer warms the server even if it carried no text (a server that
        # does not honour ignore_eos may end "Hello there" at once: the run must not wait 300 s)
        if len(result.records) == len(warm) and all(r.ok or (r.status == 200 and r.error_kind == EMPTY)
                                                     for r in result.records):
            return
        await asyncio.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    print(f"warning: {base_url} did not answer the warm-up requests in {timeout_s:.0f} s", file=sys.stderr)


async def _served_model(base_url: str) -> str:
    import aiohttp

    from loadtests.load.client import fetch_model

    async with aiohttp.ClientSession() as session:
        return await fetch_model(session, base_url)


def run_sweep(plan: LoadPlan, base_url: str, target: dict[str, Any], stem: str = "", repeat: int = 0,
              ) -> list[tuple[Arrival, list[RequestRecord], dict[str, Any]]]:
    """Every arrival of ``plan`` against ``base_url`` (repeat ``repeat``'s requests: see
    ``LoadPlan.requests``); writes one JSON per run; returns ``(arrival, records, summary)`` per
    run. ``target`` describes the server for the JSON."""
    model = target.get("model") or asyncio.run(_served_model(base_url))
    target = {**target, "base_url": base_url, "model": model}
    asyncio.run(_warm_up(base_url, model, plan.warm_up_requests))
    runs = []
    for run, arrival in enumerate(plan.arrivals):
        machine = machine_info()
        seed = plan.seed + repeat * len(plan.arrivals) + run
        result = asyncio.run(run_load(base_url, model, plan.requests(repeat, run), arrival, plan.bounds, seed,
                                      plan.count_tokens, plan.progress))
        machine["load_average_after"] = list(machine_info()["load_average"])
        summary = summarize(result.records, plan.slo, result.num_not_sent)
        document = run_document(plan.scenario, target, arrival, seed, result, summary, machine)
        name = f"{stem or target['name']}-{arrival.mode}-{arrival.x:g}"
        write_run(document, plan.out_dir, name)
        failures = ", ".join(f"{n} {k}" for k, n in summary["failures"].items()) or "none"
        print(f"{target['name']} {arrival.label}: {summary['num_ok']}/{summary['num_requests']} ok "
              f"(failures: {failures}), {summary['output_tok_per_s']:.1f} out tok/s, "
              f"TTFT p50 {summary['ttft_s']['p50']:.2f} s, goodput {summary['goodput_fraction']:.0%}", flush=True)
        runs.append((arrival, result.records, summary))
    return runs


def write_outputs(plan: LoadPlan, runs: Sequence[tuple[str, Arrival, list[RequestRecord], dict[str, Any]]]) -> None:
    """``table.md``, ``cdf.png`` and ``sweep.png`` for ``(target, arrival, records, summary)`` runs."""
    from loadtests.load.plots import plot_cdfs, plot_sweep

    table = markdown_table([(t, a.label, s) for t, a, _, s in runs])
    (plan.out_dir / "table.md").write_text(table + "\n")
    print(table)
    title = f"{plan.scenario.name}: {plan.scenario.description}"
    plot_cdfs([(f"{t} {a.label}", records) for t, a, records, _ in runs], plan.out_dir / "cdf.png", title)
    plot_sweep([(t, a.x, s) for t, a, _, s in runs], plan.out_dir / "sweep.png", plan.x_label, title)
    print(f"wrote {plan.out_dir}/: {len(runs)} run JSON files, table.md, cdf.png, sweep.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench load", description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--name", default=None, help="the target's name in tables (default: the URL)")
    add_load_arguments(parser)
    args = parser.parse_args(argv)
    from loadtests.load.client import check_loopback

    try:
        base_url = args.base_url.rstrip("/")
        check_loopback(base_url, args.allow_remote)
        plan = LoadPlan(args)
    except ValueError as error:
        parser.error(str(error))
    name = args.name or base_url.split("://", 1)[1]
    runs = run_sweep(plan, base_url, {"name": name, "kind": "url"})
    write_outputs(plan, [(name, a, records, s) for a, records, s in runs])


if __name__ == "__main__":
    main()
