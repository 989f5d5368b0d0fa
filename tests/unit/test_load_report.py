"""Run JSON -> re-summarized table and plots at another SLO (loadtests.load.retable)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.load import retable
from loadtests.load.arrivals import Arrival
from loadtests.load.record import HTTP_5XX, RequestRecord
from loadtests.load.report import machine_info, run_document, write_run
from loadtests.load.runner import RunResult
from loadtests.load.scenario import load_scenario
from loadtests.load.stats import SLO, summarize


def test_retable_pools_repeats_and_applies_the_new_slo(tmp_path: Path) -> None:
    scenario = load_scenario("long-context-mix")
    arrival = Arrival.poisson(0.5)
    for repeat, ttft in enumerate((0.5, 3.0)):
        records = [RequestRecord(0, "short-chat", 10.0, [10.0 + ttft, 10.2 + ttft], 10.2 + ttft, 200,
                                 completion_tokens=2, tokens_from="usage"),
                   RequestRecord(1, "long-context", 11.0, [], 12.0, 503, error_kind=HTTP_5XX, error="busy")]
        result = RunResult(started=10.0, records=records)
        document = run_document(scenario, {"name": "disagg"}, arrival, 0, result,
                                summarize(records, SLO()), machine_info())
        write_run(document, tmp_path, f"disagg-r{repeat}")
    retable.main([str(tmp_path), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "300", "--out", str(tmp_path / "t")])
    table = (tmp_path / "t" / "table.md").read_text()
    # 4 sent over two repeats, 2 ok, one of them within TTFT 1 s (TPOT 0.2 s each)
    assert "| disagg | 0.5 req/s | 2 / 4 | 2 http_5xx |" in table
    # throughput over the summed durations (2.0 s + 3.2 s), not over the overlapping clocks
    assert "| 0.38 | 0.8 |" in table
    assert "(25%) |" in table and "TTFT <= 1000 ms and TPOT <= 300 ms" in table
    assert (tmp_path / "t" / "cdf.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "disagg-r0.json").read_text())["requests"][1]["finished"] == 2.0
