"""`pdserve bench compare A.json B.json ...`: several agentx runs on one plot, with ratios at equal
throughput.

The first run is the baseline. For every other run and every baseline level whose throughput per GPU
lies inside that run's measured range, the run's interactivity at that same throughput is read off
its curve (linear interpolation between its levels) and divided by the baseline's:

    ratio(x) = interactivity_run(x) / interactivity_baseline(x),   x = a baseline level's tok/s/GPU

> 1 means the run serves each user faster at equal load. Levels marked invalid are left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.serving import results
from bench.serving.plots import plot_compare


def curve(levels: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((lv["throughput_per_gpu"], lv["interactivity"]) for lv in levels
                 if lv.get("valid", True) and lv.get("throughput_per_gpu") and lv.get("interactivity"))
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def ratios_at_equal_throughput(baseline: list[dict], other: list[dict]) -> list[dict]:
    """[{throughput_per_gpu, baseline, other, ratio}] at the baseline's levels inside other's range."""
    bx, by = curve(baseline)
    ox, oy = curve(other)
    if len(ox) == 0:
        return []
    out = []
    for x, y in zip(bx, by):
        if ox[0] <= x <= ox[-1]:
            oi = float(np.interp(x, ox, oy))
            out.append({"throughput_per_gpu": float(x), "baseline": float(y), "other": oi, "ratio": oi / float(y)})
    return out


def compare(paths: list[str], labels: list[str] | None = None) -> dict:
    runs = [results.load_result(p) for p in paths]
    if labels:
        if len(labels) != len(runs):
            raise ValueError(f"--labels gives {len(labels)} names for {len(runs)} results")
        for run, label in zip(runs, labels):
            run["label"] = label
    base = runs[0]
    comparisons = []
    for run in runs[1:]:
        points = ratios_at_equal_throughput(base["levels"], run["levels"])
        rs = [p["ratio"] for p in points]
        comparisons.append({"label": run["label"], "baseline": base["label"], "points": points,
                            "min_ratio": min(rs) if rs else None, "max_ratio": max(rs) if rs else None})
    return {"runs": [{"label": r["label"], "path": str(p)} for r, p in zip(runs, paths)],
            "comparisons": comparisons, "_levels": [(r["label"], r["levels"]) for r in runs]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result.json files of `pdserve bench agentx`; the first is the baseline")
    p.add_argument("--labels", help="comma-separated names replacing the runs' labels")
    p.add_argument("--output", default="compare.png", help="plot path (a .json with the ratios is written next to it)")
    return p


def format_comparisons(comparisons: list[dict]) -> str:
    lines = []
    for c in comparisons:
        if not c["points"]:
            lines.append(f"{c['label']} vs {c['baseline']}: no overlapping throughput range")
            continue
        lines.append(f"{c['label']} vs {c['baseline']}: interactivity ratio at equal throughput "
                     f"{c['min_ratio']:.2f}x .. {c['max_ratio']:.2f}x")
        lines += [f"  at {p['throughput_per_gpu']:9.1f} tok/s/GPU: {p['other']:8.2f} vs {p['baseline']:8.2f} "
                  f"tok/s/user = {p['ratio']:.2f}x" for p in c["points"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = compare(args.results, args.labels.split(",") if args.labels else None)
    except ValueError as e:
        print(f"pdserve bench compare: error: {e}", file=sys.stderr)
        return 2
    plot_compare(out.pop("_levels"), out["comparisons"], args.output)
    results.write_json(out, Path(args.output).with_suffix(".json"))
    print(format_comparisons(out["comparisons"]))
    print(f"plot: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
