"""Sparse MLA attention in the absorbed (MQA) form over selected cache rows.

For query row t and head h, with q = [q_lat (R) ; q_rope (P)] and the selected rows c_s = [latent ; rope]:
    z[t, h, s] = sm_scale * q[t, h] . c_s          (s over the row's indices, -1 = skipped)
    out[t, h]  = sum_s softmax(z[t, h])_s * latent_s      [R]
    lse[t, h]  = log sum_s exp(z[t, h, s])                (natural log; -inf when nothing is selected)
A row with no valid index returns out = 0 and lse = -inf (so a DCP merge ignores it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import sparse_mla_sm90 as sm90
from kernels.formats import tile_size
from kernels.merge import merge_attn_states
from kernels.store_kv import cache_views, gather_kv_ref
from kernels.triton_support import check_device, interpreting, jit, next_pow2, num_sms, to_bf16

LOG2E = 1.4426950408889634


@jit
def _slots(idx_row, offs, hi, tab, POSITIONS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Indices [offs] of a row -> cache slots (int64, -1 = skip): as they are, or, with POSITIONS, request
    positions through the row's block table `tab`."""
    ix = tl.load(idx_row + offs, mask=offs < hi, other=-1).to(tl.int64)
    if POSITIONS:
        page = tl.load(tab + ix // BLOCK_SIZE, mask=ix >= 0, other=-1).to(tl.int64)
        ix = tl.where(ix >= 0, page * BLOCK_SIZE + ix % BLOCK_SIZE, -1)
    return ix


# per-step sizes and strides (selected entries, split length, query rows, the block table's width): one compiled
# variant for all (kernels/jit_variants.py)
@jit(do_not_specialize=["num_idx", "split_len", "sq_len", "si_b", "so_split", "sl_split", "s_table"])
def _sparse_mla_kernel(q_ptr, kv_ptr, kv_scale_ptr, kv_rope_ptr, idx_ptr, out_ptr, lse_ptr,
                       num_heads, num_idx, split_len, sq_len,
                       sq_b, sq_s, sq_h, si_b, si_s, skv_blk, skv_tok,
                       so_split, so_row, so_h, sl_split, sl_row, sm_scale_log2, table_ptr, s_table, req_ptr,
                       R: tl.constexpr, P: tl.constexpr, TILE: tl.constexpr, KV_FP8: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       IDX_AHEAD: tl.constexpr, DOT_F32: tl.constexpr, ROUND_FIRST: tl.constexpr,
                       POSITIONS: tl.constexpr, TRIM: tl.constexpr):
    """Program (query row, head block, split): online softmax over indices [split*split_len, +split_len).

    Rows of q/indices are (b, s) pairs, row = b * sq_len + s (strides per level, so any q view works).
    With POSITIONS the indices are positions of the row's request (req_ptr[row]), mapped to slots through
    its block-table row (table_ptr + req * s_table) as they are loaded.
    fp8 rows are dequantised to bf16 exactly (fp8 times a power of two), so the QK dot sees the cached
    values bit for bit; P is rounded to bf16 for the PV dot. Scores are kept in log2 units. BLOCK_SIZE
    (tokens per page; 1 for a workspace) is a constant so slot -> page is a shift, not a 64-bit divide.
    TRIM: the loop stops after the split's last valid index (found by a first pass over its indices): the -1
    entries after it add exactly nothing (p = 0, alpha = 1), so the result is the same bits, without the
    blocks of a row shorter than K (a context below top-k, the first rows of a prefill).
    """
    NT: tl.constexpr = R // TILE
    DOT: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    b = row // sq_len
    s = row % sq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    q_row = q_ptr + b * sq_b + s * sq_s + heads[:, None] * sq_h
    q_lat = tl.load(q_row + tl.arange(0, R)[None, :], mask=hmask[:, None], other=0.0).to(DOT)
    q_rope = tl.load(q_row + R + tl.arange(0, P)[None, :], mask=hmask[:, None], other=0.0).to(DOT)
    idx_row = idx_ptr + b * si_b + s * si_s
    tab = table_ptr
    if POSITIONS:
        tab = table_ptr + tl.load(req_ptr + row).to(tl.int64) * s_table

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, num_idx)
    if TRIM:  # a split ending in a valid index (a full row) keeps its bound; others find their last valid one
        if tl.load(idx_row + tl.maximum(hi - 1, 0), mask=hi > lo, other=0) < 0:
            last = lo - 1
            for c in range(lo, hi, 256):  # 256 entries at a time: a whole-row load costs registers
                kk = c + tl.arange(0, 256)
                ix = tl.load(idx_row + kk, mask=kk < hi, other=-1)
                last = tl.maximum(last, tl.max(tl.where(ix >= 0, kk, -1), axis=0))
            hi = last + 1
    offs = lo + tl.arange(0, BLOCK_N)
    slot_next = _slots(idx_row, offs, hi, tab, POSITIONS, BLOCK_SIZE)
    for n0 in range(lo, hi, BLOCK_N):
        if IDX_AHEAD:  # the next block's indices load while this block computes: no index -> row chain
            slot = slot_next
            offs = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            slot_next = _slots(idx_row, offs, hi, tab, POSITIONS, BLOCK_SIZE)
        else:
            offs = n0 + tl.arange(0, BLOCK_N)
            slot = _slots(idx_row, offs, hi, tab, POSITIONS, BLOCK_SIZE)
        valid = slot >= 0
        base = (slot // BLOCK_SIZE) * skv_blk + (slot % BLOCK_SIZE) * skv_tok
        if KV_FP8:
            lat8 = tl.load(kv_ptr + base[:, None] + tl.arange(0, R)[None, :], mask=valid[:, None], other=0)
            sc = tl.load(kv_scale_ptr + (base[:, None] + R) // 4 + tl.arange(0, NT)[None, :],
                         mask=valid[:, None], other=0.0)
            lat = lat8.to(tl.float8e4nv, bitcast=True).to(DOT)
            lat = tl.reshape(tl.reshape(lat, [BLOCK_N, NT, TILE]) * sc.to(DOT)[:, :, None], [BLOCK_N, R])
            rope = tl.load(kv_rope_ptr + (base[:, None] + R + 4 * NT) // 2 + tl.arange(0, P)[None, :],
                           mask=valid[:, None], other=0.0).to(DOT)
        else:
            lat = tl.load(kv_ptr + base[:, None] + tl.arange(0, R)[None, :], mask=valid[:, None], other=0.0).to(DOT)
            rope = tl.load(kv_ptr + base[:, None] + R + tl.arange(0, P)[None, :], mask=valid[:, None],
                           other=0.0).to(DOT)
        z = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
        z = tl.dot(q_rope, tl.trans(rope), z, input_precision="ieee")
        z = tl.where(valid[None, :], z * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet stays at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(z - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), lat, input_precision="ieee")
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    o_ptr = out_ptr + split * so_split + row * so_row + heads[:, None] * so_h + tl.arange(0, R)[None, :]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(o_ptr, to_bf16(out, ROUND_FIRST), mask=hmask[:, None])
    else:
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptr + split * sl_split + row * sl_row + heads, lse, mask=hmask)


