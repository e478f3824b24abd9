"""Block-scaled FP8 GEMMs through cuBLAS on Hopper, for the prefill shapes (and the widest decode ones).

cuBLAS (12.9 and later) multiplies e4m3 operands with DeepSeek-style block scales itself: one fp32 scale per
token per 128 channels on the activation (the 1x128 recipe) and one per 128x128 block on the weight, which is
exactly this project's format (kernels.fp8_gemm). PyTorch exposes it as `torch._scaled_mm` when the scale
shapes say so. Why use it: the Triton kernel waits on each 128-deep MMA block before it can scale and add it
(kernels.fp8_gemm) and reaches 49-58% of the FP8 matmul rate at prefill shapes on the H200; cuBLAS keeps
the tensor cores busy across the promotion (75-90% on the same shapes, BENCHMARKS.md), as DeepGEMM does.

What cuBLAS needs, found on the H200 with torch 2.11 / CUDA 13: the weight as the column-major right
operand (`weight.t()` of [N, K]), its scales as `scale.t()` of [N/128, K/128] (strides (1, K/128), so K/128
must be a multiple of 4: K % 512 == 0 here), the activation scales column-major [M, K/128] (strides (1, M)),
and M a multiple of 4 (it rejects M = 1, 63 or 8,193: `quant_act` pads the rows). bf16 output.

* `dense_mm(x, weight, scale)`: one projection (kernels.fp8_gemm.w8a8_block_fp8_matmul calls it where
  `use_dense` says).
* `fused_moe_fp8_cublas(...)`: the grouped MoE for prefill batches as one cuBLAS call per local expert and
  GEMM, with three Triton launches around them: `_gather_quant_kernel` (each assignment's token row,
  quantized, written in expert order with each expert's scales as their own column-major block),
  `_silu_quant_kernel` (SiLU(gate) * up, quantized the same way) and `_combine_sorted_kernel` (each token's
  weighted expert rows summed). cuBLAS needs each expert's row count on the host: the routing costs one
  device-to-host copy of E + 1 integers per layer, so this path is for eager prefill only (never under CUDA
  graph capture: the launcher keeps the Triton kernel there), and only at >= 2,048 assignments per expert,
where the GPU time of each GEMM outweighs its host cost.

`available(device)` says whether this torch and cuBLAS take the recipe (one small call, cached per device).
The Triton kernel stays behind it for every other device and shape, under CUDA graph capture of the MoE, and
where a caller asks for it (`impl="triton"` of kernels.fp8_gemm.w8a8_block_fp8_matmul and
kernels.fp8_moe.fused_moe_fp8: the benchmarks' side-by-side, bench/kernels/fp8_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import BLOCK, dequant_act_ref, dequantize_weight_ref, quant_act
from kernels.moe_routing import align_by_expert
from kernels.triton_support import interpreting, jit, quant_e4m3_rows, to_bf16

ROW_ALIGN = 16  # each expert's rows are padded to this (cuBLAS wants M % 4 == 0 and aligned scale blocks)
DENSE_MIN_M = 129  # at M <= 128 the split-K Triton kernel is faster at every GLM-5.3 shape (H200)
DENSE_DECODE_MIN_WEIGHT = 24 << 20  # at 129..256 rows cuBLAS wins only on weights of >= 24 Mi elements
# The grouped MoE goes to cuBLAS at >= 2,048 assignments per local expert (8,192 tokens, top-8, 32 experts:
# 1.32x faster than the Triton kernel on the H200); at 512 per expert it is 2.4x slower, host-bound on its
# 2E GEMM calls (each a cuBLAS heuristic query) and the routing's host synchronisation.
MOE_MIN_ROWS_PER_EXPERT = 2048
MOE_MIN_TOKENS = 1024  # and at prefill sizes only: a decode step must not wait on the host

_AVAILABLE: dict[int, bool] = {}


def available(device: torch.device) -> bool:
    """cuBLAS block-scaled FP8 on this device: Hopper (sm_90), and one 16 x 128 x 512 call that runs."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _AVAILABLE:
        ok = torch.cuda.get_device_capability(index) == (9, 0) and hasattr(torch, "_scaled_mm")
        if ok and not torch.cuda.is_current_stream_capturing():
            try:
                dev = torch.device("cuda", index)
                a = torch.zeros(16, 512, device=dev).to(torch.float8_e4m3fn)
                b = torch.zeros(128, 512, device=dev).to(torch.float8_e4m3fn)
                sa = torch.ones(4, 16, device=dev).t()
                sb = torch.ones(1, 4, device=dev)
                torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
                torch.cuda.synchronize(dev)
            except (RuntimeError, ValueError, TypeError):
                ok = False
        elif ok:  # first asked while capturing: no trial call, and not cached (asked again eagerly)
            return True
        _AVAILABLE[index] = ok
    return _AVAILABLE[index]


