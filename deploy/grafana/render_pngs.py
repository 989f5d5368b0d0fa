"""Dashboard PNGs from real data: each dashboard's panels, queried from a live Prometheus over a
time range and plotted with matplotlib in the dashboard's own grid, into docs/dashboards/.

    python deploy/grafana/render_pngs.py --prometheus http://127.0.0.1:9090 --minutes 10

``tests/integration/test_metrics_cluster.py`` calls ``render_all`` against the Prometheus it runs
over a live cluster when ``PDSERVE_WRITE_DASHBOARD_PNGS=1``. Grafana's variables become
``$__rate_interval`` = ``rate_interval`` (default 15 s, right for a 1 s scrape) and every other
``$var`` = ``.*`` (all models). Panel kinds: timeseries (a line per series), stat (the last value,
coloured by the panel's thresholds), bargauge (a bar per series), heatmap (bucket increase over
time) and table (the series' labels). A query with no data says so in its panel.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "helm" / "pdserve" / "dashboards"
OUT = REPO / "docs" / "dashboards"
GRID_COLUMNS = 24
COLUMN_IN, ROW_IN = 0.8, 0.42  # inches per grid unit
NUM_STEPS = 120  # points per range query


class Prometheus:
    """The two HTTP API calls the renderer needs."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, **params: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}",
                                    timeout=30) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path}: {body}")
        return body["data"]

    def instant(self, expr: str, at: float) -> list[dict]:
        data = self._get("query", query=expr, time=str(at))
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def series(self, expr: str, start: float, end: float) -> list[dict]:
        step = max((end - start) / NUM_STEPS, 1.0)
        return self._get("query_range", query=expr, start=str(start), end=str(end), step=f"{step:.3f}")["result"]


def to_promql(expr: str, rate_interval: str) -> str:
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def legend(fmt: str, metric: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m[1], ""), fmt or "")
    return text.strip() or ",".join(f"{k}={v}" for k, v in metric.items() if k != "__name__") or "value"


def fmt_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.1f} %"
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "Bps":
        return f"{value / 1024:.1f} KiB/s"
    if unit == "reqps":
        return f"{value:.2f} req/s"
    return f"{value:.3g}"


