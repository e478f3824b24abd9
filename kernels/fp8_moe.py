"""Grouped MoE GEMM with FP8 block-scaled expert weights (w8a8), SiLU-and-mul fused, usable under EP.

Expert weights in the checkpoint format (docs/fp8.md), experts stacked:
  w13 float8_e4m3fn [E, 2I, H] (gate rows then up rows); w13_scale fp32 [E, 2 * ceil(I/128), ceil(H/128)]
      (gate's scale rows then up's: each half keeps its own 128-row blocks, so I need not be a multiple of 128)
  w2  float8_e4m3fn [E, H, I];   w2_scale  fp32 [E, ceil(H/128), ceil(I/128)]
y[t] = sum_j weights[t, j] * W2[e] (silu(W_gate[e] x_t) * (W_up[e] x_t)),  e = ids[t, j] - expert_offset;
ids outside this rank's [offset, offset + E) are skipped (expert parallelism).

x is quantized per token per 128 channels once (kernels.fp8_quant.quant_act); the first GEMM's epilogue
quantizes h the same way (its 128-wide column tile is exactly one scale block), so the second GEMM
reads fp8 h and its scales. Assignments are sorted by expert with `kernels.moe_routing.sort_by_expert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import fp8_cublas
from kernels.fp8_quant import BLOCK, dequant_act_ref, dequantize_weight_ref, quant_act, quant_act_ref
from kernels.moe import sort_assignments
from kernels.moe_routing import assignment_rows, combine, sort_by_expert
from kernels.triton_support import check_device, interpreting, jit, to_e4m3


@jit
def _fp8_moe_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, rows_ptr, block_expert_ptr,
                       num_experts, top_k, hidden, inter, num_kb, inter_blocks,
                       sx_t, sxs_t, sw_e, sw_n, sws_e, sws_n, sh_r, shs_r,
                       BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """h[r, n] = silu(x . gate[n]) * (x . up[n]) for one expert's BLOCK_M sorted rows and one 128-column
    block n, written as e4m3 codes plus one scale per row (the block's amax / 448)."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < num_experts:
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(rows_ptr + r)
        ok = a >= 0
        tok = tl.where(ok, a // top_k, 0).to(tl.int64)
        nb = tl.program_id(1)
        n = nb * 128 + tl.arange(0, 128)
        n_ok = n < inter
        w_gate = w_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
        w_up = w_gate + inter * sw_n
        s_gate = ws_ptr + e * sws_e + nb * sws_n
        s_up = s_gate + inter_blocks * sws_n
        acc_g = tl.zeros([BLOCK_M, 128], tl.float32)
        acc_u = tl.zeros([BLOCK_M, 128], tl.float32)
        for kb in range(num_kb):
            k = kb * 128 + tl.arange(0, 128)
            k_ok = k < hidden
            x = tl.load(x_ptr + tok[:, None] * sx_t + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            xs = tl.load(xs_ptr + tok * sxs_t + kb, mask=ok, other=0.0)
            wm = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_gate + k[:, None], mask=wm, other=0.0)
            wu = tl.load(w_up + k[:, None], mask=wm, other=0.0)
            if DOT_F32:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                pg = tl.dot(x, wg, input_precision="ieee")
                pu = tl.dot(x, wu, input_precision="ieee")
            else:
                pg = tl.dot(x, wg)
                pu = tl.dot(x, wu)
            acc_g += pg * (xs * tl.load(s_gate + kb))[:, None]
            acc_u += pu * (xs * tl.load(s_up + kb))[:, None]
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        h = tl.where(n_ok[None, :], h, 0.0)
        amax = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10)
        hs = amax / 448.0
        v = tl.minimum(tl.maximum(h / hs[:, None], -448.0), 448.0)
        r64 = r.to(tl.int64)
        tl.store(h_ptr + r64[:, None] * sh_r + n[None, :], to_e4m3(v, ROUND_FIRST), mask=ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + r64 * shs_r + nb, hs, mask=ok)


@jit
def _fp8_moe_down_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, rows_ptr, block_expert_ptr, weights_ptr,
                         num_experts, hidden, inter, num_kb, sh_r, shs_r, sw_e, sw_n, sws_e, sws_n, sy_a,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """y[a, n] = weights[a] * (h[r] . w2[e, n]) in fp32, one row per assignment a."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < num_experts:
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(rows_ptr + r)
        ok = a >= 0
        r64 = r.to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = w_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
        s_rows = ws_ptr + e * sws_e + (n // 128).to(tl.int64) * sws_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(num_kb):
            k = kb * 128 + tl.arange(0, 128)
            k_ok = k < inter
            h = tl.load(h_ptr + r64[:, None] * sh_r + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            hs = tl.load(hs_ptr + r64 * shs_r + kb, mask=ok, other=0.0)
            w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            ws = tl.load(s_rows + kb, mask=n_ok, other=0.0)
            if DOT_F32:
                part = tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(h, w)
            acc += part * hs[:, None] * ws[None, :]
        wt = tl.load(weights_ptr + a, mask=ok, other=0.0)
        tl.store(y_ptr + tl.where(ok, a, 0).to(tl.int64)[:, None] * sy_a + n[None, :], acc * wt[:, None],
                 mask=ok[:, None] & n_ok[None, :])


def _check(x, w13, w13_scale, w2, w2_scale, weights, ids) -> tuple[int, int, int, int]:
    T, H = x.shape
    E, two_i, H_w = w13.shape
    inner = two_i // 2
    ib, hb = triton.cdiv(inner, BLOCK), triton.cdiv(H, BLOCK)
    if H_w != H or tuple(w2.shape) != (E, H, inner) or weights.shape != ids.shape or ids.shape[0] != T:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, weights "
                         f"{tuple(weights.shape)}, ids {tuple(ids.shape)} do not fit [T,H], [E,2I,H], [E,H,I], [T,k]")
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w13 and w2 must be float8_e4m3fn, got {w13.dtype}, {w2.dtype}")
    for name, s, want in (("w13_scale", w13_scale, (E, 2 * ib, hb)), ("w2_scale", w2_scale, (E, hb, ib))):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 {want}, got {s.dtype} {tuple(s.shape)}")
    return T, H, E, inner


def _config(num_assign: int, num_experts: int) -> tuple:
    """(BLOCK_M, BLOCK_N of the down GEMM, num_warps, num_stages), both GEMMs launched alike, or the 6-tuple of
    `_launches` where the up and down GEMMs are best launched apart (the H200 sweep of each GEMM's warps, stages
    and down tile, bench/data/fp8-gemm/NOTES.md)."""
    if interpreting():
        return 16, 32, 4, 1
    if num_assign >= 64 * num_experts:  # prefill: 128-row tiles (best of the H200 sweep, BENCHMARKS.md)
        return 128, 128, 8, 3
    if num_assign > 16 * num_experts:  # 128 tokens: 351 us against 444 alike (64, 128, 8, 3)
        return 64, 8, 5, 128, 4, 4
    if num_assign > 4 * num_experts:  # decode, 16 rows per expert or fewer; 64 tokens: 336 us against 346 alike
        return 32, 4, 3, 128, 4, 4
    # 4 or fewer (B <= 4 with MTP3): 16-row tiles, 17-20% faster at 4 tokens and 8% at 16 than 32-row ones (H200
    # sweep, bench/data/fp8-gemm/NOTES.md)
    return 16, 64, 4, 4


def _launches(config: tuple) -> tuple[int, tuple[int, int], tuple[int, int, int]]:
    """A config -> (BLOCK_M, (up num_warps, num_stages), (down BLOCK_N, num_warps, num_stages)). A config is
    `_config`'s 4-tuple (both GEMMs launched alike) or a 6-tuple (BLOCK_M, up warps, up stages, down BLOCK_N,
    down warps, down stages): the up GEMM (a 128-column block of gate and of up, K = H) and the down GEMM
    (K = I, an eighth of it at GLM-5.3 widths) have different shapes, and at decode sizes different best tiles."""
    if len(config) == 4:
        block_m, block_n, warps, stages = config
        return block_m, (warps, stages), (block_n, warps, stages)
    if len(config) == 6:
        return config[0], (config[1], config[2]), (config[3], config[4], config[5])
    raise ValueError(f"an MoE config has 4 or 6 entries, got {config!r}")


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_offset: int = 0,
                  config: tuple | None = None, small_routing: bool = True, impl: str | None = None,
                  assignments: int | None = None,
                  x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton `fused_moe_fp8_ref` (same arguments); no host synchronisation. Returns x's dtype [T, H].

    x_quantized: x's FP8 codes [T, H] and per-128 scales [T, H / 128] as `quant_act` gives them, any row
    strides, made where x was (the static EP dispatch quantizes a rank's rows at home and sends them in FP8);
    x is then read for its shape, dtype and device only (a stride-0 view will do). The result is the same as
    quantizing x here. Always the Triton kernels.
    assignments: how many of ids' assignments are this rank's, as far as the caller knows (the tiles are
    picked by it; default all of them): the static EP dispatch hands every rank all the group's rows, of
    which about one in D has an expert here.
    small_routing: sort and combine the assignments with kernels.moe_routing's one-launch kernels (the
    sort at decode sizes; False: the eager sort, zeroed rows and a torch sum, for comparison).
    On Hopper, prefill batches (kernels.fp8_cublas.use_moe: >= 1,024 tokens and 2,048 assignments per
    local expert, bf16, outside graph capture) run one
    cuBLAS block-scaled GEMM per expert instead (kernels.fp8_cublas: one host synchronisation per call);
    `impl` "triton" or "cublas" forces one."""
    T, H, E, inner = _check(x, w13, w13_scale, w2, w2_scale, weights, ids)
    check_device(x, w13, w13_scale, w2, w2_scale, weights, ids)
    top_k = ids.shape[1]
    if T == 0 or top_k == 0:
        return torch.zeros_like(x)
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    w13_scale = w13_scale if w13_scale.stride(2) == 1 else w13_scale.contiguous()
    w2_scale = w2_scale if w2_scale.stride(2) == 1 else w2_scale.contiguous()
    if x_quantized is not None:
        xq, xs = x_quantized
        if tuple(xq.shape) != (T, H) or tuple(xs.shape) != (T, triton.cdiv(H, BLOCK)) or xs.dtype != torch.float32 \
                or xq.stride(1) != 1 or xs.stride(1) != 1 or impl == "cublas":
            raise ValueError(f"x_quantized must be codes [{T}, {H}] and fp32 scales [{T}, {triton.cdiv(H, BLOCK)}] "
                             f"with unit column stride (Triton only), got {tuple(xq.shape)}, {tuple(xs.shape)} "
                             f"{xs.dtype}")
        impl = "triton"
    auto = config is None and impl is None and fp8_cublas.use_moe(T, ids.numel(), E, H, inner, x.dtype, x.device)
    can = impl == "cublas" and x.dtype == torch.bfloat16 and fp8_cublas.moe_fits(H, inner) and \
        fp8_cublas.available(x.device) and not fp8_cublas.capturing(x.device)
    # `impl` is checked whatever the config; a config runs the Triton kernel it names
    if fp8_cublas.chosen(impl, auto, can, f"this MoE (H {H}, I {inner}, {x.dtype}) on {x.device}") and config is None:
        return fp8_cublas.fused_moe_fp8_cublas(x, w13, w13_scale, w2, w2_scale, weights, ids, expert_offset)
    config = config or _config(assignments or ids.numel(), E)
    block_m, (up_warps, up_stages), (block_n, warps, stages) = _launches(config)
    rows, block_expert = sort_by_expert(ids, E, expert_offset, block_m, small_routing)
    xq, xs = x_quantized if x_quantized is not None else quant_act(x)
    ib, hb = triton.cdiv(inner, BLOCK), triton.cdiv(H, BLOCK)
    h = torch.empty((rows.shape[0], inner), dtype=torch.uint8, device=x.device)
    hs = torch.empty((rows.shape[0], ib), dtype=torch.float32, device=x.device)
    y = assignment_rows(T * top_k, H, small_routing, x.device)
    nb = block_expert.shape[0]
    dot_f32 = interpreting()
    _fp8_moe_up_kernel[(nb, ib)](
        xq, xs, w13, w13_scale, h, hs, rows, block_expert, E, top_k, H, inner, hb, ib,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        h.stride(0), hs.stride(0), BLOCK_M=block_m, DOT_F32=dot_f32, ROUND_FIRST=interpreting(),
        num_warps=up_warps, num_stages=up_stages)
    w_flat = weights.reshape(-1).float().contiguous()
    _fp8_moe_down_kernel[(nb, triton.cdiv(H, block_n))](
        h.view(torch.float8_e4m3fn), hs, w2, w2_scale, y, rows, block_expert, w_flat, E, H, inner, ib,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32, num_warps=warps, num_stages=stages)
    return combine(y, ids, E, expert_offset, x.dtype, small_routing)