def _config(num_heads: int, dot_f32: bool, kv_fp8: bool) -> tuple[int, int, int, int, bool]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages, IDX_AHEAD): the fastest of the H200 sweeps in
    BENCHMARKS.md. 64 heads fill one wgmma M tile; the [64, R] fp32 accumulator needs two warpgroups to
    stay in registers (one program per SM). Few heads (memory-bound) run 4 warps, two programs per SM.
    A bf16 workspace row is 1,152 B, so three stages of it overflow shared memory. fp32 q (test models)
    runs on FMA units: small tiles, or its operands spill."""
    if interpreting():
        return min(64, max(16, next_pow2(num_heads))), 16, 4, 1, True
    if dot_f32:
        return 16, 16, 8, 1, True
    if num_heads > 32:
        return 64, 64, 8, 3 if kv_fp8 else 2, True
    return 16, 32, 4, 3 if kv_fp8 else 2, True  # 17-32 heads: two blocks of 16 (a block of 32 spills)


def _num_splits(programs: int, num_idx: int, block_n: int, num_warps: int, device) -> int:
    """Split the index list (flash-decoding) when there are too few (row, head block) programs to fill
    the GPU: minimise waves / splits (time per program shrinks with the split) plus a small charge per
    split for the partial outputs and the merge. Each split keeps >= 2 blocks of indices."""
    slots = num_sms(device) * max(1, 8 // num_warps)  # programs resident at once (255 registers a thread)
    if programs >= slots:
        return 1
    most = max(1, num_idx // (2 * block_n))
    return min(range(1, most + 1), key=lambda s: (triton.cdiv(programs * s, slots) / s + 0.005 * s, s))


def _split_outputs(out: torch.Tensor, lse: torch.Tensor, rows: int, K: int, block_n: int, splits: int):
    """(splits, split_len, out, lse) of a launch: split_len a multiple of block_n (the count recomputed from it);
    one split writes `out` / `lse` as [rows, H, R] / [rows, H] views, several write fp32 partials
    [splits, rows, H, R] / [splits, rows, H] for merge_attn_states."""
    H, R = out.shape[-2:]
    split_len = triton.cdiv(triton.cdiv(max(K, 1), splits), block_n) * block_n
    splits = triton.cdiv(max(K, 1), split_len)
    if splits == 1:
        return splits, split_len, out.view(rows, H, R), lse.view(rows, H)
    return (splits, split_len, torch.empty((splits, rows, H, R), dtype=torch.float32, device=out.device),
            torch.empty((splits, rows, H), dtype=torch.float32, device=out.device))


def _row_strides(t: torch.Tensor, lead: int) -> tuple[int, int, int]:
    """(stride of b, stride of s, sq_len) for the leading dims of t (1 or 2 of them)."""
    if lead == 1:
        return t.stride(0), 0, 1
    return t.stride(0), t.stride(1), t.shape[1]


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               latent_dim: int = 512, *, num_splits: int | None = None, config: tuple | None = None,
               block_table: torch.Tensor | None = None, token_req_idx: torch.Tensor | None = None,
               trim: bool = True, kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `sparse_mla_ref`. q [T, H, R+P] or [B, Sq, H, R+P] (bf16/fp32, any strides with the last
    dim contiguous); kv a paged layer view [num_blocks, block_size, row] (fp8_ds_mla uint8, bf16, fp32;
    indices are global slots) or a workspace [S, R+P] (indices are rows); indices [..., K] int, -1 = skip.
    With `block_table` [B, W] and `token_req_idx` [T] (q [T, H, D], paged kv) the indices are positions of
    each row's request, mapped to slots inside the kernel (what `rows_to_slots` computes, without its ops).
    Returns (out [..., H, R] in q's dtype, lse [..., H] fp32); a row with no valid index gives 0 / -inf.
    `num_splits` / `config` (BLOCK_H, BLOCK_N, num_warps, num_stages, IDX_AHEAD) override the heuristics.
    `trim`: stop each row after its last valid index (the default). The same bits either way
    (tests/kernels/test_sparse_mla.py compares them; False walks every entry, for that test and the benchmarks'
    side-by-side). On the H200 (2026-12-03, BENCHMARKS.md, "sparse_mla_decode") a 320-token context's rows at 4
    query rows, B = 64, take 88.9 us trimmed against 370.5; full rows (a split's last index valid: one scalar
    load, no scan) cost 0-1% at one query row and 1-2% at four.
    `kernel`: "triton", "sm90" (kernels/sparse_mla_sm90.py; ValueError where it cannot run these inputs) or
    None: sm90 where H > 32, the inputs allow it and the cache is fp8_ds_mla or the
    call has at least `sparse_mla_sm90.BF16_MIN_ROWS` query rows (and no `config` is given), else Triton.
    """
    lead = q.dim() - 2
    if lead not in (1, 2) or indices.shape[:-1] != q.shape[:-2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, D] or [B, Sq, H, D] with indices "
                         f"{tuple(indices.shape)} = [..., K] over the same rows")
    positions = block_table is not None
    if positions:
        if lead != 1 or kv.dim() != 3 or token_req_idx is None or token_req_idx.shape != q.shape[:1]:
            raise ValueError("positions through a block table need q [T, H, D], a paged kv view and "
                             f"token_req_idx [T]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}, token_req_idx "
                             f"{None if token_req_idx is None else tuple(token_req_idx.shape)}")
        if block_table.dim() != 2 or block_table.stride(-1) != 1:
            raise ValueError(f"block_table must be [B, W] with contiguous rows, got {tuple(block_table.shape)}")
        check_device(q, block_table, token_req_idx)
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 (or int64), got {indices.dtype}")
    check_device(q, kv, indices)
    H, D = q.shape[-2:]
    R, P = latent_dim, D - latent_dim
    tile = tile_size(R)
    for name, n in (("latent", R), ("rope", P), ("tile", tile)):
        if n <= 0 or n & (n - 1):
            raise ValueError(f"{name} width {n} must be a power of two (q is [..., {D}], latent {R})")
    paged = kv if kv.dim() == 3 else kv.unsqueeze(1)  # a workspace is a cache of 1-token pages
    (kv8, kv32, kv16), s_blk, s_tok = cache_views(paged, R, P, tile)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    rows = q.shape[:-2].numel()
    K = indices.shape[-1]
    out = torch.empty((*q.shape[:-1], R), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if rows == 0:
        return out, lse
    if kernel not in (None, "triton", "sm90"):
        raise ValueError(f"kernel must be 'triton', 'sm90' or None, got {kernel!r}")
    # the default takes it for > 32 heads: it always computes 64 (one wgmma M tile), Triton's 16-head tiles win below;
    # over bf16 rows only for prefill-sized calls (H200: 1.2x Triton at 8K and 64K rows, 0-10% slower at decode sizes)
    if kernel == "sm90" or (kernel is None and config is None and H > 32
                            and (kv.dtype == torch.uint8 or rows >= sm90.BF16_MIN_ROWS)):
        why = sm90.eligible(q, kv, indices, R, positions, block_table, token_req_idx)
        if why is None and (kernel == "sm90" or sm90.library() is not None):
            return _sparse_mla_sm90(q, kv, indices, out, lse, sm_scale, lead, rows, num_splits,
                                    block_table if positions else None, token_req_idx, trim)
        if kernel == "sm90":
            raise ValueError(f"the sm_90 sparse MLA kernel cannot run these inputs: {why}")
        if why not in (None, sm90.NOT_SM90):
            sm90.note_fallback(why)
    dot_f32 = interpreting() or q.dtype == torch.float32
    block_h, block_n, warps, stages, idx_ahead = config or _config(H, dot_f32, kv.dtype == torch.uint8)
    hblocks = triton.cdiv(H, block_h)
    splits, split_len, dst, dst_lse = _split_outputs(
        out, lse, rows, K, block_n, num_splits or _num_splits(rows * hblocks, K, block_n, warps, q.device))
    qb, qs, sq_len = _row_strides(q, lead)
    ib, is_, _ = _row_strides(indices, lead)
    d_split = dst.stride(0) if splits > 1 else 0
    l_split = dst_lse.stride(0) if splits > 1 else 0
    _sparse_mla_kernel[(rows, hblocks, splits)](
        q, kv8, kv32, kv16, indices, dst, dst_lse, H, K, split_len, sq_len,
        qb, qs, q.stride(-2), ib, is_, s_blk, s_tok,
        d_split, dst.stride(-3), dst.stride(-2), l_split, dst_lse.stride(-2), sm_scale * LOG2E,
        block_table if positions else indices, block_table.stride(0) if positions else 0,
        token_req_idx if positions else indices,
        R=R, P=P, TILE=tile, KV_FP8=kv.dtype == torch.uint8, BLOCK_SIZE=paged.shape[1], BLOCK_H=block_h,
        BLOCK_N=block_n, IDX_AHEAD=idx_ahead, DOT_F32=dot_f32, ROUND_FIRST=interpreting(), POSITIONS=positions,
        TRIM=trim, num_warps=warps, num_stages=stages)
    if splits > 1:
        merge_attn_states(dst, dst_lse, out=out.view(rows, H, R), lse=lse.view(rows, H))
    return out, lse


def _sparse_mla_sm90(q, kv, indices, out, lse, sm_scale, lead, rows, num_splits, block_table, token_req_idx,
                     trim) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla through the warp-specialised sm_90 kernel: one CTA (all heads of a query row, one split)
    per multiprocessor, split like the Triton kernel's 8-warp programs; splits merged as there."""
    H, R, K = q.shape[-2], out.shape[-1], indices.shape[-1]
    splits, split_len, dst, dst_lse = _split_outputs(
        out, lse, rows, K, sm90.BLOCK_N, num_splits or _num_splits(rows, K, sm90.BLOCK_N, 8, q.device))
    qb, qs, sq_len = _row_strides(q, lead)
    ib, is_, _ = _row_strides(indices, lead)
    sm90.launch(q, kv, indices, dst, dst_lse, rows=rows, splits=splits, split_len=split_len, sq_len=sq_len,
                q_strides=(qb, qs, q.stride(-2)), idx_strides=(ib, is_),
                out_strides=(dst.stride(0) if splits > 1 else 0, dst.stride(-3), dst.stride(-2)),
                lse_strides=(dst_lse.stride(0) if splits > 1 else 0, dst_lse.stride(-2)),
                sm_scale_log2=sm_scale * LOG2E, block_table=block_table, token_req_idx=token_req_idx, trim=trim)
    if splits > 1:
        merge_attn_states(dst, dst_lse, out=out.view(rows, H, R), lse=lse.view(rows, H))
    return out, lse


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                      latent_dim: int = 512, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, H, R+P] (Sq <= 4 for MTP verification), indices [B, Sq, K] global slots of a paged cache
    -> (out [B, Sq, H, R], lse [B, Sq, H]). Splits the index list across programs at small batch."""
    if q.dim() != 4:
        raise ValueError(f"decode q must be [B, Sq, H, D], got {tuple(q.shape)}")
    return sparse_mla(q, kv_cache, indices, sm_scale, latent_dim, num_splits=num_splits)


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                       latent_dim: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, R+P], kv a bf16/fp32 workspace [S, R+P] (indices = rows) or a paged cache (global slots),
    indices [T, K] -> (out [T, H, R], lse [T, H])."""
    if q.dim() != 3:
        raise ValueError(f"prefill q must be [T, H, D], got {tuple(q.shape)}")
    return sparse_mla(q, kv, indices, sm_scale, latent_dim, num_splits=1)


