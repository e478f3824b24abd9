"""FP8 e4m3 block scaling, the format every FP8 path shares: per-token activation quantization and its references.

Format (the one GLM-5.x / DeepSeek-V3 checkpoints ship, docs/fp8.md):
  weight  float8_e4m3fn [N, K];  weight_scale_inv fp32 [ceil(N/128), ceil(K/128)];
  real weight W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128].
Activations are quantized dynamically per token per 128 channels: x [M, K] -> x_q e4m3 [M, K] and
x_s fp32 [M, ceil(K/128)], x_s = amax(|x| over the 128 channels) / 448, x_q = round(x / x_s).

Its own module, below the GEMMs that use it: the Triton GEMM (kernels.fp8_gemm) dispatches to cuBLAS
(kernels.fp8_cublas), and both quantize the activation the same way, so the quantization cannot live in either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit, quant_e4m3_rows

BLOCK = 128  # scale tile edge (weight_block_size)
FP8_MAX = 448.0
MIN_AMAX = 1e-10  # an all-zero block gets a tiny positive scale (its codes are all 0)


@jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_out, K, sx_m, sx_k, sq_m, ss_m, ss_k,
                      BLOCK_M: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One [BLOCK_M, 128] tile of x -> its e4m3 codes (stored as bytes) and one fp32 scale per row. Rows
    M <= m < M_out (padding for cuBLAS) get zero codes and the all-zero block's scale."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    k = kb * 128 + tl.arange(0, 128)
    k_ok = k[None, :] < K
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * sx_m + k[None, :] * sx_k, mask=(m[:, None] < M) & k_ok,
                other=0.0).to(tl.float32)
    q, s = quant_e4m3_rows(x, ROUND_FIRST)
    tl.store(q_ptr + m[:, None].to(tl.int64) * sq_m + k[None, :], q, mask=(m[:, None] < M_out) & k_ok)
    tl.store(s_ptr + m.to(tl.int64) * ss_m + kb * ss_k, s, mask=m < M_out)


def quant_act(x: torch.Tensor, *, col_major_scales: bool = False,
              pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, any strides) -> (x_q float8_e4m3fn [M, K], x_s fp32 [M, ceil(K/128)]).

    For cuBLAS's block-scaled GEMM (kernels.fp8_cublas): `pad_rows_to` rounds the rows up (the extra rows
    are zero codes with the all-zero block's scale) and `col_major_scales` stores x_s column-major
    (strides (1, rows)), the layout cuBLAS reads."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quant_act takes a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    check_device(x)
    M, K = x.shape
    rows = -(-M // pad_rows_to) * pad_rows_to
    kb = triton.cdiv(K, BLOCK)
    q = torch.empty((rows, K), dtype=torch.uint8, device=x.device)
    if col_major_scales:
        s = torch.empty((kb, rows), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((rows, kb), dtype=torch.float32, device=x.device)
    if rows and K:
        block_m = 16 if interpreting() else 32
        _act_quant_kernel[(triton.cdiv(rows, block_m), kb)](
            x, q, s, M, rows, K, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_M=block_m, ROUND_FIRST=interpreting())
    return q.view(torch.float8_e4m3fn), s


# ---- references (fp32) ------------------------------------------------------------------------------

def quant_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics of `quant_act`, in plain torch (fp32 arithmetic)."""
    M, K = x.shape
    kb = -(-K // BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - K)).view(M, kb, BLOCK)
    s = xf.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, kb * BLOCK)[:, :K].contiguous(), s


def dequant_act_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per-token-per-128 codes and scales -> fp32 values."""
    return q.float() * s.repeat_interleave(BLOCK, dim=-1)[..., : q.shape[-1]]


def quantize_weight_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/128), ceil(K/128)]): the checkpoint
    format. Works on any device (load-time quantization of a bf16 checkpoint runs on the GPU)."""
    *lead, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, kb * BLOCK - K, 0, nb * BLOCK - N))
    tiles = wf.view(*lead, nb, BLOCK, kb, BLOCK)
    s = tiles.abs().amax(dim=(-3, -1)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (tiles / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K].contiguous(), s


def dequantize_weight_ref(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [..., N, K] with block scales [..., ceil(N/128), ceil(K/128)] -> `dtype` (computed in fp32)."""
    N, K = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(BLOCK, dim=-2)[..., :N, :].repeat_interleave(BLOCK, dim=-1)[..., :K]
    return (w.float() * s).to(dtype)
