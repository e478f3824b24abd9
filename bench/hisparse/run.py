"""The decode steps `bench.hisparse` times: one case (mode, context, batch) set up, stepped and summarised.

A step: placement (HiSparse), then per layer the MLA projections and dense MLP (or fixed inputs with
--attention-only), store_kv of the new row, the top-k selection on full layers, sparse MLA. Each step is
synchronised and timed on the host clock; the time to issue it (before the final synchronisation) is kept
beside it, which tells host-bound steps from device-bound ones.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.hisparse.stack import (
    Contexts,
    DenseStack,
    TopkStream,
    decode_meta,
    fill_pages,
    hisparse_manager,
    inner_backend,
    place,
    resident_cache,
    stack_config,
)
from engine.hisparse.layout import LayerGroups
from engine.kv.cache import KVCacheSpec

GLM_KV_BYTES_PER_TOKEN = 54_728  # the whole GLM-5.3 model, fp8 (docs/kv-formats.md, "Bytes per token")


def run_case(args, mode: str, context: int, batch: int, device: torch.device, churn: float | None = None) -> dict:
    case = setup_case(args, mode, context, batch, device, churn)
    if "skipped" in case["row"]:
        return case["row"]
    return finish_case(case, *_steps(args, **case["run"]))


def setup_case(args, mode: str, context: int, batch: int, device: torch.device, churn: float | None = None,
               same_steps: bool = False) -> dict:
    """Everything a case's steps need: {"row": its identity, "run": _steps' arguments, "mgr", "inner"}.
    The slow offload mode runs --offload-steps after one warm-up step unless `same_steps` (paired mode)."""
    cfg = stack_config("tiny" if args.cpu_smoke else "glm-5.3", args.layers)
    spec = KVCacheSpec.from_model(cfg, kv_cache_dtype="fp8_ds_mla", indexer_precision="fp8", with_mtp=False)
    short = mode == "offload" and not same_steps
    steps = args.offload_steps if short else args.steps
    warmup = 1 if short else args.warmup
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
    return {**row, "backend": inner.name, "step_ms": round(ms, 3),
            "mean_step_ms": round(sum(times) / len(times) * 1e3, 3),
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
    tprof = getattr(args, "torch_profiler", None)
    for step in range(ctx.steps):
        seq_len = ctx.context + step
        if tprof is not None and step == warmup:
            tprof.start()
        before = mgr.counters.tolist() if mgr is not None else None  # synchronises too
        _sync(device)
        prof = getattr(args, "step_profiler", None) if step >= warmup else None
        if prof is not None:
            prof.enable()
        timer = getattr(args, "host_timer", None)
        if timer is not None:
            timer.on = step >= warmup
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
        if timer is not None:
            timer.on = False
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
    if tprof is not None:
        tprof.stop()


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
