"""MLA's absorbed matmuls straight from kv_b_proj's FP8 block-scaled weight (weight-only FP8).

kv_b_proj.weight is float8_e4m3fn [H * (nope + v), R] with fp32 scales [ceil(H (nope + v) / 128), ceil(R / 128)];
head h owns rows h (nope + v) + [0, nope) (W_UK_h) and h (nope + v) + nope + [0, v) (W_UV_h). Head boundaries
do not fall on 128-row scale blocks (nope + v = 448 for GLM-5.3), so every element's scale is looked up as
scale[row // 128, col // 128]. The weight is dequantized in registers (to the activation dtype) and
multiplied with the activations as they are (no activation quantization: the products feed attention
scores directly).

    absorb_q:  q_lat[t, h, r] = sum_n q_nope[t, h, n] * W_UK_h[n, r]        ("UK": contract rows)
    absorb_o:  o[t, h, j]     = sum_r lat[t, h, r]    * W_UV_h[j, r]        ("UV": contract columns)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jit import check_device, interpreting, jit
from kernels.fp8_gemm import BLOCK, dequantize_weight_ref


@jit
def _absorb_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, K, N, head_rows, row0, sx_t, sx_h, sw, ss, so_t, so_h,
                   CONTRACT_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """out[t, h, n] = sum_k x[t, h, k] * Wh[k, n], Wh[k, n] = W[base + k, n] (UK) or W[base + n, k] (UV)."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < T
    n_ok = n < N
    base = h * head_rows + row0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * sx_t + h * sx_h + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if CONTRACT_ROWS:
            rows = base + k[:, None]
            cols = n[None, :]
        else:
            rows = base + n[None, :]
            cols = k[:, None]
        m = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_ptr + rows.to(tl.int64) * sw + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (rows // 128) * ss + cols // 128, mask=m, other=0.0)
        w = w * s
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
    tl.store(out_ptr + t[:, None].to(tl.int64) * so_t + h * so_h + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


def _check(x, weight, scale, num_heads, head_rows):
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[0] != num_heads * head_rows:
        raise ValueError(f"weight must be float8_e4m3fn [{num_heads} x {head_rows}, R], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    want = (triton.cdiv(weight.shape[0], BLOCK), triton.cdiv(weight.shape[1], BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    if x.dim() != 3 or x.shape[1] != num_heads:
        raise ValueError(f"activations must be [T, {num_heads}, D], got {tuple(x.shape)}")
    check_device(x, weight, scale)


def _launch(x, weight, scale, K, N, head_rows, row0, contract_rows):
    T, H = x.shape[:2]
    x = x if x.stride(2) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale = scale.contiguous()
    out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    bm = 16 if interpreting() or T <= 16 else 64
    bn, bk = (32, 32) if interpreting() else (128, 64)
    grid = (H, triton.cdiv(T, bm), triton.cdiv(N, bn))
    _absorb_kernel[grid](x, weight, scale, out, T, K, N, head_rows, row0, x.stride(0), x.stride(1), weight.stride(0),
                         scale.stride(0), out.stride(0), out.stride(1), CONTRACT_ROWS=contract_rows, BLOCK_M=bm,
                         BLOCK_N=bn, BLOCK_K=bk, DOT_F32=interpreting() or x.dtype == torch.float32,
                         num_warps=4, num_stages=3)
    return out


def absorb_q(q_nope: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, nope: int, v: int) -> torch.Tensor:
    """q_nope [T, H, nope] -> q_lat [T, H, R] through W_UK (FP8 rows of kv_b_proj)."""
    H = q_nope.shape[1]
    _check(q_nope, weight, scale, H, nope + v)
    if q_nope.shape[2] != nope:
        raise ValueError(f"q_nope must be [T, H, {nope}], got {tuple(q_nope.shape)}")
    return _launch(q_nope, weight, scale, nope, weight.shape[1], nope + v, 0, True)


def absorb_o(lat: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, nope: int, v: int) -> torch.Tensor:
    """lat [T, H, R] -> o [T, H, v] through W_UV (FP8 rows of kv_b_proj)."""
    H = lat.shape[1]
    _check(lat, weight, scale, H, nope + v)
    if lat.shape[2] != weight.shape[1]:
        raise ValueError(f"lat must be [T, H, {weight.shape[1]}], got {tuple(lat.shape)}")
    return _launch(lat, weight, scale, weight.shape[1], v, nope + v, nope, False)


def absorbed_weights_ref(weight: torch.Tensor, scale: torch.Tensor, num_heads: int, nope: int,
                         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized W_UK [H, nope, R] and W_UV [H, v, R] (views of one dequantized copy)."""
    w = dequantize_weight_ref(weight, scale, dtype).view(num_heads, -1, weight.shape[1])
    return w[:, :nope], w[:, nope:]


def absorb_q_ref(q_nope, weight, scale, nope: int, v: int) -> torch.Tensor:
    w_uk, _ = absorbed_weights_ref(weight, scale, q_nope.shape[1], nope)
    return torch.einsum("thn,hnr->thr", q_nope.float(), w_uk).to(q_nope.dtype)


def absorb_o_ref(lat, weight, scale, nope: int, v: int) -> torch.Tensor:
    _, w_uv = absorbed_weights_ref(weight, scale, lat.shape[1], nope)
    return torch.einsum("thr,hvr->thv", lat.float(), w_uv).to(lat.dtype)
