"""The figures of `pdserve bench restart`, from what the client saw and when each service went down and came back
(pure functions: no I/O, no clock).

    Restart          one service's stop and start: signal, exit, start again, registered again
    check_streams    each stream against the undisturbed greedy reference: errors, lost / duplicated / different
    timeline         output tokens per second over the run, from chunk arrivals
    dips             per restart: throughput while the service was away against the steady rate
    ttft_split       TTFT of requests started while a service was away against the steady windows
    migrated         the router's migration log lines -> per request: tokens streamed before the move
    migration_delay  the stall a migration put into a stream: the gap at the move less the stream's usual gap
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.serving.metrics import percentile
from bench.serving.restart_workload import Stream, Turn


@dataclass
class Restart:
    """One service's restart; times are perf_counter seconds like the streams'."""

    mode: str  # "term" (SIGTERM: it drains) or "kill" (SIGKILL)
    service: str  # the process and instance name, e.g. decode-1
    t_signal: float
    t_exited: float = 0.0
    exit_code: int | None = None
    t_ready: float = 0.0  # serving and registered again
    migrations: float = 0.0  # pdserve:request_migrations_total moved by this much from signal to settled

    @property
    def window(self) -> tuple[float, float]:
        return self.t_signal, self.t_ready


def overlaps(s: Stream, window: tuple[float, float]) -> bool:
    return s.t_start <= window[1] and s.t_end >= window[0]


# ---- correctness ----------------------------------------------------------------------------------------

def check_streams(streams: Sequence[Stream], turns: dict[tuple[int, int], Turn]) -> dict:
    """Every stream against its turn's reference: client-visible errors, tokens missing from or repeated in
    a stream (its length against max_tokens), streams whose ids or text differ from the reference."""
    errors, differ = [], []
    lost = duplicated = text_only = 0
    for s in streams:
        if s.error:
            errors.append({"req_id": s.req_id, "error": s.error, "tokens_received": len(s.token_ids)})
            continue
        want = turns[s.session, s.turn]
        lost += max(len(want.want_ids) - len(s.token_ids), 0)
        duplicated += max(len(s.token_ids) - len(want.want_ids), 0)
        if s.token_ids != want.want_ids:
            first = next((i for i, (a, b) in enumerate(zip(s.token_ids, want.want_ids)) if a != b),
                         min(len(s.token_ids), len(want.want_ids)))
            differ.append({"req_id": s.req_id, "first_difference": first, "got": s.token_ids,
                           "want": want.want_ids})
        elif s.text != want.want_text:
            text_only += 1
            differ.append({"req_id": s.req_id, "text_got": s.text, "text_want": want.want_text})
    return {"streams": len(streams), "errors": len(errors), "lost_tokens": lost, "duplicated_tokens": duplicated,
            "different_streams": len(differ), "text_only_differences": text_only,
            "error_list": errors[:20], "differences": differ[:10]}


# ---- throughput ---------------------------------------------------------------------------------------------

def timeline(streams: Sequence[Stream], t0: float, t1: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from t0 to t1 (chunk arrivals)."""
    bins = [0.0] * max(int((t1 - t0) / bin_s + 0.999), 1)
    for s in streams:
        for t, n in s.chunks:
            i = int((t - t0) / bin_s)
            if 0 <= i < len(bins):
                bins[i] += n / bin_s
    return bins


def rate(bins: Sequence[float], t0: float, window: tuple[float, float], bin_s: float = 1.0) -> float:
    """Mean tokens/s over the whole bins inside `window`."""
    lo, hi = int((window[0] - t0) / bin_s + 0.999), int((window[1] - t0) / bin_s)
    inside = bins[max(lo, 0):max(hi, 0)]
    return sum(inside) / len(inside) if inside else 0.0


def lowest(bins: Sequence[float], t0: float, window: tuple[float, float], span: int = 5, bin_s: float = 1.0) -> float:
    """The lowest `span`-bin moving average that starts inside `window` (the depth of a dip)."""
    lo, hi = max(int((window[0] - t0) / bin_s), 0), int((window[1] - t0) / bin_s)
    means = [sum(bins[i:i + span]) / span for i in range(lo, min(hi, len(bins) - span) + 1)]
    return min(means) if means else 0.0


def dips(bins: Sequence[float], t0: float, restarts: Sequence[Restart], steady_rate: float) -> list[dict]:
    out = []
    for r in restarts:
        mean = rate(bins, t0, r.window)
        out.append({"mode": r.mode, "service": r.service, "away_s": round(r.t_ready - r.t_signal, 1),
                    "drain_s": round(r.t_exited - r.t_signal, 1), "exit_code": r.exit_code,
                    "tok_s": round(mean, 1), "lowest_5s_tok_s": round(lowest(bins, t0, r.window), 1),
                    "of_steady": round(mean / steady_rate, 3) if steady_rate else None,
                    "migrations": r.migrations})
    return out


# ---- latency ----------------------------------------------------------------------------------------------

def _started_in(s: Stream, windows: Sequence[tuple[float, float]]) -> bool:
    return any(a <= s.t_start < b for a, b in windows)


def ttft_stats(streams: Sequence[Stream]) -> dict:
    ttft = [(s.t_first - s.t_start) * 1000 for s in streams if not s.error and s.t_first]
    return {"requests": len(ttft), **{f"p{q}_ttft_ms": _round(percentile(ttft, q)) for q in (50, 90, 99)}}


