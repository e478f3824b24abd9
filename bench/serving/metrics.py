"""Benchmark metrics from a list of RequestRecords (the "event log"); pure functions, no I/O.

Definitions (per concurrency level, over the requests *started* in the measured window):

    window               [end of warm-up, max(stop time, last completion of a counted request)]
    throughput_per_gpu   (input tokens incl. prefix-cached + output tokens) / window / num_gpus
    interactivity        1 / P90_requests(e2e latency / output tokens)        tokens/s per user
    TTFT                 first streamed chunk - send;  TPOT = (e2e - TTFT) / (output tokens - 1)
    ITL                  gaps between streamed chunks (several tokens per chunk under MTP)
    prefix hit rate      sum(cached_tokens) / sum(prompt_tokens), from the server's `usage`
    error / overflow     errors / due requests and overflows / due requests (cancelled ones excluded);
                         the level is invalid above 1% overflow or 10% errors

Latency summaries use vLLM's key names (`mean_ttft_ms`, `median_ttft_ms`, `p99_ttft_ms`, ...) and
numpy's linear-interpolation percentiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from bench.serving.client import RequestRecord

MAX_OVERFLOW_RATE = 0.01
MAX_ERROR_RATE = 0.10
DEFAULT_PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def latency_stats(name: str, values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """{mean,median,std,p<q>}_<name>_ms of a list of seconds (None when the list is empty)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()) if ms.size else None,
           f"median_{name}_ms": float(np.median(ms)) if ms.size else None,
           f"std_{name}_ms": float(ms.std()) if ms.size else None}
    for q in percentiles:
        out[f"p{_fmt_q(q)}_{name}_ms"] = percentile(ms, q)
    return out


def _fmt_q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def tpot_s(rec: RequestRecord) -> float | None:
    if rec.output_tokens <= 1:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def interactivity(records: Sequence[RequestRecord], q: float = 90) -> float | None:
    """1 / P90 of per-request seconds per output token: the token rate 90% of requests beat."""
    per_token = [r.e2e_s / r.output_tokens for r in records if r.output_tokens > 0]
    p = percentile(per_token, q)
    return 1.0 / p if p else None


def prefix_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    reported = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.input_tokens for r in reported)
    return sum(r.cached_tokens for r in reported) / prompt if reported and prompt else None


@dataclass(frozen=True)
class Window:
    start: float
    end: float

    @property
    def duration_s(self) -> float:
        return self.end - self.start


def measured_window(records: Sequence[RequestRecord], t_measure: float, t_stop: float) -> Window:
    ends = [r.t_end for r in records if r.measured and r.ok]
    return Window(t_measure, max([t_stop, *ends]))


def request_counts(records: Sequence[RequestRecord]) -> dict:
    due = [r for r in records if not r.cancelled]
    num_errors = sum(r.error is not None for r in due)
    num_overflow = sum(r.overflow for r in due)
    return {"num_requests": len(due), "completed": sum(r.ok for r in due), "num_errors": num_errors,
            "num_overflow": num_overflow, "num_cancelled": len(records) - len(due),
            "error_rate": num_errors / len(due) if due else 0.0,
            "overflow_rate": num_overflow / len(due) if due else 0.0}


def validity(counts: dict) -> list[str]:
    """Reasons the level is invalid (empty list: valid)."""
    reasons = []
    if counts["overflow_rate"] > MAX_OVERFLOW_RATE:
        reasons.append(f"overflow rate {counts['overflow_rate']:.1%} > {MAX_OVERFLOW_RATE:.0%}")
    if counts["error_rate"] > MAX_ERROR_RATE:
        reasons.append(f"error rate {counts['error_rate']:.1%} > {MAX_ERROR_RATE:.0%}")
    if counts["completed"] == 0:
        reasons.append("no request completed in the measured window")
    return reasons


def summarize(records: Sequence[RequestRecord], window: Window, *, num_gpus: int = 1,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """Every metric of one level (or one `bench serve` run) from its measured records."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    measured = [r for r in records if r.measured]
    ok = [r for r in measured if r.ok]
    counts = request_counts(measured)
    duration = window.duration_s
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    percentiles = tuple(percentiles)
    out = {**counts, "duration": duration, "num_gpus": num_gpus,
           "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration if duration > 0 else 0.0,
           "input_throughput": n_in / duration if duration > 0 else 0.0,
           "output_throughput": n_out / duration if duration > 0 else 0.0,
           "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
           "throughput_per_gpu": (n_in + n_out) / duration / num_gpus if duration > 0 else 0.0,
           "interactivity": interactivity(ok),
           "prefix_cache_hit_rate": prefix_hit_rate(ok)}
    out.update(latency_stats("ttft", [r.ttft_s for r in ok], percentiles))
    out.update(latency_stats("tpot", [t for t in map(tpot_s, ok) if t is not None], percentiles))
    out.update(latency_stats("itl", [x for r in ok for x in r.itl_s], percentiles))
    # the ITL in two: the first gap (prefill's first token to the decode's first output, across the KV handoff)
    # and the decode's own gaps after it; the TPOT of short outputs is much of the first
    out.update(latency_stats("handoff", [r.itl_s[0] for r in ok if r.itl_s], percentiles))
    out.update(latency_stats("decode_itl", [x for r in ok for x in r.itl_s[1:]], percentiles))
    out.update(latency_stats("e2el", [r.e2e_s for r in ok], percentiles))
    reasons = validity(counts)
    out["valid"], out["invalid_reasons"] = not reasons, reasons
    return out


def goodput(records: Sequence[RequestRecord], window: Window, slo_ms: dict[str, float]) -> float:
    """Requests/s that met every SLO in `slo_ms` (keys ttft, tpot, e2el), as vLLM's `request_goodput`."""
    bad = set(slo_ms) - {"ttft", "tpot", "e2el"}
    if bad:
        raise ValueError(f"goodput SLOs may be ttft, tpot, e2el; got {sorted(bad)}")
    good = 0
    for r in records:
        if not (r.measured and r.ok):
            continue
        values = {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.e2e_s}
        good += all(values[k] * 1000.0 <= v for k, v in slo_ms.items())
    return good / window.duration_s if window.duration_s > 0 else 0.0
