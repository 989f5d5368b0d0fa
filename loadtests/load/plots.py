"""PNG plots of runs (matplotlib, headless): latency CDFs, and throughput / goodput against load.

    plot_cdfs(runs, Path("ttft.png"))            # runs: [(label, [RequestRecord])]
    plot_sweep(points, Path("sweep.png"), "request rate (req/s)")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.load.record import RequestRecord


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: Path, title: str = "") -> Path:
    """TTFT, TPOT and ITL CDFs (ms, log x) side by side, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, records in runs:
        ok = [r for r in records if r.ok]
        series = {"TTFT (ms)": [r.ttft for r in ok],
                  "TPOT (ms)": [t for r in ok if (t := r.tpot) is not None],
                  "ITL (ms)": [g for r in ok for g in r.itl]}
        for ax, (name, values) in zip(axes, series.items()):
            if not values:
                continue
            ordered = sorted(v * 1e3 for v in values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
            ax.set_xlabel(name)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests (ITL: of gaps)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_sweep(points: Sequence[tuple[str, float, dict[str, Any]]], path: Path, x_label: str,
               title: str = "") -> Path:
    """Output tok/s, goodput req/s and TTFT p90 against the sweep axis; one line per target.
    ``points``: ``(target, x, summary)``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
              ("output tok/s", lambda s: s["output_tok_per_s"]),
              ("req/s: all ok (dashed) and goodput (solid)", lambda s: s["goodput_per_s"]),
              ("TTFT p90 (s)", lambda s: s["ttft_s"]["p90"]))
    for target in dict.fromkeys(p[0] for p in points):
        mine = sorted(((x, s) for t, x, s in points if t == target), key=lambda point: point[0])
        xs = [x for x, _ in mine]
        for ax, (name, value) in zip(axes, panels):
            line = ax.plot(xs, [value(s) for _, s in mine], marker="o", label=target)
            if name.startswith("req/s"):
                ax.plot(xs, [s["request_per_s"] for _, s in mine], ls="--", color=line[0].get_color())
            ax.set_ylabel(name)
            ax.set_xlabel(x_label)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    """Title, lay out and write ``fig`` to ``path`` (folders made), then free it."""
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
