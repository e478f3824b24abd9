"""Exact merge of partial attention results (DCP shards, split-K chunks).

    lse = log sum_r exp(lse_r),   out = sum_r exp(lse_r - lse) * out_r
A shard with lse_r = -inf contributes nothing; if every shard is -inf the result is out = 0, lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit, next_pow2, to_bf16


@jit(do_not_specialize=["num_parts", "num_rows", "sl_part"])  # per-step counts: one compiled variant
def _merge_kernel(out_ptr, lse_ptr, parts_ptr, part_lse_ptr, num_parts, num_rows, D,
                  sp_part, sp_row, sl_part, so_row,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program per (row, D chunk): out[row] = sum_r w_r parts[r, row] with w = softmax over lse_r."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_N)
    lse = tl.load(part_lse_ptr + r * sl_part + row, mask=r < num_parts, other=float("-inf")).to(tl.float32)
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # exp(-inf) = 0: empty shards drop out
    total = tl.sum(w, axis=0)
    scale = tl.where(total > 0, w / tl.maximum(total, 1e-30), 0.0)
    parts = tl.load(parts_ptr + r[:, None] * sp_part + row * sp_row + d[None, :],
                    mask=(r[:, None] < num_parts) & (d[None, :] < D) & (scale[:, None] > 0), other=0.0)
    out = tl.sum(parts.to(tl.float32) * scale[:, None], axis=0)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + row * so_row + d, to_bf16(out, ROUND_FIRST), mask=d < D)
    else:
        tl.store(out_ptr + row * so_row + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, tl.where(total > 0, tl.log(total) + m_safe, float("-inf")))


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None,
                      out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `merge_attn_states_ref`: outs [N, ..., D], lses [N, ...] -> (out [..., D], lse [...] fp32).

    Shards whose lse is -inf are never read (their rows may hold garbage, even NaN). `out` / `lse` (both
    or neither, contiguous, shaped like the results) receive the results in place.
    """
    if outs.shape[:-1] != lses.shape or outs.dim() < 2:
        raise ValueError(f"outs {tuple(outs.shape)} must be [N, ..., D] with lses {tuple(lses.shape)} = [N, ...]")
    check_device(outs, lses)
    N, D = outs.shape[0], outs.shape[-1]
    lead = outs.shape[1:-1]
    parts = outs.reshape(N, -1, D)
    if parts.stride(2) != 1:
        parts = parts.contiguous()
    part_lse = lses.reshape(N, -1).float().contiguous()
    rows = parts.shape[1]
    if (out is None) != (lse is None):
        raise ValueError("give both out and lse, or neither")
    if out is None:
        out = torch.empty((rows, D), dtype=out_dtype or outs.dtype, device=outs.device)
        lse = torch.empty((rows,), dtype=torch.float32, device=outs.device)
    else:
        if out.shape != (*lead, D) or lse.shape != lead or lse.dtype != torch.float32 \
                or not (out.is_contiguous() and lse.is_contiguous()):
            raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} {lse.dtype} must be contiguous "
                             f"{(*lead, D)} / {tuple(lead)} float32")
        check_device(outs, out, lse)
        out, lse = out.view(rows, D), lse.view(rows)
    if rows and D:
        block_d = min(next_pow2(D), max(16, 8192 // next_pow2(N)))
        _merge_kernel[(rows, triton.cdiv(D, block_d))](
            out, lse, parts, part_lse, N, rows, D, parts.stride(0), parts.stride(1), part_lse.stride(0),
            out.stride(0), BLOCK_N=max(2, next_pow2(N)), BLOCK_D=block_d, ROUND_FIRST=interpreting())
    return out.reshape(*lead, D), lse.reshape(lead)


def merge_attn_states_ref(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, ..., D], lses [N, ...] -> (out [..., D] in outs' dtype, lse [...] fp32)."""
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} disagree")
    lses = lses.float()
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # exp(-inf) = 0 for empty shards
    total = w.sum(dim=0)
    lse = torch.where(total > 0, torch.log(total) + m_safe, torch.full_like(m, float("-inf")))
    scale = torch.where(total[None] > 0, w / total.clamp(min=1e-30)[None], torch.zeros_like(w))
    out = (outs.float() * scale[..., None]).sum(dim=0)
    return out.to(outs.dtype), lse