# ---- references -------------------------------------------------------------------------------------


def attend_rows_ref(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sm_scale: float,
                    latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, R+P], kv [S, R+P] float, allowed [Tq, S] bool -> out [Tq, H, R] fp32, lse [Tq, H] fp32."""
    z = torch.einsum("thd,sd->ths", q.float(), kv.float()) * sm_scale
    z = z.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("ths,sr->thr", p, kv[:, :latent_dim].float())
    return out, lse


def sparse_mla_ref(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                   latent_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., H, R+P]; kv_cache a paged layer view [num_blocks, block_size, row] (indices are global
    slots) or a workspace [S, R+P] (indices are rows); indices [..., K] int32 with -1 padding.
    Returns (out [..., H, R] in q's dtype, lse [..., H] fp32)."""
    lead = q.shape[:-2]
    H, D = q.shape[-2:]
    if q.numel() == 0:
        return (torch.zeros(*lead, H, latent_dim, dtype=q.dtype, device=q.device),
                torch.full((*lead, H), float("-inf"), dtype=torch.float32, device=q.device))
    qf = q.reshape(-1, H, D)
    idx = indices.reshape(-1, indices.shape[-1]).long()
    valid = idx >= 0
    flat = idx.clamp(min=0).reshape(-1)
    if kv_cache.dim() == 3:
        rows = gather_kv_ref(kv_cache, flat, latent_dim, rope_dim)
    else:
        rows = kv_cache[flat].float()
    # padding entries read slot 0, which may be an unused (even NaN-poisoned) page: zero them, as the
    # kernel's masked loads do, so 0 * NaN never reaches the PV sum
    rows = rows.reshape(idx.shape[0], idx.shape[1], -1).masked_fill(~valid[..., None], 0.0)
    z = torch.einsum("thd,tkd->thk", qf.float(), rows) * sm_scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("thk,tkr->thr", p, rows[..., :latent_dim])
    return out.to(q.dtype).reshape(*lead, H, latent_dim), lse.reshape(*lead, H)