def _threshold_colour(panel: dict, value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    colour = "#73bf69"
    for step in steps:
        if step["value"] is None or (not math.isnan(value) and value >= step["value"]):
            colour = {"green": "#73bf69", "yellow": "#fade2a", "red": "#f2495c"}.get(step["color"], step["color"])
    return colour


def draw_panel(ax: plt.Axes, panel: dict, prom: Prometheus, start: float, end: float, rate_interval: str) -> None:
    kind, unit = panel["type"], panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    ax.set_title(panel["title"], fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    targets = [(to_promql(t["expr"], rate_interval), t.get("legendFormat", "")) for t in panel["targets"]]
    if kind == "timeseries":
        lines = [(legend(fmt, s["metric"]), {float(t) - end: float(v) for t, v in s["values"]})
                 for expr, fmt in targets for s in prom.series(expr, start, end)]
        num_lines = len(lines)
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
        if lines and custom.get("stacking", {}).get("mode") == "normal":  # e.g. the TTFT stages
            xs = sorted(set().union(*(points for _, points in lines)))
            ys = [[0.0 if math.isnan(p.get(x, 0.0)) else p.get(x, 0.0) for x in xs] for _, p in lines]
            ax.stackplot(xs, ys, labels=[name for name, _ in lines], alpha=0.8)
        else:
            for name, points in lines:
                ax.plot(list(points), list(points.values()), linewidth=1.2, label=name)
        if num_lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2, frameon=False)
        ax.set_xlabel("seconds before the end of the run", fontsize=7)
        ax.set_ylabel(unit if unit != "short" else "", fontsize=7)
        _no_data(ax, num_lines)
        return
    results = [(fmt, s) for expr, fmt in targets for s in prom.instant(expr, end)]
    if kind == "stat":
        ax.axis("off")
        values = [float(s["value"][1]) for _, s in results]
        value = values[0] if values else float("nan")
        ax.set_facecolor(_threshold_colour(panel, value))
        ax.add_patch(plt.Rectangle((0, 0), 1, 1, transform=ax.transAxes, color=_threshold_colour(panel, value),
                                   alpha=0.35))
        ax.text(0.5, 0.45, fmt_value(value, unit) if values else "no data", ha="center", va="center",
                fontsize=18, transform=ax.transAxes)
    elif kind == "bargauge":
        labels = [legend(fmt, s["metric"]) for fmt, s in results]
        values = [float(s["value"][1]) for _, s in results]
        ax.barh(labels, [0.0 if math.isnan(v) else v for v in values], color="#5794f2")
        for i, v in enumerate(values):
            ax.text(0, i, " " + fmt_value(v, unit), va="center", fontsize=7)
        _no_data(ax, len(values))
    elif kind == "heatmap":
        expr, _ = targets[0]
        series = sorted(prom.series(expr, start, end), key=lambda s: float(s["metric"].get("le", "inf")))
        if series:
            rows = [[float(v) for _, v in s["values"]] for s in series]
            width = min(len(r) for r in rows)
            ax.imshow([r[:width] for r in rows], aspect="auto", origin="lower", cmap="viridis",
                      interpolation="nearest")
            ax.set_yticks(range(len(series)), [s["metric"].get("le", "") for s in series], fontsize=5)
            ax.set_ylabel("bucket (le)", fontsize=7)
        _no_data(ax, len(series))
    elif kind == "table":
        ax.axis("off")
        rows = [[legend(fmt, s["metric"]), fmt_value(float(s["value"][1]), unit)] for fmt, s in results]
        if rows:
            ax.table(cellText=rows, colLabels=["series", "value"], loc="upper left", fontsize=7)
        _no_data(ax, len(rows))


def _no_data(ax: plt.Axes, count: int) -> None:
    if not count:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def render_board(path: Path, prom: Prometheus, start: float, end: float, out_dir: Path,
                 rate_interval: str = "15s") -> Path:
    """One dashboard into ``out_dir/<file stem>.png``; returns the PNG's path."""
    board = json.loads(path.read_text())
    panels = board["panels"]
    num_rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    header_in = 0.6
    width_in, height_in = GRID_COLUMNS * COLUMN_IN, num_rows * ROW_IN + header_in
    fig = plt.figure(figsize=(width_in, height_in))
    fig.suptitle(f"{board['title']}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(end))}, "
                 f"{(end - start) / 60:.1f} min of a live pdserve cluster)", fontsize=11, x=0.01, ha="left")
    for panel in panels:
        g = panel["gridPos"]
        # inches: 0.45 left for tick labels, 0.5 below for the axis label, 0.3 above for the title
        left = (g["x"] * COLUMN_IN + 0.45) / width_in
        bottom = 1 - (header_in + (g["y"] + g["h"]) * ROW_IN - 0.5) / height_in
        ax = fig.add_axes((left, bottom, (g["w"] * COLUMN_IN - 0.6) / width_in,
                           (g["h"] * ROW_IN - 0.8) / height_in))
        draw_panel(ax, panel, prom, start, end, rate_interval)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.png"
    fig.savefig(out, dpi=70)
    plt.close(fig)
    return out


def render_all(url: str, start: float, end: float, out_dir: Path = OUT, rate_interval: str = "15s") -> list[Path]:
    prom = Prometheus(url)
    return [render_board(path, prom, start, end, out_dir, rate_interval) for path in sorted(DASHBOARDS.glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=10.0, help="the range to plot, ending now")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    end = time.time()
    for path in render_all(args.prometheus, end - 60 * args.minutes, end, args.out, args.rate_interval):
        print(path)


if __name__ == "__main__":
    main()
