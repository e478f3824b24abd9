"""What `pdserve bench load` checks besides latency: streamed tokens against the offline engine, KV
blocks left in use after the load drained, and the resident memory of every service process.

    RssSampler(processes).start() ... .stop()   VmRSS of each service (its process tree), once a second
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

    def median(self, t0: float, t1: float) -> dict[str, float]:
        """Per process, the median sample taken in [t0, t1] (0 when none was)."""
        window = [s for ts, s in self.samples if t0 <= ts <= t1]
        return {n: statistics.median(s[n] for s in window) if window else 0.0 for n in self.processes}


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


def wait_blocks_freed(redis_url: str, timeout_s: float = 30.0) -> dict[str, int]:
    """Poll until no engine holds a block (frees after a stream ends are asynchronous: lease release,
    offload completion); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = blocks_in_use(redis_url)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
