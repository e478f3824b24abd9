"""Routed experts: run them over routed tokens (the routing itself, `route_ref` and the sorts by expert, is
kernels.moe_routing's, the floor below).

Expert weights: w13 [E, 2I, H] (gate rows then up rows, HF's gate_up_proj layout), w2 [E, H, I].
y[t] = sum_j weights[t, j] * w2[e] (silu(w13[e, :I] x) * (w13[e, I:] x)),  e = ids[t, j].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.moe_routing import assignment_rows, combine, sort_by_expert
from kernels.triton_support import check_device, interpreting, jit, to_bf16


@jit
def _moe_up_kernel(x_ptr, w13_ptr, h_ptr, rows_ptr, block_expert_ptr, num_experts, top_k, hidden, inter,
                   sx_t, sw_e, sw_n, sh_r,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                   ROUND_FIRST: tl.constexpr):
    """h[r, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, inter + n]) for the BLOCK_M sorted rows r of
    one expert e (row r holds assignment a = token * top_k + j, or -1 for padding)."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < num_experts:
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(rows_ptr + r)
        ok = a >= 0
        tok = tl.where(ok, a // top_k, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_gate = w13_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
        w_up = w_gate + inter * sw_n
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tok[:, None] * sx_t + kk[None, :], mask=ok[:, None] & (kk[None, :] < hidden), other=0.0)
            w_mask = (kk[:, None] < hidden) & (n[None, :] < inter)
            wg = tl.load(w_gate + kk[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w_up + kk[:, None], mask=w_mask, other=0.0)
            if DOT_F32:
                x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(x, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        if h_ptr.dtype.element_ty == tl.bfloat16:
            hv = to_bf16(h, ROUND_FIRST)
        else:
            hv = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + r[:, None].to(tl.int64) * sh_r + n[None, :], hv, mask=ok[:, None] & (n[None, :] < inter))


@jit
def _moe_down_kernel(h_ptr, w2_ptr, y_ptr, rows_ptr, block_expert_ptr, weights_ptr, num_experts, hidden, inter,
                     sh_r, sw_e, sw_n, sy_a,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """y[a, n] = weights[a] * (h[r] . w2[e, n]) for the sorted rows r of expert e (fp32, one row per
    assignment a, so the sum over an token's experts is a deterministic reduction afterwards)."""
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < num_experts:
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        a = tl.load(rows_ptr + r)
        ok = a >= 0
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w2_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + r[:, None].to(tl.int64) * sh_r + kk[None, :], mask=ok[:, None] & (kk[None, :] < inter),
                        other=0.0)
            w = tl.load(w_rows + kk[:, None], mask=(kk[:, None] < inter) & (n[None, :] < hidden), other=0.0)
            if DOT_F32:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision="ieee")
        wt = tl.load(weights_ptr + a, mask=ok, other=0.0)
        tl.store(y_ptr + tl.where(ok, a, 0).to(tl.int64)[:, None] * sy_a + n[None, :], acc * wt[:, None],
                 mask=ok[:, None] & (n[None, :] < hidden))


def _moe_config(num_assign: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): small M when experts see few tokens each."""
    if interpreting():
        return 16, 32, 32, 4, 1
    block_m = 64 if num_assign >= 8 * num_experts else 16
    return block_m, 128, 64, 4, 3


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              expert_offset: int = 0, small_routing: bool = True, assignments: int | None = None) -> torch.Tensor:
    """Triton `fused_moe_ref` (same arguments): a grouped GEMM over expert-sorted assignments, with
    SiLU-and-mul fused into the first GEMM and the routing weight into the second; no host syncs.
    small_routing, assignments: as `kernels.fp8_moe.fused_moe_fp8`'s."""
    T, H = x.shape
    E, two_i, H_w = w13.shape
    inner = two_i // 2
    if H_w != H or w2.shape != (E, H, inner) or weights.shape != ids.shape or ids.shape[0] != T:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, weights "
                         f"{tuple(weights.shape)}, ids {tuple(ids.shape)} do not fit [T,H], [E,2I,H], [E,H,I], [T,k]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share a float dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    check_device(x, w13, w2, weights, ids)
    top_k = ids.shape[1]
    if T == 0 or top_k == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    block_m, block_n, block_k, warps, stages = _moe_config(assignments or ids.numel(), E)
    rows, block_expert = sort_by_expert(ids, E, expert_offset, block_m, small_routing)
    h = torch.empty((rows.shape[0], inner), dtype=x.dtype, device=x.device)
    y = assignment_rows(T * top_k, H, small_routing, x.device)
    dot_f32 = interpreting() or x.dtype == torch.float32
    nb = block_expert.shape[0]
    _moe_up_kernel[(nb, triton.cdiv(inner, block_n))](
        x, w13, h, rows, block_expert, E, top_k, H, inner, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32, ROUND_FIRST=interpreting(),
        num_warps=warps, num_stages=stages)
    w_flat = weights.reshape(-1).float().contiguous()
    _moe_down_kernel[(nb, triton.cdiv(H, block_n))](
        h, w2, y, rows, block_expert, w_flat, E, H, inner, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32, num_warps=warps, num_stages=stages)
    return combine(y, ids, E, expert_offset, x.dtype, small_routing)


def moe_impl_for(device: torch.device | str):
    """The `Experts.impl` to use on `device`: the Triton grouped GEMM on CUDA, the reference elsewhere."""
    return fused_moe if torch.device(device).type == "cuda" else fused_moe_ref


def sort_assignments(ids: torch.Tensor, weights: torch.Tensor, num_local: int, expert_offset: int = 0):
    """The (token, expert) assignments of this rank's experts sorted by expert, for padded per-expert
    batches: ids [T, k] global expert ids (those outside [offset, offset + num_local) are skipped, for EP)
    -> (local expert, token, fp32 weight, slot within its expert's batch, counts per expert), or None when
    no assignment is local."""
    T = ids.shape[0]
    flat_e = ids.reshape(-1) - expert_offset
    local = (flat_e >= 0) & (flat_e < num_local)
    tok = torch.arange(T, device=ids.device).repeat_interleave(ids.shape[1])[local]
    e = flat_e[local]
    if e.numel() == 0:
        return None
    w = weights.reshape(-1)[local].float()
    order = torch.argsort(e, stable=True)
    e, tok, w = e[order], tok[order], w[order]
    counts = torch.bincount(e, minlength=num_local)
    slot = torch.arange(e.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[e]
    return e, tok, w, slot, counts


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, expert_offset: int = 0, assignments: int | None = None) -> torch.Tensor:
    """x [T, H]; ids [T, k] global expert ids (ids outside [offset, offset + E_local) are skipped, for EP).
    `assignments`: the kernel's tile hint (`fused_moe`), unused here.

    Vectorised over experts: assignments are sorted by expert into a padded [E, max_count, H] batch and
    run as two batched matmuls (no Python loop over tokens or experts).
    """
    T, H = x.shape
    E, two_i, _ = w13.shape
    inner = two_i // 2
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    sorted_ = sort_assignments(ids, weights, E, expert_offset)
    if sorted_ is None:
        return out.to(x.dtype)
    e, tok, w, slot, counts = sorted_
    batch = torch.zeros((E, int(counts.max()), H), dtype=x.dtype, device=x.device)
    batch[e, slot] = x[tok]
    h = torch.bmm(batch, w13.transpose(1, 2))
    h = F.silu(h[..., :inner]) * h[..., inner:]
    y = torch.bmm(h, w2.transpose(1, 2))[e, slot]
    out.index_add_(0, tok, y.float() * w[:, None])
    return out.to(x.dtype)
