"""Re-summarize stored runs at other SLOs, without running anything again.

    python -m loadtests.load.retable RESULTS_DIR [--slo-ttft-ms 5000] [--slo-tpot-ms 500] [--out DIR]

Reads every run JSON under RESULTS_DIR (as ``bench load`` / ``bench compare`` wrote them), pools
runs of the same target and load (repeats), and writes ``table.md``, ``cdf.png`` and ``sweep.png``
to ``--out`` (default: RESULTS_DIR/slo-<ttft>-<tpot>).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtests.load.arrivals import Arrival
from loadtests.load.plots import plot_cdfs, plot_sweep
from loadtests.load.record import RequestRecord
from loadtests.load.report import markdown_table
from loadtests.load.stats import SLO, run_duration, summarize


def load_runs(results_dir: Path) -> list[dict[str, Any]]:
    """The run documents under ``results_dir`` (files with a ``summary`` and ``requests``)."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        document = json.loads(path.read_text())
        if isinstance(document, dict) and "requests" in document and "summary" in document:
            runs.append(document)
    if not runs:
        raise ValueError(f"no run JSON files in {results_dir}")
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.load.retable", description=__doc__.split("\n")[0])
    parser.add_argument("results_dir")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    try:
        runs = load_runs(results_dir)
    except ValueError as error:
        parser.error(str(error))
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    pooled: dict[tuple[str, Arrival], list[RequestRecord]] = defaultdict(list)
    not_sent: dict[tuple[str, Arrival], int] = defaultdict(int)
    durations: dict[tuple[str, Arrival], float] = defaultdict(float)
    for run in runs:
        arrival = Arrival(**{k: v for k, v in run["arrival"].items() if k != "label"})
        key = (run["target"]["name"], arrival)
        records = [RequestRecord.from_json(r) for r in run["requests"]]
        pooled[key] += records
        durations[key] += run_duration(records)
        not_sent[key] += run["summary"]["num_not_sent"]
    rows = sorted(pooled, key=lambda key: (key[0], key[1].x))
    summaries = {key: summarize(pooled[key], slo, not_sent[key], durations[key]) for key in rows}
    out = Path(args.out or results_dir / f"slo-{args.slo_ttft_ms:g}-{args.slo_tpot_ms:g}")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table([(name, arrival.label, summaries[name, arrival]) for name, arrival in rows])
    (out / "table.md").write_text(table + "\n")
    print(table)
    scenario = runs[0]["scenario"]
    title = f"{scenario['name']}: {scenario['description']}"
    plot_cdfs([(f"{name} {arrival.label}", pooled[name, arrival]) for name, arrival in rows], out / "cdf.png", title)
    x_label = "concurrency (closed loop)" if rows[0][1].mode == "closed" else "request rate (req/s)"
    plot_sweep([(name, arrival.x, summaries[name, arrival]) for name, arrival in rows], out / "sweep.png",
               x_label, f"{title}; goodput at TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"wrote {out}/table.md, cdf.png, sweep.png")


if __name__ == "__main__":
    main()
