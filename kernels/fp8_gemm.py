"""W8A8 block-scaled FP8 GEMM: y = x @ W^T with FP8 e4m3 weights in 128x128 scale blocks.

The weight and activation formats, the activation quantization (`quant_act`) and the references of both are
kernels.fp8_quant's, shared with the cuBLAS path. The GEMM walks K in 128-wide blocks; each block's fp8
product (exact in fp32) is scaled by x_s[m, kb] * w_s[n // 128, kb] and added to an fp32 accumulator.

Two Triton kernels behind one launcher, and on Hopper cuBLAS's block-scaled GEMM (kernels.fp8_cublas: every
prefill shape, and the widest projections at 129-256 rows, where it was measured faster). Prefill (M > 256):
`quant_act`, then 128 x 128 tiles over the whole K.
Decode (M <= 256 = batch x (1 + drafts), weight-bandwidth-bound): `quant_act`, then kernels.fp8_splitk,
which splits K across programs so every multiprocessor streams a slice of the weight and adds the fp32
partial tiles in a fixed order in the last split to arrive (no third launch). On the H200 it is 1.14x
faster than the earlier decode launch summed over GLM-5.3's projections (`split_decode_config`: the
prefill kernel with 64 x 64 tiles, interleaved K splits and a torch sum), which `SPLITK_DECODE = False`
brings back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_cublas
from kernels.fp8_quant import BLOCK, dequant_act_ref, dequantize_weight_ref, quant_act, quant_act_ref
from kernels.fp8_splitk import MAX_M as DECODE_MAX_M
from kernels.fp8_splitk import SplitKConfig, splitk_config, splitk_gemm
from kernels.triton_support import check_device, interpreting, jit, num_sms


@jit
def _w8a8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, num_kb, sa_m, sas_m, sb_n, sbs_n, sc_s, sc_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """c[split, m, n] = sum over this split's k-blocks of (a[m] . b[n]) * as[m, kb] * bs[n // 128, kb],
    a the e4m3 codes of `quant_act` (unit k stride). SPLIT_K > 1 (interleaved k-blocks, partials summed by
    the launcher) is the decode scheme that kernels.fp8_splitk replaced; benchmarks still run it beside."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # grouped ordering: neighbouring programs share rows of a (L2 reuse)
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    a_rows = a_ptr + m[:, None].to(tl.int64) * sa_m
    b_rows = b_ptr + n[None, :].to(tl.int64) * sb_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(tl.program_id(1), num_kb, SPLIT_K):
        k = kb * 128 + tl.arange(0, 128)
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + m.to(tl.int64) * sas_m + kb, mask=m_ok, other=0.0)
        b = tl.load(b_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCK_N <= 128:  # the tile lies in one 128-row block of the weight: one scale per k-block
            b_s = tl.load(bs_ptr + ((pid_n * BLOCK_N) // 128).to(tl.int64) * sbs_n + kb)
            acc += part * (a_s * b_s)[:, None]
        else:
            b_s = tl.load(bs_ptr + (n // 128).to(tl.int64) * sbs_n + kb, mask=n_ok, other=0.0)
            acc += part * a_s[:, None] * b_s[None, :]
    c = c_ptr + tl.program_id(1).to(tl.int64) * sc_s + m[:, None].to(tl.int64) * sc_m + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# The decode default: kernels.fp8_splitk (bench.kernels.fp8_gemm --decode-only on the H200: 1.14x the earlier
# launch summed over the decode shapes, BENCHMARKS.md); False: split_decode_config's launch
SPLITK_DECODE = True


def split_decode_config(M: int, N: int, K: int, sms: int) -> tuple[int, int, int, int, int]:
    """The decode launch measured on the H200 (BENCHMARKS.md, FP8 weights): the prefill kernel with 64 x 64
    tiles, K split in two while the grid has fewer than two programs per multiprocessor and each split keeps
    >= 12 k-blocks (K = 2048 is never split: the fp32 partial sums would cost more than they win)."""
    tiles, split, num_kb = -(-M // 64) * -(-N // 64), 1, -(-K // BLOCK)
    while tiles * split < 2 * sms and num_kb // (split * 2) >= 12:
        split *= 2
    return 64, 64, split, 4, 4


def gemm_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) of the prefill kernel: 128 x 128 tiles, 8 warps,
    4 stages, the best of the H200 sweeps of bench.kernels.fp8_gemm (BENCHMARKS.md, FP8 weights)."""
    if interpreting():
        return 16, 32, 2 if K > BLOCK else 1, 4, 1
    return 128, 128, 1, 8, 4


def w8a8_block_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                          out_dtype: torch.dtype | None = None,
                          config: SplitKConfig | tuple | None = None, impl: str | None = None,
                          x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight * scales)^T, x quantized per token per 128 channels on the fly.

    x: bf16/fp16/fp32 [M, K] (any strides); weight float8_e4m3fn [N, K] with unit K stride;
    weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]. out_dtype defaults to x's dtype.
    M <= 256 runs the decode default (`SPLITK_DECODE`: kernels.fp8_splitk with `splitk_config`, else the
    prefill kernel with `split_decode_config`), larger M the prefill kernel (`gemm_config`). `config`
    overrides the choice (benchmarks sweep it): a `SplitKConfig` runs kernels.fp8_splitk, a tuple
    (BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) the prefill kernel, at any M.
    On Hopper, bf16 outputs of the prefill shapes (and of the widest projections at 129-256 rows) go to
    cuBLAS's block-scaled GEMM instead (kernels.fp8_cublas.use_dense); `impl` "triton" or "cublas" forces
    one (cublas: where cuBLAS takes the shape). `x_quant`: x's codes and scales as `quant_act(x)` gives them,
    made elsewhere (kernels.norm.rms_norm_quant writes them with the norm x comes from): the Triton paths take
    them in place of their own quantization; cuBLAS, whose scales are laid out its own way, quantizes x itself."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit [M, K] x [N, K]")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    want = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    if tuple(weight_scale_inv.shape) != want or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be fp32 {want} for weight {tuple(weight.shape)}, got "
                         f"{weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")
    check_device(x, weight, weight_scale_inv)
    if x_quant is not None:
        _check_x_quant(x_quant, x)
    out_dtype = out_dtype or x.dtype
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=x.device)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    weight_scale_inv = weight_scale_inv if weight_scale_inv.stride(1) == 1 else weight_scale_inv.contiguous()
    auto = config is None and impl is None and fp8_cublas.use_dense(M, N, K, out_dtype, x.device)
    can = impl == "cublas" and out_dtype == torch.bfloat16 and fp8_cublas.shape_fits(N, K) and \
        fp8_cublas.available(x.device)
    # `impl` is checked whatever the config; a config runs the Triton kernel it names
    if fp8_cublas.chosen(impl, auto, can, f"[{M}, {K}] x [{N}, {K}] -> {out_dtype} on {x.device}") and config is None:
        return fp8_cublas.dense_mm(x, weight, weight_scale_inv)
    if config is None:
        if M > DECODE_MAX_M:
            config = gemm_config(M, N, K)
        elif SPLITK_DECODE:
            config = splitk_config(M, N, K, num_sms(x.device))
        else:
            config = split_decode_config(M, N, K, num_sms(x.device))
    if isinstance(config, SplitKConfig):
        if config.fuse_quant and x_quant is None:
            return splitk_gemm(x, None, weight, weight_scale_inv, out_dtype, config)
        return splitk_gemm(*(x_quant or quant_act(x)), weight, weight_scale_inv, out_dtype, config)
    x_q, x_s = x_quant or quant_act(x)
    return _gemm(x_q, x_s, weight, weight_scale_inv, out_dtype, config)


def _check_x_quant(x_quant: tuple, x: torch.Tensor) -> None:
    """x's codes e4m3 [M, K] with unit K stride and scales fp32 [M, ceil(K/128)] with unit column stride."""
    q, s = x_quant
    M, K = x.shape
    if (q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (M, K) or q.stride(1) != 1 or s.dtype != torch.float32
            or tuple(s.shape) != (M, triton.cdiv(K, BLOCK)) or s.stride(1) != 1):
        raise ValueError(f"x_quant must be float8_e4m3fn [{M}, {K}] codes (unit K stride) and fp32 "
                         f"[{M}, {triton.cdiv(K, BLOCK)}] scales, got {q.dtype} {tuple(q.shape)} and {s.dtype} "
                         f"{tuple(s.shape)}")
    check_device(x, q, s)


def _gemm(a, a_s, b, b_s, out_dtype, config) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[0]
    block_m, block_n, split, warps, stages = config
    num_kb = triton.cdiv(K, BLOCK)
    split = max(1, min(split, num_kb))
    c = torch.empty((split, M, N), dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), split)
    _w8a8_gemm_kernel[grid](a, a_s, b, b_s, c, M, N, K, num_kb, a.stride(0), a_s.stride(0), b.stride(0),
                            b_s.stride(0), c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
                            SPLIT_K=split, GROUP_M=8, DOT_F32=interpreting(), num_warps=warps, num_stages=stages)
    return c[0] if split == 1 else c.sum(0).to(out_dtype)


# ---- references (fp32) ------------------------------------------------------------------------------

def w8a8_block_fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                              out_dtype: torch.dtype | None = None,
                              x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 reference: quantize x as the kernel does (or take `x_quant`, x's codes and scales made elsewhere,
    checked as the kernel checks them), dequantize both operands, one fp32 matmul."""
    if x_quant is not None:
        _check_x_quant(x_quant, x)
    q, s = x_quant if x_quant is not None else quant_act_ref(x)
    y = dequant_act_ref(q, s) @ dequantize_weight_ref(weight, weight_scale_inv).t()
    return y.to(out_dtype or x.dtype)
