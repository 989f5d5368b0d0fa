"""A run's JSON file, the machine it ran on, and the Markdown table comparing runs.

One JSON file per run (``write_run``): ``{"scenario", "target", "arrival", "seed", "machine",
"summary", "requests"}``; ``summary`` is loadtests.load.stats.summarize's dict (seconds),
``requests`` the per-request records (times relative to the run's start).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtests.load.arrivals import Arrival
from loadtests.load.runner import RunResult
from loadtests.load.scenario import Scenario

# the flags worth naming for CPU inference speed (the full list is long)
_CPU_FLAGS = re.compile(r"^(avx\w*|amx\w*|fma|f16c|sse4_2)$")


def machine_info() -> dict[str, Any]:
    """CPU model and its SIMD flags, cores usable here, memory, load average now, Python."""
    model, flags = platform.processor(), []
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1)  # type: ignore[union-attr]
        flags = sorted(f for f in re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1).split()  # type: ignore[union-attr]
                       if _CPU_FLAGS.match(f))
    except (OSError, AttributeError):
        pass
    return {"cpu": model, "cpu_flags": flags, "num_cpus": len(os.sched_getaffinity(0)),
            "load_average": list(os.getloadavg()), "python": platform.python_version(),
            "platform": platform.platform(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_document(scenario: Scenario, target: dict[str, Any], arrival: Arrival, seed: int,
                 result: RunResult, summary: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any]:
    return {"scenario": scenario.to_json(), "target": target, "arrival": {**asdict(arrival), "label": arrival.label},
            "seed": seed, "machine": machine, "summary": summary,
            "requests": [r.to_json(result.started) for r in result.records]}


def write_run(document: dict[str, Any], out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(document, indent=1, allow_nan=True))
    return path


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:.0f}"


def _num(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _latencies(summary: dict[str, Any], key: str, quantiles: Sequence[str] = ("p50", "p90", "p99")) -> str:
    return " / ".join(_ms(summary[key][q]) for q in quantiles)


def markdown_table(rows: Sequence[tuple[str, str, dict[str, Any]]]) -> str:
    """One line per ``(target, arrival label, summary)``: latencies in ms (p50 / p90 / p99);
    requests the time bound kept from being sent show as ``(+N not sent)``."""
    lines = [("| target | load | ok / sent | failures | req/s | out tok/s | TTFT ms p50/p90/p99 "
             "| TPOT ms p50/p90/p99 | ITL ms p50/p99 | E2E s p50/p99 | goodput req/s (%) |"),
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for target, label, s in rows:
        not_sent = f" (+{s['num_not_sent']} not sent)" if s["num_not_sent"] else ""
        failures = ", ".join(f"{n} {kind}" for kind, n in sorted(s["failures"].items())) or "0"
        lines.append(
            f"| {target} | {label} | {s['num_ok']} / {s['num_requests']}{not_sent} | {failures} "
            f"| {_num(s['request_per_s'])} | {_num(s['output_tok_per_s'], 1)} "
            f"| {_latencies(s, 'ttft_s')} | {_latencies(s, 'tpot_s')} "
            f"| {_latencies(s, 'itl_s', ('p50', 'p99'))} | {_num(s['e2e_s']['p50'], 1)} / {_num(s['e2e_s']['p99'], 1)} "
            f"| {_num(s['goodput_per_s'])} ({_num(100 * s['goodput_fraction'], 0)}%) |")
    slo = rows[0][2]["slo"] if rows else {"ttft_s": float("nan"), "tpot_s": float("nan")}
    lines.append(f"\nGoodput: requests with TTFT <= {slo['ttft_s'] * 1e3:.0f} ms and "
                 f"TPOT <= {slo['tpot_s'] * 1e3:.0f} ms, per second (and % of requests sent).")
    return "\n".join(lines)
