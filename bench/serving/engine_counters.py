"""Counters of the running engines (prefill and decode instances), read from their metrics endpoints.

A benchmark that started the services (`--fresh-server`, `bench.serving.cold_start`) knows the deployment's Redis,
whose instance registry names every engine's metrics address; a level's figure is the difference of two reads.
"""

from __future__ import annotations

import re
import urllib.request

STEP_COUNTERS = ("pdserve:engine_steps_total", "pdserve:engine_step_seconds_total")
MTP_COUNTERS = ("pdserve:spec_decode_num_full_rounds_total", "pdserve:spec_decode_num_full_round_tokens_total")
# the engines' step and between-steps histograms (services/rpc/metrics.py, STEP_BUCKETS): (series, short name)
STEP_HISTOGRAMS = (("pdserve:engine_step_duration_seconds_bucket", "step"),
                   ("pdserve:engine_step_gap_seconds_bucket", "gap"))
# what `server_side` reads from every service: engine steps, their phases and their spread, the TTFT / TPOT / delta
# histograms
SERVER_COUNTERS = ("pdserve:engine_steps_total", "pdserve:engine_step_seconds_total",
                   "pdserve:engine_step_phase_seconds_total", "pdserve:engine_step_phase_cpu_seconds_total",
                   "pdserve:time_per_output_token_seconds_sum", "pdserve:time_per_output_token_seconds_count",
                   "pdserve:time_to_first_token_seconds_sum", "pdserve:time_to_first_token_seconds_count",
                   "pdserve:token_delta_delay_seconds_sum", "pdserve:token_delta_delay_seconds_count",
                   "pdserve:nixl_bytes_transferred_total", *(h for h, _ in STEP_HISTOGRAMS))
PHASES = ("schedule", "launch", "device_wait", "read_back", "update")  # engine.core.core.STEP_PHASES
CPU_PHASES = ("schedule", "launch", "update")  # engine.core.core.CPU_PHASES
# kept with their labels
LABELLED = ("pdserve:engine_step_phase_seconds_total", "pdserve:engine_step_phase_cpu_seconds_total",
            *(h for h, _ in STEP_HISTOGRAMS))


