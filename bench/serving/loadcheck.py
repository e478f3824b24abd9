"""What `pdserve bench load` checks besides latency: streamed tokens against the offline engine, KV
blocks left in use after the load drained, and the resident memory of every service process.

    RssSampler(processes).start() ... .stop()   VmRSS of each service (its process tree), once a second
    SteadyState(workers, ...)                   when the load is past warm-up, by completed requests
    memory_growth(samples, windows)             median RSS per window and its growth; memory_violations
    offline_reference(model, prompts, n, dtype) greedy ids of each prompt from engine.LLM
    compare_tokens(pairs, reference)            lost / duplicated / different tokens per stream
    blocks_in_use(redis_url)                    {instance: blocks} of every prefill and decode engine
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PAGE_KIB = 1024


# ---- resident memory ---------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            pass
    return out


def _rss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and all its descendants, in MiB (0 when it is gone)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss_kib(p)
        todo += _children(p)
    return total / PAGE_KIB


@dataclass
class RssSampler:
    """Samples `{name: pid}` every `period_s` on a daemon thread: samples = [(t, {name: MiB})]."""

    processes: dict[str, int]
    period_s: float = 1.0
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), {n: tree_rss_mib(p) for n, p in self.processes.items()}))
            if self._stop.wait(self.period_s):
                return

    def peak(self, t0: float = float("-inf"), t1: float = float("inf")) -> dict[str, float]:
        """Per process, the largest sample taken in [t0, t1] (0 when none was)."""
        window = [s for ts, s in self.samples if t0 <= ts <= t1]
        return {n: max((s[n] for s in window), default=0.0) for n in self.processes}


# ---- the steady state, by events -----------------------------------------------------------------------

@dataclass
class SteadyState:
    """When a closed-loop load is in its steady state, decided by completed requests, never by seconds: a
    machine several times slower than usual can spend a whole minute in the first wave of prefills (pools,
    caches and the batch's working set still filling), and windows cut by wall time then compare warm-up
    with warm-up.

    It opens once every worker has completed `warmup_per_worker` requests; the completions after that are
    the steady ones, and the two memory windows are their first and second halves (by count). It is
    `ready` once each half holds `window_requests` completions: with one request per stream in a window,
    both windows see the same mix of batch compositions.

        worker 0  ──req──┤ ──req──┤ ──req──┤ ...
        worker N  ────req─────┤ ──req──┤ ...
                              ▲ t_open  |<- first half ->|<- second half ->| t_stop (then the drain)
    """

    num_workers: int
    warmup_per_worker: int = 1
    window_requests: int = 1
    t_open: float | None = None  # when the last worker completed its warm-up requests
    ends: list[float] = field(default_factory=list)  # completion times after t_open

    def __post_init__(self):
        if self.num_workers < 1 or self.warmup_per_worker < 1 or self.window_requests < 1:
            raise ValueError("need num_workers, warmup_per_worker and window_requests >= 1")
        self._completed = [0] * self.num_workers
        self._warming = self.num_workers

    def completed(self, worker: int, t_end: float) -> None:
        """Worker `worker` completed a request at `t_end` (only successful requests count)."""
        if self.t_open is not None:
            self.ends.append(t_end)
            return
        self._completed[worker] += 1
        if self._completed[worker] == self.warmup_per_worker:
            self._warming -= 1
            if self._warming == 0:
                self.t_open = t_end

    @property
    def ready(self) -> bool:
        return len(self.ends) >= 2 * self.window_requests

    def windows(self, t_stop: float = float("inf")) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """(first half, second half) of the steady completions up to `t_stop` (the drain after it runs with
        fewer streams: not steady), as time spans; None while fewer than 2 x `window_requests` completed."""
        ends = sorted(t for t in self.ends if t <= t_stop)
        if self.t_open is None or len(ends) < 2 * self.window_requests:
            return None
        mid = ends[len(ends) // 2 - 1]
        return (self.t_open, mid), (mid, ends[-1])

    def describe(self, t0: float, t_stop: float = float("inf")) -> dict:
        """The windows for a report: seconds from `t0`, completions in each (or why there are none)."""
        ends = sorted(t for t in self.ends if t <= t_stop)
        spans = self.windows(t_stop)
        if spans is None:
            why = ("not every worker completed its warm-up requests" if self.t_open is None else
                   f"{len(ends)} requests completed after warm-up, {2 * self.window_requests} needed")
            return {"measured": False, "why": why}
        (a0, a1), (_, b1) = spans
        first = sum(1 for t in ends if t <= a1)
        return {"measured": True, "opened_s": round(a0 - t0, 1), "first_s": [round(a0 - t0, 1), round(a1 - t0, 1)],
                "second_s": [round(a1 - t0, 1), round(b1 - t0, 1)], "requests": [first, len(ends) - first]}


MIN_WINDOW_SAMPLES = 3  # a median of fewer RSS samples is one batch's activations, not the retained memory


def memory_growth(samples: list[tuple[float, dict[str, float]]],
                  windows: tuple[tuple[float, float], tuple[float, float]]) -> dict[str, dict]:
    """Per process: the median RSS over each window, and the growth from the first to the second. Medians,
    not single samples or peaks: a batch's activations move RSS by ~100 MiB for a second."""
    (a0, a1), (b0, b1) = windows
    first = [s for t, s in samples if a0 <= t <= a1]
    second = [s for t, s in samples if b0 <= t <= b1]
    out = {}
    for name in (samples[0][1] if samples else {}):
        m1 = statistics.median(s[name] for s in first) if first else 0.0
        m2 = statistics.median(s[name] for s in second) if second else 0.0
        out[name] = {"first_window_median_mib": round(m1, 1), "second_window_median_mib": round(m2, 1),
                     "growth_mib": round(m2 - m1, 1), "growth_frac": round((m2 - m1) / m1, 4) if m1 else None,
                     "samples": [len(first), len(second)]}
    return out


def memory_violations(growth: dict[str, dict], growth_mib: float, growth_frac: float) -> list[str]:
    """What breaks "flat after warm-up": a process whose median RSS grew from the first steady window to the
    second by more than max(`growth_mib`, `growth_frac` x its first median), or whose windows hold too few
    samples to say. Empty when flat."""
    bad = []
    for name, m in growth.items():
        if min(m["samples"]) < MIN_WINDOW_SAMPLES:
            bad.append(f"{name}: RSS samples per window {m['samples']}, at least {MIN_WINDOW_SAMPLES} needed")
            continue
        if not m["first_window_median_mib"] > 0:
            bad.append(f"{name}: no resident memory in the first window (the process was gone)")
            continue
        bound = max(growth_mib, growth_frac * m["first_window_median_mib"])
        if m["growth_mib"] > bound:
            bad.append(f"{name}: RSS grew {m['growth_mib']:+.1f} MiB after warm-up (bound {bound:.0f} MiB)")
    return bad


# ---- correctness against the offline engine -----------------------------------------------------------

def offline_reference(model: str, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str) -> list[list[int]]:
    """Greedy output ids of every prompt (ignore_eos, `max_tokens` each). A shorter greedy request's
    output is a prefix of this, so one reference per prompt serves every max_tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, num_blocks=max(256, 4 * len(prompts)))
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def compare_tokens(streams: list[tuple[int, int, list[int]]], reference: list[list[int]]) -> dict:
    """streams: (prompt index, max_tokens, streamed ids). Counts tokens missing from or repeated in
    a stream (length against max_tokens) and streams whose ids differ from the reference's prefix."""
    lost = duplicated = 0
    mismatched: list[dict] = []
    for prompt_idx, max_tokens, got in streams:
        want = reference[prompt_idx][:max_tokens]
        lost += max(len(want) - len(got), 0)
        duplicated += max(len(got) - len(want), 0)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatched.append({"prompt": prompt_idx, "max_tokens": max_tokens, "first_difference": first,
                               "got": got, "want": want})
    return {"streams_checked": len(streams), "lost_tokens": lost, "duplicated_tokens": duplicated,
            "mismatched_streams": len(mismatched), "mismatches": mismatched[:10]}


# ---- KV blocks after the drain ------------------------------------------------------------------------

def _gauge(metrics_address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    if m is None:
        raise ValueError(f"{metrics_address}/metrics has no {name}")
    return float(m.group(1))


def blocks_in_use(redis_url: str) -> dict[str, int]:
    """{instance id: KV blocks held} for every registered prefill and decode engine (usage x pool size;
    prefix-cached blocks nobody holds count as free)."""
    from services.cluster.redis_state import registered_instances

    out = {}
    for inst in registered_instances(redis_url):
        if inst.role in ("prefill", "decode"):
            usage = _gauge(inst.metrics_address, "pdserve:kv_cache_usage_perc")
            out[inst.instance_id] = round(usage * float(inst.capacity["num_blocks"]))
    return out


def wait_blocks_freed(redis_url: str, timeout_s: float = 120.0) -> dict[str, int]:
    """Poll until no engine holds a block (frees after a stream ends are asynchronous: lease release,
    offload completion); returns the last reading. The deadline is generous (a loaded machine may take
    a while): it only bounds how long a real leak takes to report."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = blocks_in_use(redis_url)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
