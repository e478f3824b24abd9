"""FP8 block-scaled GEMMs on the GPU against measured ceilings and the bf16 paths they replace.

    python -m bench.kernels.fp8_gemm --out results.json [--quick] [--no-sweep] [--decode-only | --moe-only]
        [--only q_a_proj,kv_a_proj,packed_x --rows 4,64,256,8192] [--moe-tokens 8192,2048,256,64]
    python -m bench.kernels.fp8_gemm --out results.json --norm-quant [--rows 4,16,64,256]

Ceilings, measured in the same run: copy bandwidth (bytes read + written), dense bf16 matmul and dense
FP8 `torch._scaled_mm` (per-tensor scales) at 8192^3. Then, at GLM-5.3's projection shapes:
* the w8a8 block-scaled GEMM at prefill M = 8192 (TFLOP/s vs the FP8 rate) and decode M = 64, 256
  (weight bytes per second vs copy bandwidth), activation quantization included, against bf16 `x @ W^T`:
  the launcher's choice (`us`, `impl`), the Triton kernel's pick (`triton_us`) and cuBLAS (`cublas_us`, and
  `cublas_gemm_only_us` with x quantized beforehand, as when two projections share it);
  decode rows time the split-K path (kernels.fp8_splitk, one launch) and, beside it as `legacy_us`, the
  two-launch path CUDA still defaults to (`quant_act`, 64 x 64 tiles with interleaved K splits, a torch
  sum: kernels.fp8_gemm.split_decode_config); `speedup_vs_legacy` decides `SPLITK_DECODE`;
* the grouped MoE (32 local experts, H 6144, I 2048, top-8): prefill 8,192 and 2,048 tokens and decode 256 and
  64 tokens, FP8 `fused_moe_fp8` (Triton, and at prefill sizes the per-expert cuBLAS path) against the bf16
  `fused_moe`;
* the MLA absorbed matmuls on bf16 W_UK / W_UV against the FP8 path (kernels.fp8_absorbed's dequantization,
  then the same einsums), for the kv_b_proj decision.
A config sweep per shape reports the launcher's pick and the best found; at decode shapes it crosses the
column tile (64, 128), the split count and whether x is quantized in the kernel or by `quant_act`, so
one run can retune `splitk_config`. `--decode-only` runs the decode rows alone, `--moe-only` the grouped MoE alone
(8,192 tokens; 256 = the verify rows of 64 requests with MTP3, where the decode step spends its MoE time; 64;
`--moe-tokens 4,16`: B = 1 and 4 with MTP3, swept over smaller tiles too, and timed against the bytes of the
experts the batch touches, `touched_frac_copy_bw`).
`--moe-split-sweep` also tunes the two MoE GEMMs apart (kernels.fp8_moe's 6-tuple configs: the up GEMM's warps and
stages, then the down GEMM's column tile, warps and stages, per row tile); `best_config` names the fastest.
`packed_x` / `packed_q_resid` are the packed projections the model runs (engine.model.projections) beside
their members' rows; `--only` / `--rows` pick projections and M values (GEMM rows only).
`--norm-quant` times the projections that follow an RMSNorm (the packed x and query-residual projections, the
shared and dense gate+up) at decode rows (`--rows`, default 4,16,64,256) two ways, each as CUDA-graph replays of
the norm and the GEMM: the norm, then the GEMM quantizing its input itself (`separate_us`), against the norm
writing the quantization with its output (kernels.norm.rms_norm_quant) and the GEMM taking it (`fused_us`); the
pair's weight bytes over the time against copy bandwidth (`*_frac_copy_bw`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import torch

from bench.kernels.timing import ceilings, num_sets, time_plain, time_rotating
from kernels import fp8_cublas
from kernels.fp8_absorbed import absorbed_matmul, dequantize_fp8
from kernels.fp8_gemm import gemm_config, split_decode_config, w8a8_block_fp8_matmul
from kernels.fp8_moe import _config as moe_config
from kernels.fp8_moe import fused_moe_fp8, merge_gate_up_scales
from kernels.fp8_quant import quant_act, quantize_weight_ref
from kernels.fp8_splitk import SplitKConfig, splitk_config
from kernels.moe import fused_moe
from kernels.norm import rms_norm, rms_norm_quant
from kernels.triton_support import num_sms

# (name, N, K) of GLM-5.3's quantized projections (hidden 6144, q_lora 2048, 64 heads, dense width 12288)
SHAPES = [("q_a_proj", 2048, 6144), ("q_b_proj", 16384, 2048), ("kv_a_proj", 576, 6144),
          ("o_proj", 6144, 16384), ("dense_gate_up", 24576, 6144), ("dense_down", 6144, 12288),
          ("shared_gate_up", 4096, 6144), ("shared_down", 6144, 2048), ("indexer_wq_b", 4096, 2048),
          ("eh_proj", 6144, 12288), ("indexer_wk", 128, 6144),
          # the packs the model runs (engine.model.projections): q_a_proj + indexer wk + kv_a_proj over the
          # hidden states, q_b_proj + indexer wq_b over the query residual
          ("packed_x", 2048 + 128 + 576, 6144), ("packed_q_resid", 16384 + 4096, 2048)]
PREFILL_SWEEP = [(128, 128, 1, 8, 4), (64, 256, 1, 8, 3), (64, 256, 1, 8, 4), (256, 64, 1, 8, 3), (64, 128, 1, 4, 4)]
DECODE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
MOE_SWEEP = [(32, 64, 4, 4), (64, 128, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4)]
# decode sizes below 64 tokens (B = 1 / 4 with MTP3: 4 / 16 rows): smaller row tiles, fewer stages (more CTAs a SM)
MOE_SMALL_SWEEP = [(16, 64, 4, 4), (16, 64, 4, 2), (16, 32, 4, 4), (16, 128, 4, 3), (32, 64, 4, 2), (32, 32, 4, 4),
                   (32, 128, 4, 3), (16, 64, 2, 4), (16, 32, 2, 3)]


# `--norm-quant`: (name, N, K) of the projections whose input an RMSNorm makes (input_layernorm -> the packed x
# projections, q_a_layernorm -> the packed query-residual ones, post_attention_layernorm -> shared / dense gate+up)
NORM_FED = ("packed_x", "packed_q_resid", "shared_gate_up", "dense_gate_up")


# `--moe-split-sweep`: the two GEMMs' launches apart (kernels.fp8_moe._launches' 6-tuples): per row tile, the up
# GEMM's (warps, stages) with the down GEMM as the pick launches it, then the down GEMM's (BLOCK_N, warps, stages)
# under the best up launch
MOE_SPLIT_BLOCK_M = (32, 64, 128)
# two stages: a program small enough in shared memory for two to share a multiprocessor, one's MMA and scale
# promotion beside the other's loads (one program of three or more stages fills it alone)
MOE_UP_LAUNCHES = [(4, 2), (4, 3), (4, 4), (4, 5), (8, 2), (8, 3), (8, 4), (8, 5)]
MOE_DOWN_LAUNCHES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 4, 6), (128, 4, 2), (128, 4, 3), (128, 4, 4),
                     (128, 8, 2), (128, 8, 3), (128, 8, 4), (256, 8, 3), (256, 8, 4), (32, 4, 4)]


def moe_split_sweep(timed, pick: tuple) -> dict:
    """{str(6-tuple config): microseconds or why it failed}, coordinate descent from `pick` (a 4-tuple)."""
    tried: dict = {}

    def run(cfg):
        if str(cfg) not in tried:
            tried.update(_sweep(timed, [cfg]))
            print(f"moe split sweep {cfg}: {tried[str(cfg)]}", flush=True)  # a run cut short keeps what it timed
        v = tried[str(cfg)]
        return v if isinstance(v, float) else float("inf")

    for block_m in MOE_SPLIT_BLOCK_M:
        down = (pick[1], pick[2], pick[3])
        up = min(MOE_UP_LAUNCHES, key=lambda u: run((block_m, *u, *down)))
        min(MOE_DOWN_LAUNCHES, key=lambda d: run((block_m, *up, *d)))
    return tried


def fp8_ceiling(dev) -> float:
    m = 8192
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    t = time_plain(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), dev, 300)
    return 2 * m ** 3 / t / 1e12


def _weights(N, K, dev, sets):
    out = []
    for _ in range(sets):
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
        out.append((w, *quantize_weight_ref(w)))
    return out


def decode_sweep(M: int, K: int, pick: SplitKConfig) -> list[SplitKConfig]:
    """Column tile x split count x fused quantization, and the pick with 4 stages (M > 128: 128-row tiles too)."""
    num_kb = -(-K // 128)
    out = [SplitKConfig(pick.block_m, bn, s, fuse_quant=f) for bn in (64, 128) for f in (True, False)
           for s in DECODE_SPLITS if s <= num_kb]
    out.append(dataclasses.replace(pick, num_stages=4))
    if M > 128:
        out += [SplitKConfig(128, 128, s, num_warps=8, fuse_quant=f) for s in (1, 2, 4) for f in (True, False)]
    return out


def bench_gemm(dev, ceil, name, M, N, K, sweep: bool) -> dict:
    decode = M < 1024
    sets = num_sets(N * K, at_most=8) if decode else 1
    ws = _weights(N, K, dev, sets)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

    def timed(cfg):  # seconds per call of the FP8 GEMM (cfg a launch config, "default" the launcher's own
        # choice, "cublas" cuBLAS) or of bf16 `x @ W^T` (cfg None)
        def one(w):
            if cfg is None:
                return x @ w[0].t()
            if cfg in ("default", "cublas"):
                return w8a8_block_fp8_matmul(x, w[1], w[2], impl=None if cfg == "default" else cfg)
            return w8a8_block_fp8_matmul(x, w[1], w[2], config=cfg)
        calls = [lambda w=w: one(w) for w in ws]
        return time_rotating(calls, dev) if decode else time_plain(calls[0], dev, rep_ms=100)

    pick = splitk_config(M, N, K, num_sms(dev)) if decode else gemm_config(M, N, K)
    t_triton, t_bf16 = timed(pick), timed(None)
    cublas_ok = fp8_cublas.shape_fits(N, K) and fp8_cublas.available(dev)
    t_cublas = timed("cublas") if cublas_ok else None
    t_cublas_gemm = None
    if cublas_ok:  # x quantized once beforehand: what a projection costs when it shares its input's
        pre = fp8_cublas.quantize_input(x)  # quantization (engine.model.projections.project)
        calls = [lambda w=w: fp8_cublas.dense_mm(x, w[1], w[2], pre) for w in ws]
        t_cublas_gemm = time_rotating(calls, dev) if decode else time_plain(calls[0], dev, rep_ms=100)
    impl = "cublas" if fp8_cublas.use_dense(M, N, K, torch.bfloat16, dev) else "triton"
    t = t_cublas if impl == "cublas" else t_triton
    row = {"name": name, "M": M, "N": N, "K": K, "config": dataclasses.asdict(pick) if decode else list(pick),
           "impl": impl, "us": t * 1e6, "triton_us": t_triton * 1e6,
           "cublas_us": t_cublas * 1e6 if t_cublas else None,
           "cublas_gemm_only_us": t_cublas_gemm * 1e6 if t_cublas_gemm else None,
           "quant_us": time_plain(lambda: quant_act(x), dev, rep_ms=50) * 1e6, "bf16_us": t_bf16 * 1e6}
    row["triton_frac_fp8_rate"] = 2 * M * N * K / t_triton / 1e12 / ceil["fp8_tflops"]
    row["triton_frac_copy_bw"] = _frac_bw(N * K, row["triton_us"], ceil)
    if decode:
        legacy = split_decode_config(M, N, K, num_sms(dev))
        row.update(legacy_config=list(legacy), legacy_us=timed(legacy) * 1e6)
        row.update(speedup_vs_legacy=row["legacy_us"] / row["us"],
                   legacy_frac_copy_bw=_frac_bw(N * K, row["legacy_us"], ceil))
    tried = _sweep(timed, decode_sweep(M, K, pick) if decode else PREFILL_SWEEP) if sweep else {}
    timed_ok = {k: v for k, v in tried.items() if isinstance(v, float)}
    best_cfg = min(timed_ok, key=timed_ok.get) if timed_ok and min(timed_ok.values()) < row["us"] else str(pick)
    best = min([*timed_ok.values(), row["us"]])
    flops = 2 * M * N * K
    return {**row, "best_us": best, "best_config": best_cfg, "tflops": flops / t / 1e12,
            "frac_fp8_rate": flops / t / 1e12 / ceil["fp8_tflops"], "weight_tbps": N * K / t / 1e12,
            "frac_copy_bw": _frac_bw(N * K, row["us"], ceil), "speedup_vs_bf16": t_bf16 / t,
            "best_frac_fp8_rate": flops / best * 1e6 / 1e12 / ceil["fp8_tflops"],
            "best_frac_copy_bw": _frac_bw(N * K, best, ceil), "sweep_us": tried}


def bench_norm_quant(dev, ceil, name, M, N, K) -> dict:
    """An RMSNorm and the FP8 projection after it, with the input's quantization in the GEMM's path (quant_act or
    the split-K prologue, as the launcher picks) or written by the norm (`x_quant`)."""
    sets = num_sets(N * K, at_most=8)
    ws = _weights(N, K, dev, sets)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    nw = torch.randn(K, device=dev, dtype=torch.bfloat16)

    def separate(w):
        return w8a8_block_fp8_matmul(rms_norm(x, nw, 1e-6), w[1], w[2])

    def fused(w):
        y, quant = rms_norm_quant(x, nw, 1e-6)
        return w8a8_block_fp8_matmul(y, w[1], w[2], x_quant=quant)

    out = {"name": name, "M": M, "N": N, "K": K,
           "config": dataclasses.asdict(splitk_config(M, N, K, num_sms(dev))),
           "norm_us": time_rotating([lambda: rms_norm(x, nw, 1e-6)], dev) * 1e6,
           "norm_quant_us": time_rotating([lambda: rms_norm_quant(x, nw, 1e-6)], dev) * 1e6}
    for key, fn in (("separate", separate), ("fused", fused)):
        us = time_rotating([lambda w=w, fn=fn: fn(w) for w in ws], dev) * 1e6
        out[f"{key}_us"], out[f"{key}_frac_copy_bw"] = us, _frac_bw(N * K, us, ceil)
    out["saved_us"] = out["separate_us"] - out["fused_us"]
    return out


def _frac_bw(weight_bytes: int, us: float, ceil: dict) -> float:
    return weight_bytes / us * 1e6 / 1e12 / ceil["copy_tbps"]


def _sweep(timed, configs) -> dict:
    """{str(config): microseconds, or why the config failed}."""
    tried = {}
    for cfg in configs:
        try:
            tried[str(cfg)] = timed(cfg) * 1e6
        except Exception as e:  # noqa: BLE001  a config the compiler rejects (shared memory): recorded, not fatal
            tried[str(cfg)] = f"failed: {type(e).__name__}"
    return tried


def bench_moe(dev, ceil, T, E, H, inner, k, sweep: bool, split_sweep: bool = False) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * inner, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, inner, device=dev, dtype=torch.bfloat16) * inner ** -0.5
    (qg, sg), (qu, su), (q2, s2) = (quantize_weight_ref(t) for t in (w13[:, :inner], w13[:, inner:], w2))
    q13, s13 = torch.cat([qg, qu], 1), merge_gate_up_scales(sg, su)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices  # balanced over the local experts
    weights = torch.rand(T, k, device=dev, generator=g)
    pick = moe_config(ids.numel(), E)

    def timed(fn):  # decode: CUDA-graph replays (no host gaps between the routing ops and the GEMMs)
        return time_rotating([fn], dev) if T < 1024 else time_plain(fn, dev, rep_ms=200)

    t_triton = timed(lambda: fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, config=pick))
    t_bf16 = timed(lambda: fused_moe(x, w13, w2, weights, ids))
    cublas = fp8_cublas.use_moe(T, ids.numel(), E, H, inner, x.dtype, dev)  # the launcher's choice
    cublas_ok = T >= 1024 and fp8_cublas.moe_fits(H, inner) and fp8_cublas.available(dev)  # timed eagerly only
    t_cublas = timed(lambda: fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, impl="cublas")) if cublas_ok else None
    t = t_cublas if cublas else t_triton
    tried = {}
    if sweep:
        for cfg in MOE_SWEEP + (MOE_SMALL_SWEEP if T < 64 else []):
            try:
                tried[str(cfg)] = timed(lambda c=cfg: fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, config=c)) * 1e6
            except Exception as e:  # noqa: BLE001
                tried[str(cfg)] = f"failed: {type(e).__name__}"
    if split_sweep:
        def with_config(c):
            return timed(lambda: fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, config=c))
        tried.update(moe_split_sweep(with_config, pick))
    best = min([v for v in tried.values() if isinstance(v, float)] + [t * 1e6])
    best_cfg = min(((v, c) for c, v in tried.items() if isinstance(v, float)), default=(t * 1e6, str(pick)))[1]
    flops = T * k * 3 * 2 * H * inner
    wbytes = E * 3 * H * inner
    touched = int(ids.unique().numel())  # the experts the batch reads: at small T not all of them
    tbytes = touched * 3 * H * inner
    return {"name": f"moe T={T} E={E} k={k}", "T": T, "E": E, "H": H, "I": inner, "config": list(pick),
            "impl": "cublas" if cublas else "triton", "triton_us": t_triton * 1e6,
            "cublas_out_arg": fp8_cublas._OUT_ARG[0] if cublas_ok else None,  # False: each GEMM's rows copied
            "cublas_us": t_cublas * 1e6 if t_cublas else None,
            "triton_frac_fp8_rate": flops / t_triton / 1e12 / ceil["fp8_tflops"], "us": t * 1e6, "best_us": best,
            "bf16_us": t_bf16 * 1e6, "tflops": flops / t / 1e12,
            "frac_fp8_rate": flops / t / 1e12 / ceil["fp8_tflops"], "weight_tbps": wbytes / t / 1e12,
            "frac_copy_bw": wbytes / t / 1e12 / ceil["copy_tbps"], "speedup_vs_bf16": t_bf16 / t,
            "touched_experts": touched, "touched_frac_copy_bw": tbytes / t / 1e12 / ceil["copy_tbps"],
            "best_touched_frac_copy_bw": tbytes / best * 1e6 / 1e12 / ceil["copy_tbps"],
            "best_frac_fp8_rate": flops / best * 1e6 / 1e12 / ceil["fp8_tflops"],
            "best_frac_copy_bw": wbytes / best * 1e6 / 1e12 / ceil["copy_tbps"], "best_config": best_cfg,
            "sweep_us": tried}


def bench_absorbed(dev, T, H=64, nope=192, v=256, R=512, ceil: dict | None = None) -> dict:
    """MLA's absorbed matmuls on bf16 W_UK / W_UV; the FP8 path the model takes by default (dequantize kv_b_proj,
    then the same einsums); and the FP8 rows read in place (kernels.fp8_absorbed.absorbed_matmul). Decode sizes
    (T < 1,024) replay every case over several weight copies, so the weights come from HBM as in a step."""
    sets = num_sets(H * (nope + v) * R, at_most=8) if T < 1024 else 1
    ws_ = []
    for _ in range(sets):
        w = torch.randn(H * (nope + v), R, device=dev, dtype=torch.bfloat16) * R ** -0.5
        ws_.append((w, *quantize_weight_ref(w)))
    q = torch.randn(T, H, nope, device=dev, dtype=torch.bfloat16)
    o = torch.randn(T, H, R, device=dev, dtype=torch.bfloat16)

    def fp8_both(wq, ws):
        wd = dequantize_fp8(wq, ws).view(H, nope + v, R)
        torch.einsum("thn,hnr->thr", q, wd[:, :nope])
        torch.einsum("thr,hvr->thv", o, wd[:, nope:])

    def in_place_both(wq, ws):
        absorbed_matmul(q, wq, ws, H, nope, "uk")
        absorbed_matmul(o, wq, ws, H, nope, "uv")

    cases = {"bf16_uk": lambda w, wq, ws: torch.einsum("thn,hnr->thr", q, w.view(H, nope + v, R)[:, :nope]),
             "bf16_uv": lambda w, wq, ws: torch.einsum("thr,hvr->thv", o, w.view(H, nope + v, R)[:, nope:]),
             "fp8_dequant": lambda w, wq, ws: dequantize_fp8(wq, ws),
             "fp8_dequant_uk_uv": lambda w, wq, ws: fp8_both(wq, ws),
             "fp8_in_place_uk": lambda w, wq, ws: absorbed_matmul(q, wq, ws, H, nope, "uk"),
             "fp8_in_place_uv": lambda w, wq, ws: absorbed_matmul(o, wq, ws, H, nope, "uv"),
             "fp8_in_place_uk_uv": lambda w, wq, ws: in_place_both(wq, ws)}
    fp8_bytes = H * (nope + v) * R
    out = {"T": T, "weight_sets": sets, "bf16_bytes": 2 * fp8_bytes, "fp8_bytes": fp8_bytes}
    for name, fn in cases.items():
        calls = [lambda w=w: fn(*w) for w in ws_]
        out[name + "_us"] = (time_rotating(calls, dev) if T < 1024 else time_plain(calls[0], dev, rep_ms=50)) * 1e6
    if ceil and ceil.get("copy_tbps"):  # the in-place pair against reading the FP8 bytes once at copy speed
        tbps = fp8_bytes / (out["fp8_in_place_uk_uv_us"] * 1e-6) / 1e12
        out["fp8_in_place_frac_copy_bw"] = tbps / ceil["copy_tbps"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="three shapes only")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--decode-only", action="store_true", help="the GEMM's decode rows (M = 64, 256) alone")
    p.add_argument("--moe-only", action="store_true", help="the grouped MoE rows alone")
    p.add_argument("--only", default=None, metavar="NAMES", help="comma-separated projection names (GEMM rows only)")
    p.add_argument("--rows", default=None, metavar="MS", help="comma-separated M values (default 8192,64,256)")
    p.add_argument("--moe-split-sweep", action="store_true",
                   help="also sweep the MoE's up and down GEMM launches apart (6-tuple configs)")
    p.add_argument("--norm-quant", action="store_true",
                   help="the norm-fed projections with the input's quantization written by the norm, against not")
    p.add_argument("--absorbed-only", action="store_true",
                   help="MLA's absorbed matmuls alone (copy vs FP8 read in place) at --rows (default 4,16,64,256,8192)")
    p.add_argument("--moe-tokens", default="8192,2048,256,64", metavar="TS",
                   help="comma-separated token counts of the grouped MoE rows (4 / 16: B = 1 / 4 with MTP3)")
    a = p.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    ceil["fp8_tflops"] = fp8_ceiling(dev)
    print(json.dumps(ceil), flush=True)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "ceilings": ceil, "gemm": [], "moe": []}
    import triton
    res["triton"] = triton.__version__
    if a.absorbed_only:
        res["absorbed"] = []
        for T in [int(m) for m in a.rows.split(",")] if a.rows else (4, 16, 64, 256, 8192):
            r = bench_absorbed(dev, T, ceil=ceil)
            res["absorbed"].append(r)
            _save(a.out, res, r)
        return
    if a.norm_quant:
        res["norm_quant"] = []
        for M in [int(m) for m in a.rows.split(",")] if a.rows else (4, 16, 64, 256):
            for name, N, K in [s for s in SHAPES if s[0] in NORM_FED]:
                r = bench_norm_quant(dev, ceil, name, M, N, K)
                res["norm_quant"].append(r)
                _save(a.out, res, r)
        return
    shapes = SHAPES[:3] if a.quick else SHAPES
    if a.only:
        names = a.only.split(",")
        unknown = sorted(set(names) - {n for n, _, _ in SHAPES})
        if unknown:
            p.error(f"unknown projection(s) {unknown}; known: {[n for n, _, _ in SHAPES]}")
        shapes = [s for s in SHAPES if s[0] in names]
    rows = [int(m) for m in a.rows.split(",")] if a.rows else (64, 256) if a.decode_only else (8192, 64, 256)
    for M in () if a.moe_only else rows:
        for name, N, K in shapes:
            r = bench_gemm(dev, ceil, name, M, N, K, not a.no_sweep)
            res["gemm"].append(r)
            _save(a.out, res, r)
    if a.decode_only or a.only:
        return
    for T in (int(t) for t in a.moe_tokens.split(",")):  # ids spread evenly over the 32 local experts (balanced EP8)
        r = bench_moe(dev, ceil, T, 32, 6144, 2048, 8, not a.no_sweep, a.moe_split_sweep)
        res["moe"].append(r)
        _save(a.out, res, r)
    if a.moe_only:
        return
    res["absorbed"] = [bench_absorbed(dev, T, ceil=ceil) for T in (64, 256, 8192)]
    _save(a.out, res, {"absorbed": res["absorbed"]})


def _save(path: str, res: dict, row: dict) -> None:
    """Print the row and rewrite the whole file: a run cut short keeps what it measured."""
    print(json.dumps({k: v for k, v in row.items() if k != "sweep_us"}), flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
