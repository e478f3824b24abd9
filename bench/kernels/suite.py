"""Kernel benchmark: `python -m bench.kernels --out results.json` (H200; see BENCHMARKS.md).

Measures the ceilings first (copy bandwidth, bf16 matmul rate), then for every kernel the time, the
bytes and FLOPs it must move/do, achieved TB/s and TFLOP/s, the fraction of the roofline floor
max(bytes / BW, FLOPs / peak), and the speed-up over the plain-torch reference. Bytes are the fewest a
kernel must move (each input read once, each output written once); KV rows picked by a sparse index
are counted once per (row, index), as nothing guarantees reuse. `--quick` runs tiny sizes (on the CPU
through Triton's interpreter too) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform

import torch

from bench.kernels import indexer as indexer_bench
from bench.kernels.timing import ceilings, num_sets, roofline_row, sync, time_plain, time_rotating
from kernels.formats import mla_row_bytes
from kernels.merge import merge_attn_states, merge_attn_states_ref
from kernels.moe import fused_moe, fused_moe_ref
from kernels.moe_routing import route_ref
from kernels.sparse_mla import sparse_mla, sparse_mla_decode, sparse_mla_ref
from kernels.sparse_mla_sm90 import timing_variant as sm90_variant
from kernels.store_kv import gather_kv, gather_kv_ref, store_kv, store_kv_ref

R, P, ROW = 512, 64, mla_row_bytes(512, 64)
FLOP_PER_ROW_HEAD = 2 * (R + P) + 2 * R  # QK over 576 dims + PV over 512 (2,176: docs/metrics.md, "Kernel benchmarks")


def fp8_cache(num_tokens: int, device, layers: int = 2, gen=None) -> torch.Tensor:
    """Layer 1 of a block-major fp8_ds_mla cache holding random rows at every slot."""
    blocks = -(-num_tokens // 64)
    full = torch.empty((blocks, layers, 64, ROW), dtype=torch.uint8, device=device)
    view = full[:, 1]
    step = 1 << 18
    for s0 in range(0, blocks * 64, step):
        n = min(step, blocks * 64 - s0)
        store_kv(torch.randn(n, R, device=device, dtype=torch.bfloat16) * 2,
                 torch.randn(n, P, device=device, dtype=torch.bfloat16), view, torch.arange(s0, s0 + n, device=device))
    return view


def bench_decode(dev, ceil, H: int, Sq: int, batches: list[int], K: int, ctx: int, ref: bool,
                 config: tuple | None = None, trim: bool = True, valid: int | None = None,
                 label: str = "", kernel: str | None = None, bf16_pages: bool = False) -> list[dict]:
    """sparse_mla_decode rows; `trim` and `kernel` as sparse_mla's (their defaults: trimmed rows, the kernel
    sparse_mla picks), `valid`: only the first
    `valid` of each row's K indices are real (the rest -1, a context shorter than the top-k); bytes and FLOPs
    count the real ones. `bf16_pages`: a cache of bf16 rows (pages of 64) instead of fp8_ds_mla."""
    cache = (torch.randn(-(-ctx // 64), 64, R + P, device=dev, dtype=torch.bfloat16) if bf16_pages
             else fp8_cache(ctx, dev))
    row_bytes = (R + P) * 2 if bf16_pages else ROW
    rows_out = []
    n = K if valid is None else min(valid, K)
    for B in batches:
        q = torch.randn(B, Sq, H, R + P, device=dev, dtype=torch.bfloat16)
        rows = B * Sq
        kv_bytes = rows * n * row_bytes + rows * K * 4
        io_bytes = q.numel() * 2 + rows * H * (R * 2 + 4)
        sets = [torch.randint(0, ctx, (B, Sq, K), device=dev, dtype=torch.int32) for _ in range(num_sets(kv_bytes))]
        if n < K:
            for idx in sets:
                idx[..., n:] = -1
        t = time_rotating([functools.partial(sparse_mla, q, cache, idx, 0.0625, config=config, trim=trim,
                                             kernel=kernel) for idx in sets], dev)
        t_ref = time_plain(lambda: sparse_mla_ref(q, cache, sets[0], 0.0625, R, P), dev, rep_ms=50) if ref else None
        name = f"sparse_mla_decode H={H} Sq={Sq} B={B}" + (f" valid={n}" if n < K else "") + label
        rows_out.append(roofline_row(name, t, kv_bytes + io_bytes, rows * H * n * FLOP_PER_ROW_HEAD, ceil, t_ref,
                                     H=H, Sq=Sq, B=B, K=K, valid=n, config=config or "default", trim=trim,
                                     impl=kernel or "default"))
    return rows_out


def bench_sparse_mla_variants(dev, ceil) -> list[dict]:
    """`--only sparse-mla`: the decode kernel at H = 64, K = 2,048, batch 32 / 64 / 128, 1 and 4 query rows,
    untrimmed and trimmed, at its default tile and two others (16 warps; 32 indices a block); then rows
    holding 320 real indices of 2,048 (a context below the top-k), untrimmed and trimmed. (A folded-scale
    form, bench/data/kernels/sparse-mla-fold, lost 1.3-2x at every shape and is not kept.)"""
    rows: list[dict] = []
    variants = [("", None, False), (" trim", None, True), (" 16w", (64, 64, 16, 3, True), False),
                (" bn32", (64, 32, 8, 3, True), False)]
    for Sq in (1, 4):
        for label, cfg, trim in variants:
            n = len(rows)
            _guard(rows, lambda: bench_decode(dev, ceil, 64, Sq, [32, 64, 128], K=2048, ctx=1 << 21, ref=False,
                                              config=cfg, trim=trim, label=label))
            print_table(rows[n:])
    for trim in (False, True):
        n = len(rows)
        _guard(rows, lambda: bench_decode(dev, ceil, 64, 4, [1, 8, 64], K=2048, ctx=1 << 21, ref=False, trim=trim,
                                          valid=320, label=" trim" if trim else ""))
        print_table(rows[n:])
    return rows


def check_sm90(dev) -> list[dict]:
    """The sm_90 kernel against the fp32 reference and the Triton kernel before it is timed: decode (1 and 4
    query rows, with -1 padding and a row with nothing selected, split and not), prefill rows over fp8 pages
    with positions through a shuffled block table. Max |error| / max |reference| per case; a case that raises
    is recorded."""
    from kernels.sparse_mla_sm90 import eligible, first_tile_report

    out = []
    cache = fp8_cache(1 << 16, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 1, 64, R + P, device=dev, dtype=torch.bfloat16, generator=gen)
    idx = torch.randint(0, 1 << 16, (2, 1, 2048), device=dev, dtype=torch.int32, generator=gen)
    idx[..., 3:64:5] = -1
    row = {"kernel": "check sm90 first tile, stage by stage"}
    try:
        row.update(first_tile_report(q, cache, idx, 0.0625))
    except Exception as e:  # noqa: BLE001 - recorded: the cases below may still say more
        row["error"] = repr(e)[:300]
    print(row, flush=True)
    out.append(row)
    for name, B, Sq, H, splits in (("decode", 64, 1, 64, None), ("decode mtp", 16, 4, 64, None),
                                   ("decode split", 3, 1, 64, 4), ("decode H=40", 32, 1, 40, 1),
                                   ("prefill positions", 512, 1, 64, 1)):
        gen = torch.Generator(device=dev).manual_seed(B + Sq)
        q = torch.randn(B, Sq, H, R + P, device=dev, dtype=torch.bfloat16, generator=gen)
        idx = torch.randint(0, 1 << 16, (B, Sq, 2048), device=dev, dtype=torch.int32, generator=gen)
        idx[..., ::7] = -1
        idx[0, 0] = -1
        kw, ref_idx = {}, idx
        if name.startswith("prefill"):  # q [T, H, D]; positions of 8 requests mapped through shuffled pages
            q, idx = q[:, 0], idx[:, 0] % 8192
            table = torch.randperm(1 << 10, device=dev, generator=gen).to(torch.int32).view(8, 128)
            req = torch.arange(B, device=dev, dtype=torch.int32) % 8
            idx[::5] = -1
            kw = dict(block_table=table, token_req_idx=req)
            ref_idx = torch.where(idx >= 0, table[req.long()].gather(1, (idx.clamp(min=0) // 64).long()) * 64
                                  + idx.clamp(min=0) % 64, -1)
        row = {"kernel": f"check sm90 {name} B={B} Sq={Sq} H={H}",
               "why_not": eligible(q, cache, idx, R, bool(kw), kw.get("block_table"), kw.get("token_req_idx"))}
        try:
            got = sparse_mla(q, cache, idx, 0.0625, num_splits=splits, kernel="sm90", **kw)
            tri = sparse_mla(q, cache, idx, 0.0625, num_splits=splits, kernel="triton", **kw)
            ref = sparse_mla_ref(q, cache, ref_idx, 0.0625, R, P)
            scale = ref[0].float().abs().max().item()
            fin = torch.isfinite(ref[1])
            row.update(out_err=(got[0].float() - ref[0].float()).abs().max().item() / scale,
                       triton_err=(tri[0].float() - ref[0].float()).abs().max().item() / scale,
                       lse_err=(got[1][fin] - ref[1][fin]).abs().max().item(),
                       inf_match=bool(torch.equal(torch.isinf(got[1]), ~fin)),
                       nan=bool(torch.isnan(got[0]).any() or torch.isnan(got[1]).any()))
        except Exception as e:  # noqa: BLE001 - record and go on: the timings below say nothing without this
            row["error"] = repr(e)[:300]
        print(row, flush=True)
        out.append(row)
    return out


def check_passed(rows: list[dict]) -> bool:
    """check_sm90's rows say the kernel is right: no case raised or gave NaN, each output within 2% of the
    reference's largest value, and the first tile's stages within the tolerances of its GPU test (the first-tile
    row has stage errors, not an out_err)."""
    for r in rows:
        if "error" in r or r.get("nan") is True:
            return False
        if "out_err" in r and not r["out_err"] <= 0.02:
            return False
        if "tile_exact" in r and not (r["tile_exact"] and r["scores_err"] < 1e-4 and r["p_err"] < 1e-2
                                      and r["pv_err"] < 1e-4 and not any(r["nan"].values())):
            return False
    return bool(rows)


def bench_sparse_mla_sm90(dev, ceil) -> list[dict]:
    """`--only sparse-mla-sm90`: the accuracy check, then the sm_90 kernel beside the Triton kernel on the same
    inputs: decode H = 64, K = 2,048, B = 32 / 64 / 128, 1 and 4 query rows; 320 valid indices of 2,048 at 4
    rows (trimmed); the same decode over bf16 pages; prefill at T = 8K and 64K over fp8 pages, over a bf16
    workspace, and over fp8 pages dequantised into a workspace first (sm_90 only); then the sm_90 kernel's timing
    variants (no row gather from HBM; no wgmma) at B = 64 / 128 and T = 8K, which say whether the producer or the
    tensor cores set its pace."""
    rows = check_sm90(dev)
    if not check_passed(rows):
        print("sm90 kernel failed its check: not timed", flush=True)
        return rows
    for Sq in (1, 4):
        for kernel in ("triton", "sm90"):
            n = len(rows)
            _guard(rows, lambda: bench_decode(dev, ceil, 64, Sq, [32, 64, 128], K=2048, ctx=1 << 21, ref=False,
                                              kernel=kernel, label=f" [{kernel}]"))
            print_table(rows[n:])
    for kernel in ("triton", "sm90"):
        n = len(rows)
        _guard(rows, lambda: bench_decode(dev, ceil, 64, 4, [1, 8, 64], K=2048, ctx=1 << 21, ref=False, trim=True,
                                          valid=320, kernel=kernel, label=f" trim [{kernel}]"))
        print_table(rows[n:])
    for Sq in (1, 4):  # bf16 pages (a bf16 model's cache): the sm_90 kernel's bf16-rows mode against Triton
        for kernel in ("triton", "sm90"):
            n = len(rows)
            _guard(rows, lambda: bench_decode(dev, ceil, 64, Sq, [32, 64, 128], K=2048, ctx=1 << 21, ref=False,
                                              kernel=kernel, bf16_pages=True, label=f" bf16 pages [{kernel}]"))
            print_table(rows[n:])
    for T in (8192, 65536):
        for kernel, kind in (("triton", "fp8 paged"), ("sm90", "fp8 paged"), ("triton", "bf16 workspace"),
                             ("sm90", "bf16 workspace"), ("sm90", "fp8 pages via workspace")):
            n = len(rows)
            _guard(rows, lambda: [bench_prefill(dev, ceil, T, 2048, kind, 64, kernel=kernel)])
            print_table(rows[n:])
    for variant in ("no-gather", "no-mma"):  # where the time goes: the same launches with one stage left out
        n = len(rows)
        with sm90_variant(variant):
            for Sq in (1, 4):
                _guard(rows, lambda: bench_decode(dev, ceil, 64, Sq, [64, 128], K=2048, ctx=1 << 21, ref=False,
                                                  kernel="sm90", label=f" [sm90 {variant}]"))
            _guard(rows, lambda: [bench_prefill(dev, ceil, 8192, 2048, "fp8 paged", 64, kernel="sm90")])
            rows[-1]["kernel"] += f" {variant}"
            rows[-1]["impl"] += f" {variant}"
        print_table(rows[n:])
    return rows


def bench_prefill(dev, ceil, T: int, K: int, kind: str, ref_rows: int, config: tuple | None = None,
                  kernel: str | None = None) -> dict:
    """T query rows over a context of T tokens: `kind` "bf16 workspace", "fp8 paged" (the cache), or "fp8 pages via
    workspace" (the cache dequantised into a bf16 workspace by gather_kv, then attended over: both timed)."""
    H = 64
    q = torch.randn(T, H, R + P, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, T, (T, K), device=dev, dtype=torch.int32)
    kv = (torch.randn(T, R + P, device=dev, dtype=torch.bfloat16) if kind == "bf16 workspace"
          else fp8_cache(T, dev))
    row_bytes = (R + P) * 2 if kind == "bf16 workspace" else ROW
    if kind == "fp8 pages via workspace":  # dequantise the context into a bf16 workspace, then attend over it
        slots = torch.arange(T, device=dev, dtype=torch.int32)

        def call():
            return sparse_mla(q, gather_kv(kv, slots, R, P, torch.bfloat16), idx, 0.0625, num_splits=1, config=config,
                              kernel=kernel)
    else:
        def call():
            return sparse_mla(q, kv, idx, 0.0625, num_splits=1, config=config, kernel=kernel)
    t = time_plain(call, dev, rep_ms=300)
    n = min(T, ref_rows)
    t_ref = time_plain(lambda: sparse_mla_ref(q[:n], kv, idx[:n], 0.0625, R, P), dev, rep_ms=50) * T / n
    unique = T * row_bytes + q.numel() * 2 + idx.numel() * 4 + T * H * (R * 2 + 4)
    label = f" [{kernel}]" if kernel else ""
    return roofline_row(f"sparse_mla_prefill {kind} T={T}{label}", t, unique, T * H * K * FLOP_PER_ROW_HEAD, ceil,
                        t_ref, T=T, K=K, gathered_bytes=T * K * row_bytes, ref_rows=n, config=config or "default",
                        impl=kernel or "default")


