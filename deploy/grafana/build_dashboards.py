"""Writes the four Grafana dashboards into helm/pdserve/dashboards/ (the one copy compose and the
chart mount). Edit the panel lists here, run ``python deploy/grafana/build_dashboards.py``, commit
both. tests/unit/test_dashboards.py parses every expression with a PromQL parser and checks the
metric names; the slow cluster test checks them against a live scrape.

Every dashboard has a ``datasource`` variable (no hard-coded datasource) and a ``model_name``
variable; no query names an instance. Percentiles come from the histograms' buckets. The SLO
tiles read the recording rules of helm/pdserve/prometheus/pdserve-rules.yml (``pdserve:*``
series: p99 TTFT at the router, p99 TPOT on decode workers, goodput); their thresholds are the
default targets (``SLO_TTFT_S``, ``SLO_TPOT_S``, Helm's ``slo`` values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "helm" / "pdserve" / "dashboards"
SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.1  # services/router/metrics.py's defaults (Helm values: slo)
RATE = "$__rate_interval"
W = '{model_name=~"$model_name"}'  # worker (vLLM) names
F = '{model=~"$model_name"}'  # router (Dynamo) names
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(expr: str, legend: str = "", fmt: str = "time_series") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "format": fmt, "datasource": DS}


def quantiles(histogram: str, sel: str, by: str = "") -> list[dict[str, Any]]:
    group = f"le{', ' + by if by else ''}"
    out = [q(f"histogram_quantile({p}, sum by ({group}) (rate({histogram}_bucket{sel}[{RATE}])))",
             f"p{int(p * 100)}{' {{' + by + '}}' if by else ''}") for p in (0.5, 0.9, 0.95, 0.99)]
    out.append(q(f"sum(rate({histogram}_sum{sel}[{RATE}])) / sum(rate({histogram}_count{sel}[{RATE}]))", "mean"))
    return out


def pct(histogram: str, sel: str, p: float = 0.99) -> str:
    return f"histogram_quantile({p}, sum by (le) (rate({histogram}_bucket{sel}[{RATE}])))"


def mean(histogram: str, sel: str, by: str = "", legend: str = "mean") -> dict[str, Any]:
    b = f" by ({by})" if by else ""
    return q(f"sum{b}(rate({histogram}_sum{sel}[{RATE}])) / sum{b}(rate({histogram}_count{sel}[{RATE}]))", legend)


class Board:
    def __init__(self, uid: str, title: str) -> None:
        self.uid, self.title = uid, title
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0
        self.row_height = 0  # the tallest panel of the current row: the next row starts below it

    def panel(self, title: str, targets: list[dict[str, Any]], kind: str = "timeseries", unit: str = "short",
              width: int = 12, height: int = 8, **extra: Any) -> None:
        if self.x + width > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        panel = {"id": len(self.panels) + 1, "type": kind, "title": title, "datasource": DS,
                 "gridPos": {"x": self.x, "y": self.y, "w": width, "h": height},
                 "targets": [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
                 "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
        panel.update(extra)
        self.panels.append(panel)
        self.x += width
        self.row_height = max(self.row_height, height)

    def slo(self, title: str, expr: str, yellow: float, red: float, unit: str = "s", width: int = 6) -> None:
        """A stat tile: green below ``yellow``, then yellow, red from ``red`` (reversed when
        ``red`` < ``yellow``: a share that should stay high)."""
        low, high = ("green", "red") if red > yellow else ("red", "green")
        steps = [{"color": low, "value": None}, {"color": "yellow", "value": min(yellow, red)},
                 {"color": high, "value": max(yellow, red)}]
        self.panel(title, [q(expr)], "stat", unit, width=width, height=5, fieldConfig={"defaults": {
            "unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}, "overrides": []})

    def model(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "tags": ["pdserve"], "schemaVersion": 39, "version": 1,
            "editable": True, "time": {"from": "now-30m", "to": "now"}, "refresh": "30s",
            "templating": {"list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Datasource"},
                {"name": "model_name", "type": "query", "datasource": DS, "label": "Model",
                 "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "M"},
                 "definition": "label_values(vllm:num_requests_running, model_name)",
                 "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
                 "current": {"text": "All", "value": "$__all"}},
            ]},
            "annotations": {"list": []}, "panels": self.panels,
        }


def vllm_model() -> Board:
    b = Board("pdserve-vllm", "pdserve / vLLM model view")
    b.slo("TTFT p99 (SLO)", f"max(pdserve:frontend_ttft_seconds:p99_5m{F})", SLO_TTFT_S, 2 * SLO_TTFT_S,
          width=5)
    b.slo("TPOT p99 (SLO)", f"max(pdserve:tpot_seconds:p99_5m{W})", SLO_TPOT_S, 2 * SLO_TPOT_S, width=5)
    b.slo("Goodput (TTFT and TPOT met)", f"min(pdserve:goodput:ratio_5m{F})", 0.99, 0.9, "percentunit",
          width=5)
    b.panel("Requests finished / s", [q(f"sum(rate(vllm:request_success_total{W}[{RATE}]))", "finished")],
            "stat", "reqps", width=5, height=5)
    b.panel("KV cache usage (max over workers)", [q(f"max(vllm:kv_cache_usage_perc{W})")], "stat", "percentunit",
            width=4, height=5)
    b.panel("E2E request latency", quantiles("vllm:e2e_request_latency_seconds", W), unit="s")
    b.panel("Token throughput", [q(f"sum(rate(vllm:prompt_tokens_total{W}[{RATE}]))", "prompt tokens/s"),
                                 q(f"sum(rate(vllm:generation_tokens_total{W}[{RATE}]))", "generation tokens/s")])
    b.panel("Time per output token", quantiles("vllm:request_time_per_output_token_seconds", W), unit="s")
    b.panel("Scheduler state", [q(f"sum by (worker) (vllm:num_requests_running{W})", "running {{worker}}"),
                                q(f"sum by (worker) (vllm:num_requests_waiting{W})", "waiting {{worker}}")])
    b.panel("Time to first token", quantiles("vllm:time_to_first_token_seconds", W), unit="s")
    b.panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds", W), unit="s")
    b.panel("KV cache usage per worker", [q(f"vllm:kv_cache_usage_perc{W}", "{{role}} {{worker}}")],
            "bargauge", "percentunit")
    b.panel("Prefix-cache hit rate per worker", [q(
        f"sum by (worker) (rate(vllm:prefix_cache_hits_total{W}[{RATE}])) / "
        f"sum by (worker) (rate(vllm:prefix_cache_queries_total{W}[{RATE}]))", "{{worker}}")],
        "bargauge", "percentunit")
    b.panel("Prompt length", [q(f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{W}[{RATE}]))",
                                "{{le}}", "heatmap")], "heatmap")
    b.panel("Generation length", [q(f"sum by (le) (increase(vllm:request_generation_tokens_bucket{W}[{RATE}]))",
                                    "{{le}}", "heatmap")], "heatmap")
    b.panel("Finish reason", [q(f"sum by (finished_reason) (increase(vllm:request_success_total{W}[{RATE}]))",
                                "{{finished_reason}}")])
    b.panel("Queue time", quantiles("vllm:request_queue_time_seconds", W), unit="s")
    b.panel("Prefill and decode time",
            [mean("vllm:request_prefill_time_seconds", W, legend="prefill"),
             mean("vllm:request_decode_time_seconds", W, legend="decode"),
             mean("vllm:request_inference_time_seconds", W, legend="inference")], unit="s")
    b.panel("Preemptions / s", [q(f"sum(rate(vllm:num_preemptions_total{W}[{RATE}]))", "preemptions")])
    return b


def disaggregation() -> Board:
    b = Board("pdserve-disagg", "pdserve / disaggregation")
    b.panel("Frontend requests / s", [q(f"sum by (status) (rate(dynamo_frontend_requests_total{F}[{RATE}]))",
                                        "{{status}}")], "timeseries", "reqps", width=8)
    b.panel("Avg TTFT", [mean("dynamo_frontend_time_to_first_token_seconds", F)], "stat", "s", width=8)
    b.panel("Avg request duration", [mean("dynamo_frontend_request_duration_seconds", F)], "stat", "s", width=8)
    b.panel("Inter-token latency", quantiles("dynamo_frontend_inter_token_latency_seconds", F), unit="s", width=8)
    b.panel("Input / output sequence length",
            [mean("dynamo_frontend_input_sequence_tokens", F, legend="ISL"),
             mean("dynamo_frontend_output_sequence_tokens", F, legend="OSL")], width=8)
    b.panel("Queued requests", [q(f"sum(dynamo_frontend_queued_requests{F})")], "stat", width=8, fieldConfig={
        "defaults": {"unit": "short", "thresholds": {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "yellow", "value": 10}, {"color": "red", "value": 50}]}},
        "overrides": []})
    p = '{model_name=~"$model_name", role="prefill"}'
    d = '{model_name=~"$model_name", role="decode"}'
    b.panel("Prefill processing time", [mean("vllm:request_prefill_time_seconds", p, legend="avg"),
                                        q(pct("vllm:request_prefill_time_seconds", p), "p99")],
            unit="s", width=8)
    b.panel("Prefill throughput", [q(f"sum by (worker) (rate(vllm:prompt_tokens_total{p}[{RATE}]))", "{{worker}}")],
            width=8)
    b.panel("Prefill vs decode latency",
            [mean("vllm:request_prefill_time_seconds", p, legend="prefill"),
             mean("vllm:request_decode_time_seconds", d, legend="decode")], unit="s", width=8)
    b.panel("Decode throughput", [q(f"sum by (worker) (rate(vllm:generation_tokens_total{d}[{RATE}]))", "{{worker}}")],
            width=8)
    b.panel("Decode duration", [mean("vllm:request_decode_time_seconds", d, legend="avg")], unit="s", width=8)
    b.panel("KV usage by role", [q(f"max by (role, worker) (vllm:kv_cache_usage_perc{W})", "{{role}} {{worker}}")],
            unit="percentunit", width=8)
    b.panel("TTFT stage breakdown (mean per request)", [mean("pdserve_ttft_stage_seconds", "", by="stage",
                                                             legend="{{stage}}")], unit="s", width=12,
            fieldConfig={"defaults": {"unit": "s", "custom": {"stacking": {"mode": "normal"}}}, "overrides": []})
    b.panel("P/D decision mix", [q(f"sum by (path, reason) (rate(pdserve_route_decisions_total[{RATE}]))",
                                   "{{path}} {{reason}}")], width=12)
    b.panel("KV bytes sent and saved by delta / s", [
        q(f"sum by (worker) (rate(pdserve_kv_transfer_bytes_sent_total{p}[{RATE}]))", "sent {{worker}}"),
        q(f"sum by (worker) (rate(pdserve_kv_transfer_bytes_saved_total{p}[{RATE}]))", "saved {{worker}}")],
        unit="Bps", width=12)
    b.panel("Blocks sent vs saved by delta transfer", [
        q(f"sum by (kind) (rate(pdserve_kv_transfer_blocks_total{p}[{RATE}]))", "{{kind}}")], width=12)
    b.panel("KV transfer time by transport", [
        mean("pdserve_kv_transfer_seconds", p, by="transport", legend="mean {{transport}}"),
        q(pct("pdserve_kv_transfer_seconds", p).replace("by (le)", "by (le, transport)"), "p99 {{transport}}")],
        unit="s", width=12)
    b.panel("KV transfer failures / s", [
        q(f"sum by (transport) (rate(pdserve_kv_transfer_failures_total{p}[{RATE}]))", "{{transport}}")], width=12)
    b.panel("KV blocks per worker", [q(f"max by (worker, num_gpu_blocks, block_size) (vllm:cache_config_info{W})",
                                       "{{worker}}: {{num_gpu_blocks}} x {{block_size}}", "table")], "table", width=24)
    return b


def prefix_tiers() -> Board:
    b = Board("pdserve-prefix", "pdserve / prefix index and tiers")
    b.panel("Device prefix hit rate", [q(
        f"sum(rate(vllm:prefix_cache_hits_total{W}[{RATE}])) / sum(rate(vllm:prefix_cache_queries_total{W}[{RATE}]))")],
        "stat", "percentunit", width=6, height=5)
    b.panel("Index available", [q("min(pdserve_index_available)")], "stat", width=6, height=5)
    b.panel("Index lookups / s", [q(f"sum(rate(pdserve_index_lookup_seconds_count[{RATE}]))")], "stat", width=6,
            height=5)
    b.panel("Index lookup p99", [q(pct("pdserve_index_lookup_seconds", ""))],
            "stat", "s", width=6, height=5)
    b.panel("Hit tokens per tier / s", [q(f"sum by (tier) (rate(pdserve_prefix_hit_tokens_total{W}[{RATE}]))",
                                          "{{tier}}")])
    b.panel("Hit rate per tier", [q(
        f"sum by (tier) (rate(pdserve_prefix_hit_tokens_total{W}[{RATE}])) / ignoring(tier) group_left "
        f"sum(rate(vllm:prefix_cache_queries_total{W}[{RATE}]))", "{{tier}}")], unit="percentunit")
    b.panel("Evictions per tier / s", [q(f"sum by (tier) (rate(pdserve_kv_evictions_total[{RATE}]))", "{{tier}}")])
    b.panel("Load failures per tier / s", [q(f"sum by (tier) (rate(pdserve_kv_load_failures_total{W}[{RATE}]))",
                                             "{{tier}}")])
    b.panel("Index fallbacks / s", [q(f"sum by (reason) (rate(pdserve_index_fallback_total[{RATE}]))", "{{reason}}")])
    b.panel("Index fallback rate (share of routed requests)", [q(
        f"sum(rate(pdserve_index_fallback_total[{RATE}])) / sum(rate(pdserve_route_decisions_total[{RATE}]))",
        "fallback")], unit="percentunit")
    b.panel("Index resyncs / s (snapshots by cause)", [
        q(f"sum by (reason) (rate(pdserve_index_resync_total{W}[{RATE}]))", "{{reason}}")])
    b.panel("Index apply results / s", [
        q(f"sum by (result) (rate(pdserve_index_apply_total{W}[{RATE}]))", "{{result}}")])
    b.panel("Host tier traffic", [q(f"sum(rate(vllm:kv_offload_store_bytes_total{W}[{RATE}]))", "offloaded"),
                                  q(f"sum(rate(vllm:kv_offload_load_bytes_total{W}[{RATE}]))", "loaded")], unit="Bps")
    b.panel("kvstore occupancy", [q("sum(pdserve_kvstore_used_bytes) / sum(pdserve_kvstore_capacity_bytes)")],
            unit="percentunit")
    b.panel("kvstore lookups / s", [q(f"sum(rate(pdserve_kvstore_lookup_hit_blocks_total[{RATE}]))", "hit blocks"),
                                    q(f"sum(rate(pdserve_kvstore_lookup_miss_blocks_total[{RATE}]))", "miss blocks")])
    return b


def spec_decode() -> Board:
    b = Board("pdserve-spec", "pdserve / speculative decoding")
    acc, drafted, drafts = (f"sum(rate(vllm:spec_decode_num_{n}_total{W}[{RATE}]))"
                            for n in ("accepted_tokens", "draft_tokens", "drafts"))
    b.panel("Acceptance rate", [q(f"{acc} / {drafted}")], "stat", "percentunit", width=8, height=5)
    b.panel("Mean accepted length", [q(f"1 + {acc} / {drafts}")], "stat", width=8, height=5)
    b.panel("Draft tokens / s", [q(drafted, "drafted"), q(acc, "accepted")], width=8, height=5)
    b.panel("Acceptance by position", [q(
        f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{W}[{RATE}])) "
        f"/ ignoring(position) group_left {drafts}", "position {{position}}")], unit="percentunit", width=24)
    return b


def main() -> None:
    for name, board in (("vllm-model", vllm_model()), ("disaggregation", disaggregation()),
                        ("prefix-tiers", prefix_tiers()), ("spec-decode", spec_decode())):
        (OUT / f"pdserve-{name}.json").write_text(json.dumps(board.model(), indent=2) + "\n")


if __name__ == "__main__":
    main()
