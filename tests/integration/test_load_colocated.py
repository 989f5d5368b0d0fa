"""``pdserve bench load`` against a real ``pdserve up --colocated``: the run's JSON agrees with
what the server says (its streamed usage, its tokenizer's prompt counts, and its WorkerService
stats: nothing left running or waiting, every block free again)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from engine.models.loader import load_tokenizer
from loadtests.cluster import running_cluster
from loadtests.load import bench_load
from loadtests.load.prompts import build_requests
from loadtests.load.scenario import load_scenario
from services.common.pb import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

SCENARIO = {
    "name": "tiny-tenants", "description": "2 tenants, 2-turn chats", "api": "chat", "num_requests": 6,
    "classes": [{"name": "chat", "prompt_tokens": [8, 24], "output_tokens": [4, 8],
                 "shared_prefix_tokens": 32, "num_tenants": 2, "turns": 2}],
}


def test_small_scenario_counts_match_the_server(tmp_path: Path) -> None:
    scenario_path = tmp_path / "tiny.json"
    scenario_path.write_text(json.dumps(SCENARIO))
    out = tmp_path / "out"
    with running_cluster(["--colocated"]) as cluster:
        bench_load.main(["--base-url", cluster.http_url, "--scenario", str(scenario_path), "--arrival", "poisson",
                         "--rate", "8", "--seed", "5", "--out", str(out), "--no-progress",
                         "--max-duration-s", "60", "--request-timeout-s", "60"])
        bench_load.main(["--base-url", cluster.http_url, "--scenario", str(scenario_path), "--arrival", "closed",
                         "--concurrency", "2", "--seed", "5", "--out", str(out), "--no-progress",
                         "--name", "colocated", "--max-duration-s", "60", "--request-timeout-s", "60"])
        with grpc.insecure_channel(cluster.grpc_address) as channel:
            stats = worker_pb2_grpc.WorkerServiceStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5)
    assert stats.num_running_requests == 0 and stats.num_waiting_requests == 0
    assert stats.num_free_blocks == stats.num_total_blocks, (stats.num_free_blocks, stats.num_total_blocks)

    tokenizer = load_tokenizer(None)
    specs = {s.index: s for s in build_requests(load_scenario(str(scenario_path)), tokenizer, seed=5)}
    runs = sorted(out.glob("*.json"))
    assert [p.name for p in runs] == ["127.0.0.1:" + cluster.http_url.rsplit(":", 1)[1] + "-poisson-8.json",
                                      "colocated-closed-2.json"]
    for path in runs:
        run = json.loads(path.read_text())
        summary, requests = run["summary"], run["requests"]
        assert summary["num_requests"] == summary["num_ok"] == len(requests) == 6, summary["failures"]
        assert summary["failures"] == {} and summary["num_not_sent"] == 0
        assert summary["tokens_from"] == {"usage": 6}
        for r in requests:
            spec = specs[r["index"]]
            # ignore_eos: the server generated exactly max_tokens; its prompt count is its chat template's
            assert r["completion_tokens"] == spec.max_tokens
            messages = [{"role": role, "content": text} for role, text in spec.messages]
            assert r["prompt_tokens"] == len(tokenizer.encode_chat(messages))
            assert 1 <= len(r["stamps"]) <= spec.max_tokens and r["stamps"][0] >= r["sent"]
            if spec.after is not None:  # the second turn waited for the first
                first = next(q for q in requests if q["index"] == spec.after)
                assert r["sent"] >= first["finished"]
        assert summary["output_tokens"] == sum(specs[r["index"]].max_tokens for r in requests)
        assert run["machine"]["num_cpus"] >= 1 and run["target"]["model"]
    assert (out / "table.md").read_text().count("| colocated | c=2 | 6 / 6 |") == 1
    assert (out / "cdf.png").stat().st_size > 10_000 and (out / "sweep.png").stat().st_size > 10_000