def bench_store_gather(dev, ceil, T: int) -> list[dict]:
    cache = torch.empty((-(-2 * T // 64), 2, 64, ROW), dtype=torch.uint8, device=dev)[:, 1]
    latent = torch.randn(T, R, device=dev, dtype=torch.bfloat16)
    rope = torch.randn(T, P, device=dev, dtype=torch.bfloat16)
    slot_sets = [torch.randperm(2 * T, device=dev)[:T] for _ in range(2)]
    t = time_rotating([functools.partial(store_kv, latent, rope, cache, s) for s in slot_sets], dev)
    t_ref = time_plain(lambda: store_kv_ref(latent, rope, cache, slot_sets[0]), dev, rep_ms=50)
    rows = [roofline_row(f"store_kv fp8 T={T}", t, T * (R * 2 + P * 2 + 8 + ROW), 0, ceil, t_ref, T=T)]
    t = time_rotating([functools.partial(gather_kv, cache, s, R, P, torch.bfloat16) for s in slot_sets], dev)
    t_ref = time_plain(lambda: gather_kv_ref(cache, slot_sets[0], R, P).bfloat16(), dev, rep_ms=50)
    rows.append(roofline_row(f"gather_kv fp8->bf16 n={T}", t, T * (ROW + 8 + (R + P) * 2), 0, ceil, t_ref, T=T))
    return rows


def sweep_prefill(dev, ceil, T: int, configs: list) -> list[dict]:
    K, H = 2048, 64
    q = torch.randn(T, H, R + P, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, T, (T, K), device=dev, dtype=torch.int32)
    kv = torch.randn(T, R + P, device=dev, dtype=torch.bfloat16)
    out = []
    for cfg in configs:
        try:
            t = time_plain(lambda: sparse_mla(q, kv, idx, 0.0625, num_splits=1, config=cfg), dev, rep_ms=100)
        except Exception as e:  # noqa: BLE001 - a config the device cannot run is reported, the sweep goes on
            out.append({"kernel": f"sweep prefill cfg={cfg}", "error": repr(e)[:200]})
            continue
        out.append(roofline_row(f"sweep prefill T={T} cfg={cfg}", t, T * (R + P) * 2 + q.numel() * 2,
                                T * H * K * FLOP_PER_ROW_HEAD, ceil, config=cfg))
    return out


def profile_once(case: str) -> None:
    """Run one case a few times (compiles first) for `ncu --launch-skip 2 --launch-count 1`."""
    dev = torch.device("cuda")
    H = {"decode64": 64, "decode8": 8}[case]
    cache = fp8_cache(1 << 21, dev)
    q = torch.randn(64, 1, H, R + P, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, 1 << 21, (64, 1, 2048), device=dev, dtype=torch.int32)
    for _ in range(3):
        sparse_mla_decode(q, cache, idx, 0.0625)
    sync(dev)


def bench_merge(dev, ceil, N: int, rows: int, D: int = 512) -> dict:
    outs = [torch.randn(N, rows, D, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    lses = torch.randn(N, rows, device=dev)
    t = time_rotating([functools.partial(merge_attn_states, o, lses) for o in outs], dev)
    t_ref = time_plain(lambda: merge_attn_states_ref(outs[0], lses), dev, rep_ms=50)
    return roofline_row(f"merge_attn_states N={N} rows={rows}", t, N * rows * (D * 2 + 4) + rows * (D * 2 + 4), 0,
                        ceil, t_ref, N=N)


def bench_moe(dev, ceil, T: int, E: int, H: int, inner: int, k: int) -> dict:
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * inner, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, inner, device=dev, dtype=torch.bfloat16) * inner ** -0.5
    weights, ids = route_ref(torch.randn(T, E, device=dev), None, k)
    t = time_plain(lambda: fused_moe(x, w13, w2, weights, ids), dev, rep_ms=200)
    t_ref = time_plain(lambda: fused_moe_ref(x, w13, w2, weights, ids), dev, rep_ms=100)
    flops = T * k * 3 * 2 * H * inner
    return roofline_row(f"fused_moe T={T} E={E} k={k}", t, (w13.numel() + w2.numel()) * 2 + T * H * 4, flops,
                        ceil, t_ref, T=T, E=E)


def sweep_decode(dev, ceil, H: int, B: int, configs: list, splits: list) -> list[dict]:
    """Time sparse_mla_decode under several (BLOCK_H, BLOCK_N, warps, stages) and split counts."""
    K, ctx = 2048, 1 << 21
    cache = fp8_cache(ctx, dev)
    q = torch.randn(B, 1, H, R + P, device=dev, dtype=torch.bfloat16)
    sets = [torch.randint(0, ctx, (B, 1, K), device=dev, dtype=torch.int32) for _ in range(num_sets(B * K * ROW))]
    out = []
    for cfg in configs:
        for ns in splits:
            calls = [functools.partial(sparse_mla, q, cache, idx, 0.0625, num_splits=ns, config=cfg) for idx in sets]
            try:
                t = time_rotating(calls, dev)
            except Exception as e:  # noqa: BLE001 - e.g. a tile config over the shared-memory limit
                out.append({"kernel": f"sweep decode H={H} B={B} cfg={cfg} splits={ns}", "error": repr(e)[:200]})
                continue
            out.append(roofline_row(f"sweep decode H={H} B={B} cfg={cfg} splits={ns}", t, B * K * (ROW + 4),
                                    B * H * K * FLOP_PER_ROW_HEAD, ceil, config=cfg))
    return out


def _guard(rows: list[dict], fn) -> None:
    """Run one benchmark section; a failure is recorded and printed, the others still run."""
    import traceback
    try:
        rows += fn()
    except Exception as e:  # noqa: BLE001 - a benchmark run is expensive: keep the other sections
        traceback.print_exc()
        rows.append({"kernel": f"FAILED {fn.__code__.co_names[:3]}", "error": repr(e)[:300]})
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    head = f"{'kernel':54s} {'us':>10s} {'TB/s':>6s} {'TFLOP/s':>8s} {'floor%':>7s} {'bound':>7s} {'speedup':>8s}"
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:54s} {r['error']}")
            continue
        if "us" not in r:  # a check row (check_sm90)
            print(f"{r['kernel']:54s} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in r.items() if k != "kernel"))
            continue
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        extra = f"  topk {r['topk_share']:.0%}, score {r['score_tflops']:.0f} TF/s" if "topk_share" in r else ""
        if "key_copy_frac" in r:
            extra += f"  keys at {r['key_copy_frac']:.0%} of copy"
        if "agreement" in r:
            extra += f"  {r['speedup_vs_radix']:.1f}x radix, same picks {r['agreement']:.2%}"
        if "device_us" in r:
            frac = r.get("device_floor_frac", r.get("device_key_copy_frac", 0.0))
            extra += f"  device {r['device_us']:.1f} us ({frac:.1%} of floor)"
        print(f"{r['kernel']:54s} {r['us']:10.1f} {r['tbps']:6.2f} {r['tflops']:8.1f} {100 * r['roofline_frac']:6.1f}% "
              f"{r['bound']:>7s} {sp:>8s}{extra}")


def run(dev: torch.device, quick: bool, sweep: str | None, only: str = "all") -> dict:
    if only == "sparse-mla-sm90" and quick:  # the accuracy check alone (e.g. under compute-sanitizer), no timing
        return {"ceilings": {}, "rows": check_sm90(dev) if dev.type == "cuda" else [], "sweep": []}
    ceil = ceilings(dev)
    print(f"ceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    sweeps: list[dict] = []
    if only == "sparse-mla" and not quick:
        return {"ceilings": ceil, "rows": bench_sparse_mla_variants(dev, ceil), "sweep": sweeps}
    if only == "sparse-mla-sm90" and not quick:
        return {"ceilings": ceil, "rows": bench_sparse_mla_sm90(dev, ceil), "sweep": sweeps}
    if only == "indexer":
        rows, sweeps = indexer_bench.run(dev, ceil, quick, sweep, _guard)
        if sweeps:
            print_table(sweeps)
        return {"ceilings": ceil, "rows": rows, "sweep": sweeps}
    if quick:
        rows += bench_decode(dev, ceil, 5, 2, [2], K=32, ctx=256, ref=True)
        _guard(rows, lambda: indexer_bench.run(dev, ceil, True, None, _guard)[0])
        rows += bench_store_gather(dev, ceil, 64)
        rows.append(bench_merge(dev, ceil, 2, 16))
        rows.append(bench_moe(dev, ceil, 16, 4, 64, 32, 2))
        return {"ceilings": ceil, "rows": rows, "sweep": sweeps}
    best: dict[str, tuple | None] = {"H64": None, "H8": None, "prefill": None}
    if sweep == "all":
        h64 = [(64, 64, 8, 2, True), (64, 64, 8, 2, False), (64, 64, 8, 3, True), (64, 32, 8, 2, True)]
        h8 = [(16, 32, 4, 2, True), (16, 32, 4, 2, False), (16, 64, 8, 2, True), (16, 32, 4, 3, True)]
        pre = [(64, 64, 8, 2, True), (64, 32, 8, 2, True), (64, 64, 8, 3, True)]
        for key, fn in (("H64", lambda: sweep_decode(dev, ceil, 64, 64, h64, [None])),
                        ("H8", lambda: sweep_decode(dev, ceil, 8, 64, h8, [None])),
                        ("prefill", lambda: sweep_prefill(dev, ceil, 8192, pre))):
            n = len(sweeps)
            _guard(sweeps, fn)
            timed = [r for r in sweeps[n:] if "us" in r]
            best[key] = min(timed, key=lambda r: r["us"])["config"] if timed else None
        print_table(sweeps)
        print(f"configs used below (fastest of each sweep): {best}", flush=True)
    _guard(rows, lambda: bench_store_gather(dev, ceil, 1 << 17))
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    for H in (64, 8):
        for Sq in (1, 4):
            n = len(rows)
            cfg = best["H64" if H == 64 else "H8"]
            _guard(rows, lambda: bench_decode(dev, ceil, H, Sq, batches, K=2048, ctx=1 << 21, ref=True, config=cfg))
            print_table(rows[n:])
    for T in (8192, 65536):
        _guard(rows, lambda: [bench_prefill(dev, ceil, T, 2048, "bf16 workspace", 256, best["prefill"])])
    _guard(rows, lambda: [bench_prefill(dev, ceil, 8192, 2048, "fp8 paged", 256, best["prefill"])])
    n = len(rows)
    _guard(rows, lambda: indexer_bench.run(dev, ceil, False, sweep, _guard)[0])
    print_table(rows[n:])
    _guard(rows, lambda: [bench_merge(dev, ceil, 8, 128 * 64)])
    _guard(rows, lambda: [bench_moe(dev, ceil, 4096, 32, 6144, 2048, 8)])
    return {"ceilings": ceil, "rows": rows, "sweep": sweeps}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, numbers mean nothing")
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "select"],
                    help="also time tile configurations of the main kernels (select: only the indexer selection's)")
    ap.add_argument("--only", choices=["all", "indexer", "sparse-mla", "sparse-mla-sm90"], default="all",
                    help="indexer: the ceilings and the indexer cases only (radix against fused); sparse-mla: the "
                         "decode kernel's variants (trimmed rows, other tiles); sparse-mla-sm90: the warp-specialised "
                         "kernel checked, then beside the Triton one")
    ap.add_argument("--profile", choices=["decode64", "decode8"], help="run one case for a profiler, then exit")
    args = ap.parse_args()
    if args.profile:
        profile_once(args.profile)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = run(dev, args.quick or dev.type != "cuda", args.sweep, args.only)
    print_table(res["rows"])
    import triton
    res["meta"] = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(dev)
                   if dev.type == "cuda" else platform.processor(), "torch": torch.__version__,
                   "triton": triton.__version__, "python": platform.python_version()}
    sync(dev)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
