"""The Grafana dashboards in helm/pdserve/dashboards/: a valid JSON model (schemaVersion, unique
panel ids, a datasource variable, no hard-coded instance or datasource), every PromQL expression
parsed by a real parser (promql-parser, the Rust crate's bindings), and every metric name one
that a live scrape of the cluster exposes (``tests/integration/metrics_names.txt``, written by
tests/integration/test_metrics_cluster.py, which also checks them against its own scrape).

The recording rules (helm/pdserve/prometheus/pdserve-rules.yml) likewise: each expression parses
and uses only scraped names or the series an earlier rule records; a dashboard may query the
recorded ``pdserve:*`` series (the SLO tiles do).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "helm" / "pdserve" / "dashboards").glob("*.json"))
NAMES_FILE = REPO / "tests" / "integration" / "metrics_names.txt"
RULES_FILE = REPO / "helm" / "pdserve" / "prometheus" / "pdserve-rules.yml"
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


def recording_rules() -> list[dict]:
    """Every rule of the rules file, in order."""
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in recording_rules()}


def scraped_names_used() -> set[str]:
    """The names the dashboards and the rules need a live scrape to expose (recorded ones aside)."""
    rule_names = {name for rule in recording_rules() for name in metric_names(rule["expr"])}
    return (dashboard_metric_names() | rule_names) - recorded_names()


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


def test_dashboards_and_rules_query_only_names_the_live_scrape_exposed():
    exposed = set(NAMES_FILE.read_text().split())
    missing = sorted(scraped_names_used() - exposed)
    assert not missing, f"not exposed by any service (rerun test_metrics_cluster.py to refresh): {missing}"
    assert dashboard_metric_names() & recorded_names()  # the SLO tiles read the recorded series


def test_recording_rules_parse_and_build_on_scraped_or_earlier_series():
    recorded: set[str] = set()
    for rule in recording_rules():
        assert set(rule) <= {"record", "expr", "labels"}, rule
        assert re.fullmatch(r"pdserve:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
        names = metric_names(rule["expr"])  # parses (ValueError naming the position)
        later = {n for n in names if n.startswith("pdserve:")} - recorded
        assert not later, f"{rule['record']} uses {later} before a rule records them"
        recorded.add(rule["record"])
    assert "pdserve:goodput:ratio_5m" in recorded
