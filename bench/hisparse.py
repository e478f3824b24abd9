"""`python -m bench.hisparse --out FILE`: decode step time of a real-dimension layer stack versus context
length, for HiSparse, fully resident and offload-only KV.

    resident  the plain paged cache on the device; the inner attention backend reads selected rows in place
    hisparse  engine.hisparse with a device pool of hot buffers only: every request decodes from the host
              pool (plans, LRU, miss copies host -> device, newest rows backed up to the host)
    offload   engine.hisparse's offload-only baseline: per layer, each request's whole context comes back

Per step and layer (B requests, one decode row each): MLA projections in the absorbed form and a dense MLP
(GLM-5.3 widths, bf16 random weights; --attention-only drops them), store_kv of the new row, on each full
indexer layer (every 4th) the top-k selection, sparse MLA over top-k rows (fp8_ds_mla, 656 B). The top-k is
a synthetic stream (bench.hisparse_stack.TopkStream): random weights give an indexer no temporal locality,
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

from bench.hisparse_stack import (Contexts, DenseStack, TopkStream, decode_meta, fill_pages, hisparse_manager,
                                  inner_backend, place, resident_cache, stack_config)
from engine.hisparse.layout import LayerGroups
from engine.kv.cache import KVCacheSpec

GLM_KV_BYTES_PER_TOKEN = 54_728  # DESIGN §3: the whole GLM-5.3 model, fp8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--sync-debug", action="store_true", help="warn, with the stack, at every host synchronisation "
                   "inside a timed step (CUDA)")
    p.add_argument("--pair-contexts", default=None, metavar="A,B", help="paired mode: resident at context A and "
                   "HiSparse at context B stepped alternately per batch (the ratio target, host drift cancelled)")
    p.add_argument("--plans-only", action="store_true", help="hit rates of the LRU plans alone (any device): "
                   "real top-k and buffer, no attention")
    if "--cpu-smoke" in (argv if argv is not None else sys.argv[1:]):  # toy defaults; explicit flags still win
        p.set_defaults(contexts="300,1100", batches="1,3", steps=3, warmup=2, offload_steps=2, mlp_width=64)
    return p.parse_args(argv)


def run_case(args, mode: str, context: int, batch: int, device: torch.device, churn: float | None = None) -> dict:
    case = setup_case(args, mode, context, batch, device, churn)
    if "skipped" in case["row"]:
        return case["row"]
    return finish_case(case, *_steps(args, **case["run"]))


def setup_case(args, mode: str, context: int, batch: int, device: torch.device, churn: float | None = None) -> dict:
    """Everything a case's steps need: {"row": its identity, "run": _steps' arguments, "mgr", "inner"}."""
    cfg = stack_config("tiny" if args.cpu_smoke else "glm-5.3", args.layers)
    spec = KVCacheSpec.from_model(cfg, kv_cache_dtype="fp8_ds_mla", indexer_precision="fp8", with_mtp=False)
    steps = args.offload_steps if mode == "offload" else args.steps
    warmup = 1 if mode == "offload" else args.warmup
    ctx = Contexts(context, batch, warmup + steps)
    churn = float(args.churn.split(",")[0]) if churn is None else churn
    row = {"mode": mode, "context": context, "batch": batch, "layers": args.layers, "churn": churn,
           "kv_gib_distinct_glm": round(batch * context * GLM_KV_BYTES_PER_TOKEN / 2 ** 30, 1)}
    if mode == "resident" and ctx.num_blocks * spec.block_bytes / 2 ** 30 > args.max_resident_gib:
        return {"row": {**row, "skipped": "resident cache above --max-resident-gib"}}
    inner = inner_backend(spec, device)
    mgr = None
    if mode == "resident":
        cache, backend = resident_cache(spec, ctx, device), inner
        fill_pages(cache.mla, cache.index, spec)
    else:
        mgr = hisparse_manager(cfg, spec, ctx, device, offload_only=mode == "offload")
        cache, backend = mgr.cache, mgr.wrap(inner)
        fill_pages(cache.mla, cache.index, spec)  # the host pool
        place(mgr, ctx, context)
        states = mgr.residency.count_states()
        assert states["resident"] == 0, f"{mode}: every request must decode from the host pool, got {states}"
    return {"row": row, "mgr": mgr, "inner": inner, "layers": args.layers,
            "run": dict(cfg=cfg, spec=spec, ctx=ctx, backend=backend, cache=cache, mgr=mgr, device=device,
                        warmup=warmup, churn=churn)}


def finish_case(case: dict, times, host, h2d, hits, misses) -> dict:
    row, inner, mgr, layers = case["row"], case["inner"], case["mgr"], case["layers"]
    n = hits + misses
    ms = statistics.median(times) * 1e3
    return {**row, "backend": inner.name, "step_ms": round(ms, 3), "mean_step_ms": round(sum(times) / len(times) * 1e3, 3),
            "host_issue_ms": round(statistics.median(host) * 1e3, 3),
            "ms_per_layer": round(ms / layers, 4),
            "hit_rate": round(hits / n, 4) if n else None, "h2d_bytes_per_step": int(sum(h2d) / len(h2d)),
            "h2d_gb_per_s": round(sum(h2d) / sum(times) / 1e9, 2),
            "copy_path": mgr.mover.path if mgr else None}


def _steps(args, cfg, spec, ctx, backend, cache, mgr, device, warmup, churn, as_iter=False):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    B, H = ctx.batch, cfg.num_attention_heads
    dense = None if args.attention_only else _dense(cfg, args.mlp_width, device, dtype)
    x = torch.randn(B, cfg.hidden_size, generator=g).to(device, dtype)
    q_fixed = torch.randn(B, H, spec.latent_dim + spec.rope_dim, generator=g).to(device, dtype)
    kv_fixed = torch.randn(B, spec.latent_dim + spec.rope_dim, generator=g).to(device, dtype)
    groups = LayerGroups.from_spec(spec)
    streams = [TopkStream(B, cfg.index_topk, churn, device, seed=i) for i in range(groups.num_groups)]
    table, req_ids = ctx.table(device), [f"r{b}" for b in range(B)]
    scale = cfg.softmax_scale
    gen = _step_iter(args, ctx, spec, groups, streams, table, req_ids, scale, backend, cache, mgr, device, warmup,
                     dense, x, q_fixed, kv_fixed)
    if not as_iter:
        gc.collect()
        gc.disable()  # a collection inside a timed step is noise (the serving engine's loop allocates little)
        try:
            return _collect(gen)
        finally:
            gc.enable()
    return gen


def _collect(gen):
    """(step seconds, host seconds to issue the step, H2D bytes per step, hits, misses) of the measured steps."""
    times, host, h2d, hits, misses = [], [], [], 0, 0
    for t, issue, nbytes, dh, dm in gen:
        if t is not None:
            times.append(t)
            host.append(issue)
            h2d.append(nbytes)
            hits, misses = hits + dh, misses + dm
    return times, host, h2d, hits, misses


def _step_iter(args, ctx, spec, groups, streams, table, req_ids, scale, backend, cache, mgr, device, warmup, dense,
               x, q_fixed, kv_fixed):
    """One decode step per next(): yields (seconds, issue seconds, H2D bytes, hits, misses), None for warm-up."""
    for step in range(ctx.steps):
        seq_len = ctx.context + step
        before = mgr.counters.tolist() if mgr is not None else None  # synchronises too
        _sync(device)
        prof = getattr(args, "step_profiler", None) if step >= warmup else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        if args.sync_debug and device.type == "cuda" and step >= warmup:
            torch.cuda.set_sync_debug_mode("warn")
        if mgr is not None:
            place(mgr, ctx, seq_len)  # the runner's per-step placement is part of the step
        meta = decode_meta(table, seq_len, req_ids)
        sel = None
        for layer in range(args.layers):
            if dense is not None:
                q, latent, k_rope = dense.qkv(x)
            else:
                q, latent, k_rope = q_fixed, kv_fixed[:, : spec.latent_dim], kv_fixed[:, spec.latent_dim:]
            backend.store_kv(cache, layer, latent, k_rope, meta)
            if groups.is_leader(layer):
                sel = streams[groups.group_of[layer]].next(meta.seq_lens)
            out, _ = backend.sparse_mla(cache, layer, q, sel, meta, scale)
            if dense is not None:
                dense.finish(x, out)
        if args.sync_debug and device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        enqueued = time.perf_counter()
        _sync(device)
        if prof is not None:
            prof.disable()
        if step < warmup:
            yield None, None, None, 0, 0
            continue
        elapsed = time.perf_counter() - t0
        if mgr is None:
            yield elapsed, enqueued - t0, 0, 0, 0
            continue
        after = mgr.counters.tolist()
        yield elapsed, enqueued - t0, after[3], after[0] - before[0], after[1] - before[1]


def paired(args, device: torch.device) -> list[dict]:
    """The target comparison with the host's drift cancelled: for each batch, resident at --pair-contexts' first
    context and HiSparse at its second are set up side by side and stepped alternately (A, B, A, B, ...);
    each measured pair gives a ratio B / A, reported as its median next to both medians."""
    ctx_a, ctx_b = (int(c) for c in args.pair_contexts.split(","))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        a = setup_case(args, "resident", ctx_a, batch, device)
        b = setup_case(args, "hisparse", ctx_b, batch, device)
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
        row = {"mode": "paired", "batch": batch, "layers": args.layers, "resident_context": ctx_a,
               "hisparse_context": ctx_b, "pairs": len(ratios),
               "resident_ms": round(statistics.median(ta) * 1e3, 3), "hisparse_ms": round(statistics.median(tb) * 1e3, 3),
               "ratio_median": round(statistics.median(ratios), 3),
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


_DENSE: dict = {}


def _dense(cfg, width: int, device, dtype) -> DenseStack:
    """One set of random weights for every case (building ~0.4 B parameters takes seconds)."""
    key = (cfg.hidden_size, width, str(device), dtype)
    if key not in _DENSE:
        _DENSE.clear()
        _DENSE[key] = DenseStack(cfg, width, device, dtype)
    return _DENSE[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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
    """run_case, under cProfile and torch.profiler when --profile is given (the report is appended)."""
    if not args.profile:
        return run_case(args, mode, context, batch, device, churn)
    import cProfile
    import io
    import pstats

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = args.step_profiler = cProfile.Profile()  # enabled by _steps inside the measured steps only
    with torch.profiler.profile(activities=acts) as tp:
        row = run_case(args, mode, context, batch, device, churn)
    args.step_profiler = None
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    nsteps = (args.offload_steps + 1) if mode == "offload" else (args.steps + args.warmup)
    kernels = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3 / nsteps
    ops = sum(1 for e in tp.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
              and e.cpu_parent is None)
    with open(args.profile, "a") as f:
        f.write(f"==== {mode} context {context} batch {batch}: {row.get('step_ms')} ms/step; per step: "
                f"{len(kernels) / nsteps:.0f} kernels, {busy_ms:.3f} ms of kernel time, {ops / nsteps:.0f} top-level ops\n")
        f.write(out.getvalue())
        f.write(tp.key_averages().table(sort_by=sort, row_limit=25))
        f.write("\n")
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


if __name__ == "__main__":
    main(sys.argv[1:])