def merge_gate_up_scales(gate_scale: torch.Tensor, up_scale: torch.Tensor) -> torch.Tensor:
    """Per-expert gate/up scales [..., ceil(I/128), Hb] -> the stacked w13_scale layout [..., 2 ceil(I/128), Hb]."""
    return torch.cat([gate_scale, up_scale], dim=-2)


def dequantize_w13_ref(w13: torch.Tensor, w13_scale: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] e4m3 + [E, 2Ib, Hb] scales -> fp32, each half with its own scale blocks."""
    inner, ib = w13.shape[1] // 2, w13_scale.shape[1] // 2
    return torch.cat([dequantize_weight_ref(w13[:, :inner], w13_scale[:, :ib]),
                      dequantize_weight_ref(w13[:, inner:], w13_scale[:, ib:])], dim=1)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      expert_offset: int = 0, assignments: int | None = None) -> torch.Tensor:
    """fp32 semantics of `fused_moe_fp8`: x and h quantized per token per 128 channels, weights dequantized,
    fp32 matmuls. Vectorised over experts (padded [E, max_count, H] batches), as `fused_moe_ref`.
    `assignments` (the kernel's tile hint) changes nothing here."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inner = two_i // 2
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    sorted_ = sort_assignments(ids, weights, E, expert_offset)
    if sorted_ is None:
        return out.to(x.dtype)
    e, tok, w, slot, counts = sorted_
    xd = dequant_act_ref(*quant_act_ref(x))
    batch = torch.zeros((E, int(counts.max()), H), dtype=torch.float32, device=x.device)
    batch[e, slot] = xd[tok]
    g = torch.bmm(batch, dequantize_w13_ref(w13, w13_scale).transpose(1, 2))
    h = (F.silu(g[..., :inner]) * g[..., inner:])[e, slot]
    hd = dequant_act_ref(*quant_act_ref(h))
    hb = torch.zeros((E, int(counts.max()), inner), dtype=torch.float32, device=x.device)
    hb[e, slot] = hd
    y = torch.bmm(hb, dequantize_weight_ref(w2, w2_scale).transpose(1, 2))[e, slot]
    out.index_add_(0, tok, y * w[:, None])
    return out.to(x.dtype)
