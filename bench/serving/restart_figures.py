"""What `pdserve bench restart` writes to result.json, assembled from the streams the client saw, the schedule
of restarts and the services' logs: the checks and figures of the whole run and of each mode, the restarts'
dips, the incidents (each failed or different stream with the log lines around it), a row per request."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.serving import restart_control as control
from bench.serving import restart_report as report
from bench.serving.restart_workload import Stream


@dataclass
class Schedule:
    """When things happened (perf_counter seconds): the load's start, the steady windows, the restarts."""

    t0: float
    steady: list[tuple[float, float]] = field(default_factory=list)
    restarts: list[report.Restart] = field(default_factory=list)
    t_stop: float = 0.0  # no request started after this
    failure: str = ""  # why the schedule stopped early (a service that did not come back): reported, not raised


def figures(streams: list[Stream], turns: dict, s: Schedule, logs: dict[str, str], modes: Sequence[str],
            settle_s: float) -> dict:
    """Everything result.json holds about the run, from the streams, the schedule and the services' logs."""
    t_end = max([x.t_end for x in streams] + [s.t_stop])
    bins = report.timeline(streams, s.t0, t_end)
    steady_rate = _mean_rate(bins, s.t0, s.steady)
    moves = report.migrated(logs.get(_router_name(logs), ""))
    by_mode = {}
    for mode in modes:
        rs = [r for r in s.restarts if r.mode == mode]
        if not rs:
            continue
        window = (rs[0].t_signal, rs[-1].t_ready + settle_s)
        mine = [x for x in streams if report.overlaps(x, window)]
        by_mode[mode] = {"window_s": _rel(window, s.t0), "check": report.check_streams(mine, turns),
                         "migrations": sum(r.migrations for r in rs),
                         "tok_s_away": round(_mean_rate(bins, s.t0, [r.window for r in rs]), 1),
                         "ttft": report.ttft_split(streams, rs, s.steady),
                         "migrated": report.migration_report(mine, {k: v for k, v in moves.items()
                                                                    if any(x.req_id == k for x in mine)})}
    out = {"machine": machine(), "failure": s.failure, "duration_s": round(t_end - s.t0, 1),
           "requests": len(streams), "steady_s": [_rel(w, s.t0) for w in s.steady],
           "steady_tok_s": round(steady_rate, 1), "steady_ttft": report.ttft_stats(
               [x for x in streams if any(a <= x.t_start < b for a, b in s.steady)]),
           "modes": by_mode, "restarts": report.dips(bins, s.t0, s.restarts, steady_rate),
           "restart_times_s": [{**asdict(r), **{k: round(getattr(r, k) - s.t0, 2) for k in
                                                ("t_signal", "t_exited", "t_ready")}} for r in s.restarts],
           "check": report.check_streams(streams, turns), "migrated": report.migration_report(streams, moves),
           "tok_s_per_second": [round(b, 1) for b in bins]}
    for row, n in zip(out["restarts"], prefill_retries(logs.get(_router_name(logs), ""), s, settle_s)):
        row["prefill_retries"] = n
    out["incidents"] = incidents(out["check"], streams, s, logs)
    out["per_request"] = per_request(streams, turns, s.t0)
    return out


def per_request(streams: list[Stream], turns: dict, t0: float) -> dict:
    """One row per request: when it ran (seconds from the load's start), what came back, whether it equals the
    reference."""
    cols = ["req_id", "worker", "t_start", "ttft_s", "e2e_s", "tokens", "equal", "error"]
    rows = [[x.req_id, x.worker, round(x.t_start - t0, 3), round(x.t_first - x.t_start, 3) if x.t_first else None,
             round(x.t_end - x.t_start, 3), len(x.token_ids),
             not x.error and x.token_ids == turns[x.session, x.turn].want_ids, x.error] for x in streams]
    return {"columns": cols, "rows": rows}


def prefill_retries(router_log: str, s: Schedule, settle_s: float) -> list[int]:
    """Per restart, the prefill calls the router sent to another prefill because theirs was unavailable (its
    `trying another` lines from the signal to the end of the settle): a prefill's failures are retried, not
    migrated, and the migration counter does not see them."""
    wall = time.time() - time.perf_counter()
    return [sum("; trying another" in line for line in
                control.lines_between(router_log, r.t_signal + wall, r.t_ready + settle_s + wall, limit=1 << 30))
            for r in s.restarts]


def _mean_rate(bins, t0: float, windows) -> float:
    spans = [(b - a, report.rate(bins, t0, (a, b))) for a, b in windows]
    total = sum(d for d, _ in spans)
    return sum(d * r for d, r in spans) / total if total else 0.0


def _rel(window: tuple[float, float], t0: float) -> list[float]:
    return [round(window[0] - t0, 1), round(window[1] - t0, 1)]


def _router_name(logs: dict[str, str]) -> str:
    return next((n for n in logs if n.startswith("router")), "")


def incidents(check: dict, streams: list[Stream], s: Schedule, logs: dict[str, str]) -> list[dict]:
    """For every failed or different stream: when it ran, the restarts it overlapped, how many streams of the same
    prompt that overlapped no restart streamed the same ids (a difference they share is not the restarts'
    doing), the router's lines naming it and the lines the restarted services logged while it ran."""
    by_id = {x.req_id: x for x in streams}
    wall = time.time() - time.perf_counter()
    out = []
    for item in check["error_list"] + check["differences"]:
        x = by_id[item["req_id"]]
        during = [r for r in s.restarts if report.overlaps(x, r.window)]
        lines = {r.service: control.lines_between(logs.get(r.service, ""), x.t_start + wall - 1, x.t_end + wall + 1)
                 for r in during}
        calm = [y.token_ids for y in streams if (y.session, y.turn) == (x.session, x.turn) and not y.error
                and not any(report.overlaps(y, r.window) for r in s.restarts)]
        out.append({"req_id": x.req_id, "error": x.error, "t_s": _rel((x.t_start, x.t_end), s.t0),
                    "restarts": [f"{r.mode} {r.service}" for r in during],
                    "without_a_restart": len(calm),
                    "same_ids_without_a_restart": sum(ids == x.token_ids for ids in calm),
                    "router_lines": control.lines_naming(logs.get(_router_name(logs), ""), f"cmpl-{x.req_id}-"),
                    "service_lines": lines})
    return out


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}
