"""The Grafana dashboards in helm/pdserve/dashboards/: a valid JSON model (schemaVersion, unique
panel ids, a datasource variable, no hard-coded instance or datasource), every PromQL expression
parsed by a real parser (promql-parser, the Rust crate's bindings), and every metric name one
that a live scrape of the cluster exposes (``tests/integration/metrics_names.txt``, written by
tests/integration/test_metrics_cluster.py, which also checks them against its own scrape).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "helm" / "pdserve" / "dashboards").glob("*.json"))
NAMES_FILE = REPO / "tests" / "integration" / "metrics_names.txt"
# Grafana's variables, as Grafana would substitute them before the query reaches Prometheus.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m"}


def _panels(board: dict) -> list[dict]:
    panels = []
    for panel in board["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows
    return panels


def expressions(board: dict) -> list[str]:
    return [t["expr"] for p in _panels(board) for t in p.get("targets", []) if t.get("expr")]


def to_promql(expr: str) -> str:
    for name, text in VARIABLES.items():
        expr = expr.replace(name, text)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # $model_name inside =~ matchers


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(to_promql(expr)), visit)
    return names


def dashboard_metric_names() -> set[str]:
    return {name for path in DASHBOARDS for e in expressions(json.loads(path.read_text()))
            for name in metric_names(e)}


def test_the_four_dashboards_exist():
    assert [p.name for p in DASHBOARDS] == ["pdserve-disaggregation.json", "pdserve-prefix-tiers.json",
                                           "pdserve-spec-decode.json", "pdserve-vllm-model.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_a_grafana_model_with_parsable_queries(path):
    board = json.loads(path.read_text())
    assert isinstance(board["schemaVersion"], int) and board["uid"] and board["title"]
    ids = [p["id"] for p in _panels(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in _panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    text = path.read_text()
    assert "instance=" not in text and "localhost" not in text and "127.0.0.1" not in text
    exprs = expressions(board)
    assert exprs
    for expr in exprs:
        promql_parser.parse(to_promql(expr))  # raises ValueError naming the position


def test_no_deprecated_vllm_names():
    removed = re.compile(r"vllm:gpu_cache_usage_perc|vllm:gpu_prefix_cache|vllm:time_per_output_token_seconds")
    assert not [n for n in dashboard_metric_names() if removed.search(n)]


def test_dashboards_query_only_names_the_live_scrape_exposed():
    exposed = set(NAMES_FILE.read_text().split())
    missing = sorted(dashboard_metric_names() - exposed)
    assert not missing, f"not exposed by any service (rerun test_metrics_cluster.py to refresh): {missing}"
