"""kv_b_proj's FP8 block-scaled weight dequantized for MLA's absorbed matmuls, once per layer forward.

kv_b_proj.weight is float8_e4m3fn [H * (nope + v), R] with fp32 scales [ceil(H (nope + v) / 128), ceil(R / 128)];
head h owns rows h (nope + v) + [0, nope) (W_UK_h) and the next v rows (W_UV_h). The absorbed path multiplies
per head (q_lat = W_UK_h^T q_nope_h, o_h = W_UV_h lat_h), and head boundaries do not fall on 128-row scale
blocks (nope + v = 448 for GLM-5.3), so it runs as bf16 batched matmuls on a dequantized copy made by
`dequantize_fp8` right before them: one bandwidth-bound pass (read 1 B, write 2 B per element) into a
temporary the caching allocator hands from layer to layer. Storage stays FP8 (engine/model/fp8.py says why).

Each program dequantizes a [BLOCK_R, 128] tile inside one 128 x 128 scale block: one scale per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import BLOCK, dequantize_weight_ref
from kernels.triton_support import check_device, interpreting, jit, to_bf16


@jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, sw, ss, so, BLOCK_R: tl.constexpr, ROUND_FIRST: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = (r[:, None] < N) & (c[None, :] < K)
    s = tl.load(s_ptr + ((tl.program_id(0) * BLOCK_R) // 128) * ss + tl.program_id(1))
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * sw + c[None, :], mask=m, other=0.0).to(tl.float32) * s
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = to_bf16(w, ROUND_FIRST)
    else:
        v = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r[:, None].to(tl.int64) * so + c[None, :], v, mask=m)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float8_e4m3fn [N, K] with fp32 scales [ceil(N/128), ceil(K/128)] -> `dtype` [N, K] (Triton)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    want = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    check_device(weight, scale)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    scale = scale.contiguous()
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    block_r = 32
    grid = (triton.cdiv(N, block_r), triton.cdiv(K, BLOCK))
    _dequant_kernel[grid](weight, scale, out, N, K, weight.stride(0), scale.stride(0), out.stride(0),
                          BLOCK_R=block_r, ROUND_FIRST=interpreting(), num_warps=4)
    return out


def absorbed_weights(weight: torch.Tensor, scale: torch.Tensor, num_heads: int, nope: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, R] and W_UV [H, v, R] in `dtype`: views of one dequantized copy (Triton on CUDA)."""
    w = dequantize_fp8(weight, scale, dtype) if weight.is_cuda else dequantize_weight_ref(weight, scale, dtype)
    w = w.view(num_heads, -1, weight.shape[1])
    return w[:, :nope], w[:, nope:]


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize_weight_ref(weight, scale, dtype)