def ttft_split(streams: Sequence[Stream], restarts: Sequence[Restart], steady: Sequence[tuple[float, float]]) -> dict:
    """TTFT of the requests started while some service was away (signal -> registered again) against those
    started in the steady windows (no restart in them, after warm-up)."""
    away = [r.window for r in restarts]
    return {"restarting": ttft_stats([s for s in streams if _started_in(s, away)]),
            "steady": ttft_stats([s for s in streams if _started_in(s, steady)])}


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


# ---- migrations -------------------------------------------------------------------------------------------

_MIGRATED = re.compile(r"cmpl-(?P<id>[A-Za-z0-9]+)-[0-9a-f]{8}-\d+: (?P<why>.*); migrating with (?P<n>\d+) tokens")


def migrated(router_log: str) -> dict[str, list[dict]]:
    """{client request id: [{"streamed": tokens before the move, "why": ...}, ...]} from the router's
    `migrating with N tokens streamed` warnings (requests sent with an X-Request-Id of [A-Za-z0-9]+)."""
    out: dict[str, list[dict]] = {}
    for m in _MIGRATED.finditer(router_log):
        out.setdefault(m["id"], []).append({"streamed": int(m["n"]), "why": m["why"][:200]})
    return out


def migration_delay(s: Stream, streamed: int) -> float | None:
    """Seconds a migration added to a stream: the gap between the chunk that ended with token `streamed` and
    the next chunk, less the median of the stream's other gaps. None when the stream has no such boundary."""
    gaps, at, count = [], None, 0
    for (t_a, n), (t_b, _) in zip(s.chunks, s.chunks[1:]):
        count += n
        if count == streamed and at is None:
            at = t_b - t_a
        else:
            gaps.append(t_b - t_a)
    if at is None:
        return None
    return at - (statistics.median(gaps) if gaps else 0.0)


def migration_report(streams: Sequence[Stream], moves: dict[str, list[dict]]) -> dict:
    by_id = {s.req_id: s for s in streams}
    delays = []
    for req_id, ms in moves.items():
        s = by_id.get(req_id)
        if s is not None and len(ms) == 1:
            d = migration_delay(s, ms[0]["streamed"])
            if d is not None:
                delays.append(d * 1000)
    return {"migrated_requests": len(moves), "moves": sum(len(m) for m in moves.values()),
            "added_ms": {"measured": len(delays), **{f"p{q}": _round(percentile(delays, q)) for q in (50, 90)},
                         "max": _round(max(delays, default=None))}}


# ---- the summary table -----------------------------------------------------------------------------------

def format_summary(result: dict) -> str:
    c = result["check"]
    lines = [f"all    {c['streams']} requests: {c['errors']} errors, {c['lost_tokens']} lost and "
             f"{c['duplicated_tokens']} duplicated tokens, {c['different_streams']} streams differ from the reference",
             "mode   errors  lost  dup  differ  migrations  tok/s away/steady  TTFT p50/p90 s away   steady"]
    for mode, m in result["modes"].items():
        c, t = m["check"], m["ttft"]
        lines.append(f"{mode:6s} {c['errors']:6d} {c['lost_tokens']:5d} {c['duplicated_tokens']:4d} "
                     f"{c['different_streams']:7d} {m['migrations']:11.0f}  {m['tok_s_away']:6.1f} / "
                     f"{result['steady_tok_s']:6.1f}   {_s(t['restarting'])}  {_s(t['steady'])}")
    lines.append("restart          away s  drain s  exit  tok/s  lowest 5 s  migrations  prefill retries")
    for d in result["restarts"]:
        lines.append(f"{d['mode']:4s} {d['service']:11s} {d['away_s']:6.1f} {d['drain_s']:8.1f} "
                     f"{str(d['exit_code']):>5s} {d['tok_s']:6.1f} {d['lowest_5s_tok_s']:10.1f} "
                     f"{d['migrations']:11.0f}  {d.get('prefill_retries', '-'):>15}")
    if result.get("failure"):
        lines.append(f"schedule stopped early: {result['failure']}")
    for d in result.get("diagnosis") or ():
        lines.append(_diagnosis_line(d))
    mig = result["migrated"]["added_ms"]
    lines.append(f"migrated requests {result['migrated']['migrated_requests']}: added latency p50 {mig['p50']} ms, "
                 f"p90 {mig['p90']} ms, max {mig['max']} ms ({mig['measured']} measured)")
    return "\n".join(lines)


def _s(t: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x / 1000:.2f}"
    return f"{f(t['p50_ttft_ms'])} / {f(t['p90_ttft_ms'])}"


def _diagnosis_line(d: dict) -> str:
    served, ref = d["served_token"], d["reference_token"]
    head = f"{d['prompt']} differs at token {d['position']}: served {served}, reference {ref}"
    if "diagnosis_error" in d:
        return f"{head} (not looked into: {d['diagnosis_error']})"
    logits = d["offline_logits"]
    again = ("an error" if d["replayed_error"] else "the disturbed stream's ids" if d["replayed_equals_served"] else
             "the reference" if d["replayed_equals_reference"] else "neither")
    return (f"{head}; offline logits {logits.get(str(served))} vs {logits.get(str(ref))}; "
            f"served again undisturbed: {again}")
