"""Result files shared by `bench agentx`, `bench serve` and `bench compare`: JSON, CSV, console table."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# CSV / table columns in reading order; any other scalar metric follows, sorted
LEADING_COLUMNS = ("concurrency", "valid", "throughput_per_gpu", "interactivity", "median_ttft_ms",
                   "p90_ttft_ms", "median_tpot_ms", "prefix_cache_hit_rate", "error_rate", "overflow_rate",
                   "num_requests", "completed", "duration")
TABLE_COLUMNS = (("concurrency", "conc", "{:d}"), ("throughput_per_gpu", "tok/s/GPU", "{:.1f}"),
                 ("interactivity", "tok/s/user", "{:.2f}"), ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"),
                 ("p90_ttft_ms", "TTFT p90 ms", "{:.0f}"), ("median_tpot_ms", "TPOT p50 ms", "{:.1f}"),
                 ("prefix_cache_hit_rate", "hit rate", "{:.1%}"), ("error_rate", "errors", "{:.1%}"),
                 ("overflow_rate", "overflow", "{:.1%}"), ("completed", "done", "{:d}"), ("valid", "valid", "{}"))


def _clean(x: Any) -> Any:
    """NaN/inf -> None so the JSON stays standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(obj: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=1) + "\n")
    return path


def scalar_columns(levels: Sequence[dict]) -> list[str]:
    keys = {k for lv in levels for k, v in lv.items() if v is None or isinstance(v, (int, float, str, bool))}
    lead = [k for k in LEADING_COLUMNS if k in keys]
    return lead + sorted(keys - set(lead))


def write_csv(levels: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = scalar_columns(levels)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for lv in levels:
            w.writerow({k: ("" if lv.get(k) is None else lv.get(k)) for k in cols})
    return path


def load_result(path: str | Path) -> dict:
    """A result JSON of `bench agentx` (or a compatible run): checks the fields compare needs."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read result {path}: {e}") from e
    levels = data.get("levels")
    if not isinstance(levels, list) or not levels:
        raise ValueError(f"{path} has no 'levels' list: is it a `pdserve bench agentx` result.json?")
    for lv in levels:
        for key in ("concurrency", "throughput_per_gpu", "interactivity"):
            if key not in lv:
                raise ValueError(f"{path}: a level lacks {key!r}")
    data.setdefault("label", path.parent.name or path.stem)
    return data


def format_table(levels: Sequence[dict]) -> str:
    header = [title for _, title, _ in TABLE_COLUMNS]
    rows = [[_fmt(lv.get(key), fmt) for key, _, fmt in TABLE_COLUMNS] for lv in levels]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)
