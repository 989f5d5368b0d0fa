"""``pdserve bench compare``: one scenario against several targets, repeats interleaved.

    pdserve bench compare --target disagg=up: --target colocated=up:--colocated \\
        --target llama=url:http://127.0.0.1:8080 --scenario long-context-mix \\
        --arrival poisson --rate 0.5,1,2 --repeats 2 --out docs/plots/long-context

A ``NAME=up:FLAGS`` target is a ``pdserve up FLAGS`` this command starts on free loopback ports
(loadtests.cluster) and stops after its runs; a ``NAME=url:BASE_URL`` target is a server already
running. Repeat r visits the targets in an order rotated by r, so slow drift on a shared machine
spreads over all of them. Runs of the same target and load are pooled over repeats for the table
and plots; every run keeps its own JSON file.
"""

from __future__ import annotations

import argparse
import shlex
from collections import defaultdict
from dataclasses import dataclass

from loadtests.load.arrivals import Arrival
from loadtests.load.bench_load import (
    LoadPlan,
    add_load_arguments,
    run_sweep,
    write_outputs,
)
from loadtests.load.record import RequestRecord
from loadtests.load.stats import run_duration, summarize


@dataclass(frozen=True)
class Target:
    """A named server: ``up_args`` for one this command starts, or the ``base_url`` of one running."""

    name: str
    up_args: tuple[str, ...] | None = None
    base_url: str = ""


def parse_target(text: str) -> Target:
    """``NAME=up:FLAGS`` or ``NAME=url:BASE_URL``; ValueError names what is wrong."""
    name, sep, spec = text.partition("=")
    kind, colon, value = spec.partition(":")
    if not sep or not name or not colon or kind not in ("up", "url"):
        raise ValueError(f"--target must be NAME=up:FLAGS or NAME=url:BASE_URL, got {text!r}")
    if kind == "up":
        return Target(name, up_args=tuple(shlex.split(value)))
    if not value:
        raise ValueError(f"--target {text!r} names no URL")
    return Target(name, base_url=value.rstrip("/"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", required=True, help="NAME=up:FLAGS or NAME=url:BASE_URL")
    parser.add_argument("--repeats", type=int, default=1)
    add_load_arguments(parser)
    args = parser.parse_args(argv)
    from loadtests.cluster import running_cluster
    from loadtests.load.client import check_loopback

    try:
        targets = [parse_target(t) for t in args.target]
        if len({t.name for t in targets}) != len(targets):
            raise ValueError("target names must differ")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        for target in targets:
            if target.base_url:
                check_loopback(target.base_url, args.allow_remote)
        plan = LoadPlan(args)
    except ValueError as error:
        parser.error(str(error))

    pooled: dict[tuple[str, Arrival], list[RequestRecord]] = defaultdict(list)
    not_sent: dict[tuple[str, Arrival], int] = defaultdict(int)
    durations: dict[tuple[str, Arrival], float] = defaultdict(float)  # summed: repeats' clocks differ
    for repeat in range(args.repeats):
        for target in targets[repeat % len(targets):] + targets[:repeat % len(targets)]:
            stem = f"{target.name}-r{repeat}"
            if target.up_args is None:
                runs = run_sweep(plan, target.base_url, {"name": target.name, "kind": "url"}, stem, repeat)
            else:
                with running_cluster(list(target.up_args)) as cluster:
                    description = {"name": target.name, "kind": "pdserve up",
                                   "up_args": list(target.up_args)}
                    runs = run_sweep(plan, cluster.http_url, description, stem, repeat)
            for arrival, records, summary in runs:
                pooled[target.name, arrival] += records
                not_sent[target.name, arrival] += summary["num_not_sent"]
                durations[target.name, arrival] += run_duration(records)
    rows = [(target.name, arrival, pooled[target.name, arrival],
             summarize(pooled[target.name, arrival], plan.slo, not_sent[target.name, arrival],
                       durations[target.name, arrival]))
            for target in targets for arrival in plan.arrivals]
    write_outputs(plan, rows)


if __name__ == "__main__":
    main()
