"""Timing and ceilings for kernel benchmarks (CUDA events; see the device notes on measuring).

* `ceilings()` measures the two numbers every roofline here is against: device-to-device copy bandwidth
  (bytes read + written) and the bf16 matmul rate on random 8192^3 operands.
* `time_rotating(calls)` captures `calls` (one per input set, enough sets that their data outgrows L2)
  in one CUDA graph and returns the median time of one call over replays: no launch gaps, no cache reuse
  between consecutive calls. `time_plain(fn)` is `triton.testing.do_bench` (flushes L2 before each call)
  for work that cannot be captured or is long enough that launches do not matter.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_plain(fn: Callable[[], object], device: torch.device, rep_ms: int = 100) -> float:
    """Median seconds of fn (do_bench on CUDA: L2 flushed before each call; wall clock elsewhere)."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_rotating(calls: list[Callable[[], object]], device: torch.device, replays: int = 20) -> float:
    """Median seconds of one call, from CUDA-graph replays of all `calls` back to back."""
    if device.type != "cuda":
        return statistics.median(time_plain(c, device) for c in calls)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up (compiles, allocator pools) outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    sync(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def device_time(fn: Callable[[], object], device: torch.device, calls: int = 5) -> tuple[float, dict]:
    """(seconds of device work per call, {kernel name: seconds per call}) from torch.profiler over `calls`
    calls after one warm-up: the kernels' own durations, without the host's launch gaps between them (what a
    call costs inside a CUDA graph or behind a host that runs ahead). Wall clock on a CPU."""
    if device.type != "cuda":
        return time_plain(fn, device), {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    kernels: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e6 / calls
    return sum(kernels.values()), kernels


def num_sets(bytes_per_call: float, at_least: int = 2, at_most: int = 48) -> int:
    """Input sets so that one graph replay touches several times the L2 (about 50 MB on an H200)."""
    return int(min(at_most, max(at_least, -(-4 * L2_FLUSH_BYTES // 5 // max(bytes_per_call, 1)))))


def ceilings(device: torch.device) -> dict:
    """{'copy_tbps', 'bf16_tflops'} measured on this device (random data, never zeros)."""
    if device.type != "cuda":
        return {"copy_tbps": 0.01, "bf16_tflops": 0.1}
    n = 2 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t_copy = time_plain(functools.partial(b.copy_, a), device, rep_ms=200)
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = time_plain(lambda: x @ y, device, rep_ms=300)
    return {"copy_tbps": 2 * n / t_copy / 1e12, "bf16_tflops": 2 * m ** 3 / t_mm / 1e12,
            "copy_bytes": 2 * n, "matmul_n": m}


def roofline_row(name: str, seconds: float, bytes_moved: float, flops: float, ceil: dict,
                 ref_seconds: float | None = None, peak_scale: float = 1.0, **extra) -> dict:
    """One result: achieved TB/s and TFLOP/s, the floor max(bytes/BW, FLOPs/peak) and its fraction."""
    floor_compute = flops / (ceil["bf16_tflops"] * peak_scale * 1e12)
    floor = max(bytes_moved / (ceil["copy_tbps"] * 1e12), floor_compute)
    row = {"kernel": name, "us": seconds * 1e6, "tbps": bytes_moved / seconds / 1e12,
           "tflops": flops / seconds / 1e12, "floor_us": floor * 1e6, "roofline_frac": floor / seconds,
           "bytes": bytes_moved, "flops": flops,
           "bound": "memory" if bytes_moved / (ceil["copy_tbps"] * 1e12) >= floor_compute else "compute"}
    if ref_seconds is not None:
        row["ref_us"] = ref_seconds * 1e6
        row["speedup"] = ref_seconds / seconds
    row.update(extra)
    return row