def chosen(impl: str | None, automatic: bool, can_run: bool, what: str) -> bool:
    """A launcher's decision: `impl` None takes the measured rule (`automatic`), "cublas" demands cuBLAS (a
    ValueError naming `what` where it cannot run), "triton" declines it."""
    if impl not in (None, "triton", "cublas"):
        raise ValueError(f"impl must be 'triton' or 'cublas', got {impl!r}")
    if impl == "cublas" and not can_run:
        raise ValueError(f"cuBLAS's block-scaled GEMM does not take {what}")
    return automatic if impl is None else impl == "cublas"


def shape_fits(N: int, K: int) -> bool:
    return K % (4 * BLOCK) == 0 and N % 16 == 0


def use_dense(M: int, N: int, K: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """The launcher's choice (H200 measurements, BENCHMARKS.md "FP8 block-scaled weights")."""
    if out_dtype != torch.bfloat16 or not shape_fits(N, K) or M < DENSE_MIN_M:
        return False
    if M <= 256 and N * K < DENSE_DECODE_MIN_WEIGHT:
        return False
    return available(device)


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> the activation operand cuBLAS takes: e4m3 codes [M4, K] and column-major scales
    [M4, K/128], M4 = M rounded up to a multiple of 4. One quantization can feed several projections of x."""
    return quant_act(x, col_major_scales=True, pad_rows_to=4)


def dense_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
             quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """bf16 [M, N] = x [M, K] @ (weight * scales)^T, x quantized per token per 128 channels (operands checked
    by kernels.fp8_gemm.w8a8_block_fp8_matmul), or `quantized` = quantize_input(x) when given."""
    q, s = quantized if quantized is not None else quantize_input(x)
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale_inv.t(), out_dtype=torch.bfloat16)
    return y[: x.shape[0]]


# ---- the grouped MoE -------------------------------------------------------------------------------------

@triton.jit
def _store_scales(s_ptr, seg_start_ptr, seg_len_ptr, e, r, kb, s):
    """Scales s of sorted rows r (int64), scale column kb, into expert e's column-major block: element
    (r, kb) at start * num_kb + kb * len + (r - start), num_kb = the grid's second dimension."""
    start = tl.load(seg_start_ptr + e).to(tl.int64)
    length = tl.load(seg_len_ptr + e).to(tl.int64)
    tl.store(s_ptr + start * tl.num_programs(1) + kb * length + (r - start), s)


@jit
def _gather_quant_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, block_expert_ptr, seg_start_ptr, seg_len_ptr,
                         num_experts, top_k, K, sx_t, sq_r,
                         BLOCK_R: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Sorted rows r of one block (one expert's): codes of x[token of rows[r]] (zeros for padding) and its
    scales at s[start * kb + kb_index * len + (r - start)] (the expert's [kb, len] block)."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < num_experts:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        a = tl.load(rows_ptr + r)
        ok = a >= 0
        tok = tl.where(ok, a // top_k, 0).to(tl.int64)
        kb = tl.program_id(1)
        k = kb * 128 + tl.arange(0, 128)
        x = tl.load(x_ptr + tok[:, None] * sx_t + k[None, :], mask=ok[:, None] & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        q, s = quant_e4m3_rows(x, ROUND_FIRST)
        r64 = r.to(tl.int64)
        tl.store(q_ptr + r64[:, None] * sq_r + k[None, :], q)
        _store_scales(s_ptr, seg_start_ptr, seg_len_ptr, e, r64, kb, s)


@jit
def _silu_quant_kernel(g_ptr, q_ptr, s_ptr, block_expert_ptr, seg_start_ptr, seg_len_ptr, num_experts, inter,
                       sg_r, sq_r, BLOCK_R: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """h = silu(g[:, :inter]) * g[:, inter:] of one block's rows and 128 columns -> codes and scales in the
    layout of `_gather_quant_kernel`."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < num_experts:
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        nb = tl.program_id(1)
        n = nb * 128 + tl.arange(0, 128)
        g = tl.load(g_ptr + r[:, None] * sg_r + n[None, :]).to(tl.float32)
        u = tl.load(g_ptr + r[:, None] * sg_r + inter + n[None, :]).to(tl.float32)
        q, s = quant_e4m3_rows(g * tl.sigmoid(g) * u, ROUND_FIRST)
        tl.store(q_ptr + r[:, None] * sq_r + n[None, :], q)
        _store_scales(s_ptr, seg_start_ptr, seg_len_ptr, e, r, nb, s)


@jit
def _combine_sorted_kernel(d_ptr, pos_ptr, w_ptr, out_ptr, H, top_k, sd_r, so_t,
                           BLOCK_H: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """out[t] = sum_j weights[t, j] * d[pos[t, j]] in fp32 (pos -1: not this rank's expert)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    nm = n < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(top_k):
        p = tl.load(pos_ptr + t * top_k + j).to(tl.int64)
        w = tl.load(w_ptr + t * top_k + j)
        mine = (p >= 0).to(tl.int32) + tl.zeros([BLOCK_H], tl.int32)
        row = tl.load(d_ptr + tl.maximum(p, 0) * sd_r + n, mask=nm & (mine != 0), other=0.0).to(tl.float32)
        acc += w * row
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + t * so_t + n, to_bf16(acc, ROUND_FIRST), mask=nm)
    else:
        tl.store(out_ptr + t * so_t + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def moe_fits(H: int, inner: int) -> bool:
    return H % (4 * BLOCK) == 0 and inner % (4 * BLOCK) == 0


def use_moe(num_tokens: int, num_assign: int, num_experts: int, H: int, inner: int, out_dtype: torch.dtype,
            device: torch.device) -> bool:
    """The launcher's choice: prefill batches (>= MOE_MIN_TOKENS tokens, >= MOE_MIN_ROWS_PER_EXPERT
    assignments per local expert), bf16, shapes cuBLAS takes, never while a CUDA graph is being captured."""
    if out_dtype != torch.bfloat16 or not moe_fits(H, inner) or num_tokens < MOE_MIN_TOKENS or \
            num_assign < MOE_MIN_ROWS_PER_EXPERT * num_experts:
        return False
    return available(device) and not capturing(device)


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_OUT_ARG: list[bool] = [True]  # whether this torch's _scaled_mm takes `out=` with block scales


def _scaled_mm(a, b_t, scale_a, scale_b_t, out):
    """cuBLAS into `out` (a row slice of the sorted outputs), or into a new tensor copied there."""
    if _OUT_ARG[0]:
        try:
            torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b_t, out_dtype=out.dtype, out=out)
            return
        except (TypeError, RuntimeError):
            _OUT_ARG[0] = False
    out.copy_(torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b_t, out_dtype=out.dtype))


def fused_moe_fp8_cublas(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                         w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_offset: int = 0,
                         mm=_scaled_mm, inter_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """kernels.fp8_moe.fused_moe_fp8 (same arguments, checked there) as one block-scaled GEMM per local
    expert and GEMM. `mm(a, b_t, scale_a, scale_b_t, out)` is the GEMM (cuBLAS; tests pass a torch
    reference on CPU); `inter_dtype` the gate/up and down outputs' dtype (bf16 with cuBLAS)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inner, top_k = two_i // 2, ids.shape[1]
    hb, ib = H // BLOCK, inner // BLOCK
    dev = x.device
    w13, w13_scale, w2, w2_scale = (t.contiguous() for t in (w13, w13_scale, w2, w2_scale))  # no-ops as loaded
    rows, block_expert = align_by_expert(ids, E, expert_offset, ROW_ALIGN)
    key = ids.reshape(-1).long() - expert_offset
    counts = torch.bincount(torch.where((key >= 0) & (key < E), key, E), minlength=E + 1)[:E]
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    seg_len = padded.to(torch.int32)
    seg_start = (torch.cumsum(padded, 0) - padded).to(torch.int32)
    lengths = padded.tolist()  # the one host synchronisation: cuBLAS takes each expert's rows from the host
    R = rows.shape[0]
    q = torch.empty((R, H), dtype=torch.uint8, device=dev)
    qs = torch.empty(R * hb, dtype=torch.float32, device=dev)
    nblocks = block_expert.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    _gather_quant_kernel[(nblocks, hb)](x, q, qs, rows, block_expert, seg_start, seg_len, E, top_k, H, x.stride(0),
                                        q.stride(0), BLOCK_R=ROW_ALIGN, ROUND_FIRST=interpreting())
    q = q.view(torch.float8_e4m3fn)
    g = torch.empty((R, two_i), dtype=inter_dtype, device=dev)
    h = torch.empty((R, inner), dtype=torch.uint8, device=dev)
    hs = torch.empty(R * ib, dtype=torch.float32, device=dev)
    d = torch.empty((R, H), dtype=inter_dtype, device=dev)
    start = 0
    spans = []
    for e, n in enumerate(lengths):
        if n:
            spans.append((e, start, n))
        start += n
    for e, s, n in spans:
        mm(q[s:s + n], w13[e].t(), qs[s * hb:(s + n) * hb].view(hb, n).t(), w13_scale[e].t(), g[s:s + n])
    _silu_quant_kernel[(nblocks, ib)](g, h, hs, block_expert, seg_start, seg_len, E, inner, g.stride(0),
                                      h.stride(0), BLOCK_R=ROW_ALIGN, ROUND_FIRST=interpreting())
    h = h.view(torch.float8_e4m3fn)
    for e, s, n in spans:
        mm(h[s:s + n], w2[e].t(), hs[s * ib:(s + n) * ib].view(ib, n).t(), w2_scale[e].t(), d[s:s + n])
    A = ids.numel()
    pos = torch.full((A + 1,), -1, dtype=torch.int32, device=dev)
    pos.scatter_(0, torch.where(rows >= 0, rows, A).long(), torch.arange(R, dtype=torch.int32, device=dev))
    out = torch.empty((T, H), dtype=x.dtype, device=dev)
    w_flat = weights.reshape(-1).float().contiguous()
    block_h = 1024 if H >= 1024 else triton.next_power_of_2(H)
    _combine_sorted_kernel[(T, triton.cdiv(H, block_h))](d, pos, w_flat, out, H, top_k, d.stride(0), out.stride(0),
                                                         BLOCK_H=block_h, ROUND_FIRST=interpreting())
    return out


def scaled_mm_ref(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b_t: torch.Tensor,
                  out: torch.Tensor) -> None:
    """What `_scaled_mm` computes with the 1x128 / 128x128 recipe, in fp32: out = (a * scale_a) @ (b * scale_b)^T
    for a [M, K], b_t = b.t() of b [N, K], scale_a [M, K/128], scale_b_t [K/128, N/128]."""
    out.copy_(dequant_act_ref(a, scale_a) @ dequantize_weight_ref(b_t.t(), scale_b_t.t()).t())
