"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

* interactivity vs throughput per GPU: one curve per configuration, a point per concurrency level
  (annotated with it); invalid levels are drawn hollow. Up and to the right is better.
* TTFT CDF: one curve per concurrency level.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend must be chosen first
import numpy as np


def _curve(levels: Sequence[dict]) -> list[dict]:
    pts = [lv for lv in levels if lv.get("interactivity") and lv.get("throughput_per_gpu")]
    return sorted(pts, key=lambda lv: lv["throughput_per_gpu"])


def plot_interactivity_vs_throughput(runs: Sequence[tuple[str, Sequence[dict]]], path: str | Path,
                                     title: str = "Interactivity vs throughput per GPU",
                                     notes: Sequence[str] = ()) -> Path:
    """`runs`: (label, levels) pairs, levels being result dicts with `concurrency`,
    `throughput_per_gpu`, `interactivity` and `valid`."""
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for label, levels in runs:
        pts = _curve(levels)
        if not pts:
            continue
        xs = [p["throughput_per_gpu"] for p in pts]
        ys = [p["interactivity"] for p in pts]
        line, = ax.plot(xs, ys, "-", label=label)
        for p, x, y in zip(pts, xs, ys):
            face = line.get_color() if p.get("valid", True) else "none"
            ax.plot([x], [y], "o", color=line.get_color(), markerfacecolor=face)
            ax.annotate(f"c={p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("throughput per GPU (input + output tokens/s/GPU)")
    ax.set_ylabel("interactivity (tokens/s per user, 1 / P90 of latency per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if runs:
        ax.legend(loc="best")
    if notes:  # below the axes; savefig's tight bounding box keeps it in the image
        ax.text(0.0, -0.14, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="top")
    return _save(fig, path)


def plot_ttft_cdf(levels: Sequence[dict], path: str | Path, title: str = "TTFT CDF") -> Path:
    """One CDF per level from its `ttft_s` list."""
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for lv in levels:
        ttft = np.sort(np.asarray(lv.get("ttft_s") or [], dtype=np.float64))
        if ttft.size == 0:
            continue
        frac = np.arange(1, ttft.size + 1) / ttft.size
        med = float(np.median(ttft))
        med_text = f"{med * 1000:.0f} ms" if med < 1 else f"{med:.2f} s"
        ax.step(ttft, frac, where="post", label=f"c={lv['concurrency']} (median {med_text})")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_compare(runs: Sequence[tuple[str, Sequence[dict]]], comparisons: Sequence[dict],
                 path: str | Path) -> Path:
    """Top: every run's interactivity-vs-throughput curve. Bottom: each run's interactivity ratio to
    the baseline (the first run) at the baseline's throughput points."""
    fig, (ax, ax_ratio) = plt.subplots(2, 1, figsize=(7.5, 8.0), gridspec_kw={"height_ratios": [3, 1.4]},
                                       sharex=True)
    colors = {}
    for label, levels in runs:
        pts = _curve(levels)
        if pts:
            line, = ax.plot([p["throughput_per_gpu"] for p in pts], [p["interactivity"] for p in pts], "o-",
                            label=label)
            colors[label] = line.get_color()
    for c in comparisons:
        xs = [p["throughput_per_gpu"] for p in c["points"]]
        ys = [p["ratio"] for p in c["points"]]
        ax_ratio.plot(xs, ys, "s--", color=colors.get(c["label"]), label=f"{c['label']} / {c['baseline']}")
        for x, y in zip(xs, ys):
            ax_ratio.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=8)
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("interactivity (tokens/s per user)")
    ax.set_title("Interactivity vs throughput per GPU")
    ax_ratio.set_xlabel("throughput per GPU (input + output tokens/s/GPU)")
    ax_ratio.set_ylabel("ratio at equal\nthroughput")
    for a in (ax, ax_ratio):
        a.grid(True, alpha=0.3)
        if a.lines:
            a.legend(loc="best", fontsize=8)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
