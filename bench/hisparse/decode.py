"""`python -m bench.hisparse --out FILE`: decode step time of a real-dimension layer stack versus context
length, for HiSparse, fully resident and offload-only KV.

    resident  the plain paged cache on the device; the inner attention backend reads selected rows in place
    hisparse  engine.hisparse with a device pool of hot buffers only: every request decodes from the host
              pool (plans, LRU, miss copies host -> device, newest rows backed up to the host)
    offload   engine.hisparse's offload-only baseline: per layer, each request's whole context comes back

Per step and layer (B requests, one decode row each): MLA projections in the absorbed form and a dense MLP
(GLM-5.3 widths, bf16 random weights; --attention-only drops them), store_kv of the new row, on each full
indexer layer (every 4th) the top-k selection, sparse MLA over top-k rows (fp8_ds_mla, 656 B). The top-k is
a synthetic stream (bench.hisparse.stack.TopkStream): random weights give an indexer no temporal locality,
so a fraction --churn of each request's selection is replaced every step; the measured hit rate is
reported. The indexer's own cost is excluded: it is the same in all three modes.

--cpu-smoke runs the same code at toy sizes on the CPU (CI checks that it runs; its times mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import torch

from bench.hisparse.run import _steps, _sync, run_case, setup_case
from bench.hisparse.stack import TopkStream, stack_config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hisparse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU (checks the script runs)")
    p.add_argument("--contexts", default="8192,131072,1048448", help="comma list of context lengths")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--modes", default="resident,hisparse,offload")
    p.add_argument("--layers", type=int, default=4, help="layers in the stack (a full indexer layer every 4th)")
    p.add_argument("--churn", default="0.1", help="fraction of each selection replaced per step; a comma list "
                   "runs hisparse once per value")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1, help="run every case this many times, interleaved, and "
                   "report the median run (offload runs once)")
    p.add_argument("--offload-steps", type=int, default=2, help="measured steps of the (slow) offload mode")
    p.add_argument("--mlp-width", type=int, default=12288, help="dense MLP width per layer (0: none)")
    p.add_argument("--attention-only", action="store_true", help="no projections or MLP: KV path only")
    p.add_argument("--max-resident-gib", type=float, default=100.0, help="skip resident runs above this")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="profile every case (host: cProfile top functions; device: torch.profiler top kernels) "
                        "into FILE")
    p.add_argument("--host-breakdown", action="store_true", help="per case, the host microseconds per step of the "
                   "step's parts and HiSparse's functions (bench.hisparse.host_timer: inclusive wall clock, "
                        "no profiler)")
    p.add_argument("--sync-debug", action="store_true", help="warn, with the stack, at every host synchronisation "
                   "inside a timed step (CUDA)")
    p.add_argument("--pair-contexts", default=None, metavar="A,B", help="paired mode: resident at context A and "
                   "HiSparse at context B stepped alternately per batch (the ratio target, host drift cancelled)")
    p.add_argument("--pair-modes", default="resident,hisparse", metavar="MA,MB", help="the two modes of paired mode "
                   "(hisparse,offload at one context: the speed-up over offload-only, drift cancelled)")
    p.add_argument("--plans-only", action="store_true", help="hit rates of the LRU plans alone (any device): "
                   "real top-k and buffer, no attention")
    if "--cpu-smoke" in (argv if argv is not None else sys.argv[1:]):  # toy defaults; explicit flags still win
        p.set_defaults(contexts="300,1100", batches="1,3", steps=3, warmup=2, offload_steps=2, mlp_width=64)
    return p.parse_args(argv)


def paired(args, device: torch.device) -> list[dict]:
    """A comparison with the host's drift cancelled: for each batch, mode A (--pair-modes, resident by default)
    at --pair-contexts' first context and mode B (hisparse) at its second are set up side by side and stepped
    alternately (A, B, A, B, ...), both with --warmup and --steps; each measured pair gives a ratio B / A,
    reported as its median next to both medians."""
    ctx_a, ctx_b = (int(c) for c in args.pair_contexts.split(","))
    mode_a, mode_b = args.pair_modes.split(",")
    if mode_a == mode_b:
        raise SystemExit(f"--pair-modes needs two different modes, got {args.pair_modes}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        a = setup_case(args, mode_a, ctx_a, batch, device, same_steps=True)
        b = setup_case(args, mode_b, ctx_b, batch, device, same_steps=True)
        gens = [_steps(args, **c["run"], as_iter=True) for c in (a, b)]
        ta, tb = [], []
        gc.collect()
        gc.disable()
        try:
            for sa, sb in zip(*gens):
                if sa[0] is not None and sb[0] is not None:
                    ta.append(sa[0])
                    tb.append(sb[0])
        finally:
            gc.enable()
        ratios = [y / x for x, y in zip(ta, tb)]
        row = {"mode": "paired", "batch": batch, "layers": args.layers, f"{mode_a}_context": ctx_a,
               f"{mode_b}_context": ctx_b, "pairs": len(ratios),
               f"{mode_a}_ms": round(statistics.median(ta) * 1e3, 3),
               f"{mode_b}_ms": round(statistics.median(tb) * 1e3, 3),
               "ratio": f"{mode_b} / {mode_a}", "ratio_median": round(statistics.median(ratios), 3),
               "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a, b, gens
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def plans_only(args, device: torch.device) -> list[dict]:
    """Steady-state hit rate and misses per step of one request's plans at GLM-5.3's top-k and buffer size
    (hardware-independent: only the LRU bookkeeping runs). H2D per step follows: misses x 656 B x layers."""
    from engine.hisparse.hot_buffer import HotBuffers
    from engine.hisparse.layout import HotLayout

    cfg = stack_config("glm-5.3", 4)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for churn in [float(c) for c in args.churn.split(",")]:
            layout = HotLayout.create(cfg.index_topk, None, 0)
            hot = HotBuffers(layout, 1, 1, device)
            stream = TopkStream(1, cfg.index_topk, churn, device, seed=0)
            hits = misses = 0
            for step in range(args.warmup + args.steps):
                S = torch.tensor([context + step], device=device)
                pos = stream.next(S).long()
                plan = hot.resolve(0, pos, torch.zeros_like(pos, dtype=torch.bool), S - 1,
                                   torch.zeros(1, dtype=torch.long, device=device))
                if step >= args.warmup:
                    hits, misses = hits + int(plan.num_hits), misses + int(plan.num_misses)
            per_step = misses / args.steps
            rows.append({"mode": "plans-only", "context": context, "churn": churn, "topk": cfg.index_topk,
                         "lru_rows": layout.lru_rows, "hit_rate": round(hits / (hits + misses), 4),
                         "misses_per_step": round(per_step, 1),
                         "glm_h2d_mb_per_step_per_request": round(per_step * 656 * 78 / 1e6, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def microbench(device: torch.device) -> dict:
    """Host -> device ceilings: one DMA copy of pinned memory, and the row-copy kernel reading it in place."""
    if device.type != "cuda":
        return {}
    from kernels.hisparse_gather import copy_rows

    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    _sync(device)
    dma = 5 * n / (time.perf_counter() - t0) / 1e9
    out = {"dma_h2d_gb_per_s": round(dma, 1)}
    rows = n // 656 // 64 * 64
    src = host[: rows * 656].view(rows // 64, 64, 656)
    dst = dev[: rows * 656].view(rows // 64, 64, 656)
    slots = torch.randperm(rows, device=device)
    try:
        copy_rows(src, slots, dst, slots)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            copy_rows(src, slots, dst, slots)
        _sync(device)
        out["row_kernel_h2d_gb_per_s_random_656B_rows"] = round(3 * rows * 656 / (time.perf_counter() - t0) / 1e9, 1)
    except (ValueError, RuntimeError) as e:  # this Triton cannot address pinned host memory
        out["row_kernel_h2d"] = f"failed: {e}"
    return out


def _table(rows: list[dict]) -> str:
    head = "| mode | context | batch | churn | step ms | ms/layer | hit rate | H2D KB/step | H2D GB/s |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lead = f"| {r['mode']} | {r['context']} | {r['batch']} | {r['churn'] if r['mode'] == 'hisparse' else ''} |"
        if "skipped" in r:
            lines.append(f"{lead} skipped: {r['skipped']} | | | | |")
            continue
        hr = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        lines.append(f"{lead} {r['step_ms']:.3f} | {r['ms_per_layer']:.4f} | {hr} | "
                     f"{r['h2d_bytes_per_step'] / 1e3:.1f} | {r['h2d_gb_per_s']} |")
    return "\n".join(lines)


def _warn_with_stack(message, category, filename, lineno, file=None, line=None):
    import traceback
    print(f"SYNC {category.__name__}: {message}\n" + "".join(traceback.format_stack(limit=8)[:-2]), file=sys.stderr)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.sync_debug:
        import warnings
        warnings.simplefilter("always")
        warnings.showwarning = _warn_with_stack
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # toy sizes: thread wake-ups cost more than the work
    if args.plans_only or args.pair_contexts:
        rows = plans_only(args, device) if args.plans_only else paired(args, device)
        with open(args.out, "w") as f:
            json.dump({"command": "python -m bench.hisparse " + " ".join(argv or []), "device": _device_name(device),
                       "torch": torch.__version__, "python": platform.python_version(), "rows": rows}, f, indent=1)
        return {"rows": rows}
    runs: dict[tuple, list[dict]] = {}
    for rep in range(args.repeat):  # the modes of one case run back to back, every repetition
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                for mode in args.modes.split(","):
                    if mode == "offload" and rep > 0:
                        continue  # seconds per step: one run is enough to see it
                    for churn in [float(c) for c in args.churn.split(",")] if mode == "hisparse" else [None]:
                        row = _profiled(args, mode, context, batch, device, churn)
                        runs.setdefault((context, batch, mode, churn), []).append(row)
                        print(json.dumps(row), flush=True)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    rows = [_median_run(r) for r in runs.values()]
    result = {"command": "python -m bench.hisparse " + " ".join(argv or []), "device": _device_name(device),
              "torch": torch.__version__, "python": platform.python_version(), "ceilings": microbench(device),
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(_table(rows))
    return result


def _median_run(runs: list[dict]) -> dict:
    """The repetition with the median step time, with every repetition's time beside it."""
    if "skipped" in runs[0]:
        return runs[0]
    row = dict(sorted(runs, key=lambda r: r["step_ms"])[(len(runs) - 1) // 2])
    row["step_ms_runs"] = [r["step_ms"] for r in runs]
    return row


def _profiled(args, mode, context, batch, device, churn) -> dict:
    """run_case, under cProfile and torch.profiler when --profile is given (the report is appended), with the
    host breakdown when --host-breakdown is."""
    if args.host_breakdown:
        from bench.hisparse.host_timer import STEP_PARTS, HostTimer

        timer = args.host_timer = HostTimer()
        for target in STEP_PARTS:
            timer.wrap(target)
        try:
            row = run_case(args, mode, context, batch, device, churn)
        finally:
            timer.restore()
            args.host_timer = None
        nsteps = args.offload_steps if mode == "offload" else args.steps
        return {**row, "host_breakdown_us": timer.per_step(nsteps)}
    if not args.profile:
        return run_case(args, mode, context, batch, device, churn)
    import cProfile
    import io
    import pstats

    act = torch.profiler.ProfilerActivity
    acts = [act.CPU] + ([act.CUDA] if device.type == "cuda" else [])
    prof = args.step_profiler = cProfile.Profile()  # enabled by _steps inside the measured steps only
    nsteps = args.offload_steps if mode == "offload" else args.steps
    tp = args.torch_profiler = torch.profiler.profile(activities=acts)  # _steps starts and stops it around the
    row = run_case(args, mode, context, batch, device, churn)           # measured steps (setup excluded)
    args.step_profiler = args.torch_profiler = None
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    kernels = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3 / nsteps
    ops = sum(1 for e in tp.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
              and e.cpu_parent is None)
    with open(args.profile, "a") as f:
        f.write(f"==== {mode} context {context} batch {batch}: {row.get('step_ms')} ms/step; per step: "
                f"{len(kernels) / nsteps:.0f} kernels, {busy_ms:.3f} ms of kernel time, "
                f"{ops / nsteps:.0f} top-level ops\n")
        f.write(out.getvalue())
        f.write(tp.key_averages().table(sort_by=sort, row_limit=25))
        f.write("\ntop-level ops per step, by name:\n")
        by_name: dict = {}
        for e in tp.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None:
                by_name[e.name] = by_name.get(e.name, 0) + 1
        for name, n in sorted(by_name.items(), key=lambda kv: -kv[1])[:60]:
            f.write(f"  {n / nsteps:7.1f}  {name}\n")
        f.write("\n")
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


if __name__ == "__main__":
    main(sys.argv[1:])