def engine_counters(redis_url: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """{role: {counter: value summed over that role's instances}} for the registered prefill and decode engines
    (a counter an instance does not export counts 0)."""
    from services.cluster.redis_state import registered_instances  # the services' registry: only when asked

    out: dict[str, dict[str, float]] = {}
    for inst in registered_instances(redis_url):
        if inst.role not in ("prefill", "decode"):
            continue
        a = inst.metrics_address
        text = urllib.request.urlopen(a if a.startswith("http") else f"http://{a}/metrics", timeout=5).read().decode()
        got = out.setdefault(inst.role, dict.fromkeys(names, 0.0))
        for name in names:
            m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
            got[name] += float(m.group(1)) if m else 0.0
    return out


def mtp_acceptance(before: dict, after: dict) -> dict | None:
    """The decode engines' MTP acceptance length between two reads of MTP_COUNTERS (None without full rounds)."""
    b, a = before.get("decode", {}), after.get("decode", {})
    rounds = a.get(MTP_COUNTERS[0], 0.0) - b.get(MTP_COUNTERS[0], 0.0)
    tokens = a.get(MTP_COUNTERS[1], 0.0) - b.get(MTP_COUNTERS[1], 0.0)
    if rounds <= 0:
        return None
    return {"full_rounds": rounds, "tokens": tokens, "acceptance_length": tokens / rounds}


def scrape_services(redis_url: str, router_url: str) -> dict[str, dict[str, float]]:
    """{role: {counter: value}} of SERVER_COUNTERS for every registered engine and the router (its histograms).
    An engine role with several instances keeps the last one read: the one-GPU topologies have one of each."""
    from services.cluster.redis_state import registered_instances  # the services' registry: only when asked

    out = {}
    for inst in registered_instances(redis_url):
        out[inst.role] = metric_values(inst.metrics_address)
    out["router"] = metric_values(router_url.removeprefix("http://"))
    return out


def metric_values(address: str) -> dict[str, float]:
    """{name: value} of SERVER_COUNTERS at a metrics address; a labelled series is `name{labels}` (the engine
    step's phases, the step histograms' buckets)."""
    url = address if address.startswith("http") else f"http://{address}"
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    got = {}
    for m in re.finditer(r"^([^\s{#]+)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        name, labels, value = m.groups()
        if name not in SERVER_COUNTERS:
            continue
        key = name + labels if labels and name in LABELLED else name
        got.setdefault(key, float(value))
    return got


def server_side(before: dict, after: dict) -> dict:
    """Per-run means from counter deltas: engine step time, decode TPOT, prefill TTFT, NIXL bytes."""
    def delta(role: str, name: str) -> float:
        return after.get(role, {}).get(name, 0.0) - before.get(role, {}).get(name, 0.0)

    out = {}
    for role in ("prefill", "decode"):
        steps = delta(role, "pdserve:engine_steps_total")
        out[f"{role}_steps"] = steps
        out[f"{role}_mean_step_ms"] = 1e3 * delta(role, "pdserve:engine_step_seconds_total") / steps if steps else None
    n = delta("decode", "pdserve:time_per_output_token_seconds_count")
    out["decode_mean_tpot_ms"] = 1e3 * delta("decode", "pdserve:time_per_output_token_seconds_sum") / n if n else None
    n = delta("prefill", "pdserve:time_to_first_token_seconds_count")
    out["prefill_mean_ttft_ms"] = 1e3 * delta("prefill", "pdserve:time_to_first_token_seconds_sum") / n if n else None
    # a request's prefill steps: its engine steps over the requests it prefilled (a step that only hands finished
    # requests to the runner, one after most lone requests, counts in the steps but takes no time)
    out["prefill_requests"] = n
    out["prefill_step_ms_per_request"] = 1e3 * delta("prefill", "pdserve:engine_step_seconds_total") / n if n else None
    n = delta("router", "pdserve:time_to_first_token_seconds_count")
    out["router_mean_ttft_ms"] = 1e3 * delta("router", "pdserve:time_to_first_token_seconds_sum") / n if n else None
    out["nixl_pulled_bytes"] = delta("decode", "pdserve:nixl_bytes_transferred_total")
    for role in ("prefill", "decode"):
        steps = out[f"{role}_steps"]
        if steps:  # the step by phase; its host time is the step less the device wait
            phases = {p: 1e3 * delta(role, f'pdserve:engine_step_phase_seconds_total{{phase="{p}"}}') / steps
                      for p in PHASES}
            out[f"{role}_phase_ms"] = phases
            if out[f"{role}_mean_step_ms"] is not None:
                out[f"{role}_host_ms"] = out[f"{role}_mean_step_ms"] - phases["device_wait"]
            # the engine thread's CPU time in the phases it computes in (wall above it: the thread did not run)
            out[f"{role}_phase_cpu_ms"] = {
                p: 1e3 * delta(role, f'pdserve:engine_step_phase_cpu_seconds_total{{phase="{p}"}}') / steps
                for p in CPU_PHASES}
    for role in ("prefill", "decode"):  # the steps' own spread, and the engine thread's time between two steps
        for series, short in STEP_HISTOGRAMS:
            for q, v in histogram_quantiles(before.get(role, {}), after.get(role, {}), series).items():
                out[f"{role}_{short}_p{q}_ms"] = None if v is None else 1e3 * v
    for role in ("decode", "router"):  # per token delta: engine step -> gRPC sent; gRPC read -> SSE written
        n = delta(role, "pdserve:token_delta_delay_seconds_count")
        out[f"{role}_delta_delay_ms"] = 1e3 * delta(role, "pdserve:token_delta_delay_seconds_sum") / n if n else None
    return out


def histogram_buckets(before: dict[str, float], after: dict[str, float], series: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)], ascending, of a histogram's observations between two reads
    ({`series{le=...}`: cumulative count})."""
    return sorted((_le(k), after.get(k, 0.0) - before.get(k, 0.0)) for k in set(after) | set(before)
                  if k.startswith(series + "{"))


def histogram_quantiles(before: dict[str, float], after: dict[str, float], series: str,
                        qs: tuple[int, ...] = (50, 90, 99)) -> dict[int, float | None]:
    """{q: seconds} of a histogram's observations between two reads (histogram_buckets)."""
    buckets = histogram_buckets(before, after, series)
    return {q: histogram_quantile(q / 100, buckets) for q in qs}


def step_histograms(redis_url: str) -> dict[str, dict[str, float]]:
    """{role: {bucket series: cumulative count}} of the registered engines' step-duration histogram, summed over
    a role's instances."""
    from services.cluster.redis_state import registered_instances  # the services' registry: only when asked

    series = STEP_HISTOGRAMS[0][0] + "{"
    out: dict[str, dict[str, float]] = {}
    for inst in registered_instances(redis_url):
        if inst.role not in ("prefill", "decode"):
            continue
        got = out.setdefault(inst.role, {})
        for k, v in metric_values(inst.metrics_address).items():
            if k.startswith(series):
                got[k] = got.get(k, 0.0) + v
    return out


def _le(series: str) -> float:
    """The upper bound of a histogram bucket's series, `name{le="0.005"}`."""
    return float(re.search(r'le="([^"]+)"', series).group(1))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram from its cumulative buckets [(upper bound, count)], ascending, as Prometheus's
    histogram_quantile: linear within the bucket the rank falls in (from 0 for the first); in the +Inf bucket, the
    largest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lo, below = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((rank - below) / (count - below) if count > below else 1.0)
        lo, below = le, count
    return lo
