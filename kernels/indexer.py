"""The lightning indexer: storing its keys and selecting each query's top-k past tokens.

Key cache view: [num_blocks, block_size, D + 4] uint8, fp8 e4m3 values and an fp32 power-of-two scale per key,
block-major (each block's values, then its scales: `kernels.formats`, docs/kv-formats.md), or
[num_blocks, block_size, D] float32 rows (the exact reference mode).

Score of query row t (position p, request b) against past position s <= p:
    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * k_scale[s]
where `w` already holds weights_proj(x)/sqrt(H), the 1/sqrt(D) softmax scale and the per-(token, head)
query scale (all positive, so they fold through the ReLU). Top-k is exact for the computed scores; ties
go to the lower position. Rows with fewer than k candidates are padded with -1.

Two implementations (`impl`): "fused" (`kernels.indexer_fused`: all heads in one fp8 MMA per key tile,
group maxima, then the one-pass threshold top-k of `kernels.topk_threshold`), picked for fp8 keys on
compute capability >= 9.0 and under the interpreter; "radix" (`_index_scores_kernel` below, then the
radix top-k of `kernels.topk`) for fp32 keys and older GPUs, and the baseline the fused path is
benchmarked against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import quantize_index_rows_ref, read_index_rows, write_index_rows
from kernels.indexer_fused import FusedConfig, default_config, fused_indexer_topk, fused_scores, tile_tensor
from kernels.store_kv import cache_views, store_rows
from kernels.topk import topk_rows
from kernels.topk_threshold import num_maxima
from kernels.triton_support import check_device, interpreting, jit, next_pow2

# Bytes of fp32 scores materialised at once ([rows, S] per chunk of query rows).
_MAX_SCORE_BYTES = 1 << 30


@jit(do_not_specialize=["s_bt"])  # the step's block-table width
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, tile_ptr, req_ptr, pos_ptr, score_ptr,
                         row_offset, num_heads, sq_t, sq_h, sw_t, sk_blk, sk_tok, s_bt, ss_row,
                         BLOCK_SIZE: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr,
                         KEYS_PER_PROG: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (tile, key range): scores[t, s] for the tile's rows (one request) and keys s <= pos[t].

    A tile is `tile_ptr[tile] = (first row, number of rows <= BLOCK_T)`; its BLOCK_T x H_PAD (row, head)
    pairs are the M side of one dot against BLOCK_N keys, then ReLU, times w, summed over heads.
    """
    M: tl.constexpr = BLOCK_T * H_PAD
    row0 = tl.load(tile_ptr + 2 * tl.program_id(0)).to(tl.int64)
    num_rows = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
    t = tl.arange(0, BLOCK_T)
    pos = tl.load(pos_ptr + row0 + t, mask=t < num_rows, other=-1)
    s_lo = tl.program_id(1) * KEYS_PER_PROG
    s_end = tl.minimum(tl.max(pos, axis=0) + 1, s_lo + KEYS_PER_PROG)
    if s_lo < s_end:
        m = tl.arange(0, M)
        m_ok = (m // H_PAD < num_rows) & (m % H_PAD < num_heads)
        # fp8 rows are 132 B apart: 4-byte aligned, which Triton cannot infer (it only tracks 16)
        q_rows = q_ptr + tl.multiple_of((row0 + m // H_PAD) * sq_t + (m % H_PAD) * sq_h, 4)
        q = tl.load(q_rows[:, None] + tl.arange(0, D)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + (row0 + m // H_PAD) * sw_t + m % H_PAD, mask=m_ok, other=0.0)
        if FP8:
            q = q.to(tl.float8e4nv, bitcast=True)
        if DOT_F32:
            q = q.to(tl.float32)
        bt_row = bt_ptr + tl.load(req_ptr + row0).to(tl.int64) * s_bt
        for s0 in range(s_lo, s_end, BLOCK_N):
            s = s0 + tl.arange(0, BLOCK_N)
            s_ok = s < s_end
            page = tl.load(bt_row + s // BLOCK_SIZE, mask=s_ok, other=0).to(tl.int64)
            if FP8:  # block-major: the block's D-byte values, then its fp32 scales
                base = page * sk_blk + (s % BLOCK_SIZE) * D
            else:
                base = page * sk_blk + (s % BLOCK_SIZE) * sk_tok
            k = tl.load(k_ptr + base[:, None] + tl.arange(0, D)[None, :], mask=s_ok[:, None], other=0)
            if FP8:
                k = k.to(tl.float8e4nv, bitcast=True)
                k_scale = tl.load(ks_ptr + (page * sk_blk + BLOCK_SIZE * D) // 4 + s % BLOCK_SIZE, mask=s_ok, other=0.0)
            else:
                k_scale = tl.full([BLOCK_N], 1.0, tl.float32)
            if DOT_F32:
                k = k.to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, BLOCK_N]
            logits = tl.maximum(logits, 0.0) * w[:, None]
            score = tl.sum(tl.reshape(logits, [BLOCK_T, H_PAD, BLOCK_N]), axis=1) * k_scale[None, :]
            dst = score_ptr + (row0 - row_offset + t)[:, None] * ss_row + s[None, :]
            tl.store(dst, score, mask=(t[:, None] < num_rows) & (s[None, :] <= pos[:, None]))


def store_index_k(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton `store_index_k_ref`: k [T, D] -> keys at slot_mapping (fp8 + pow2 scale, block-major; or fp32
    rows); -1 skipped."""
    if index_cache.dim() != 3 or index_cache.dtype not in (torch.uint8, torch.float32):
        raise ValueError(f"index_cache must be [num_blocks, block_size, row] uint8 or float32, "
                         f"got {index_cache.dtype} {tuple(index_cache.shape)}")
    store_rows(k, None, index_cache, slot_mapping, k.shape[1], blocked=index_cache.dtype == torch.uint8)


INDEX_Q_BLOCK = 64  # rows per block of quantize_index_q's staging buffer


def quantize_index_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `quantize_index_q_ref`: q [T, H, D] -> (fp8 [T, H, D] view, fp32 scale [T, H] view).

    Each (token, head) row is an index-cache row ([D fp8 | fp32 scale]), written by the store kernel."""
    T, H, D = q.shape
    # blocks of 64 rows, not one block of T * H: the store kernel's block size is a constexpr, and one that
    # followed the step's rows would compile a variant per batch (kernels/jit_variants.py)
    blocks = -(-T * H // INDEX_Q_BLOCK)
    buf = torch.empty((blocks, INDEX_Q_BLOCK, D + 4), dtype=torch.uint8, device=q.device)
    rows = q.reshape(T * H, D)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    store_rows(rows, None, buf, torch.arange(T * H, device=q.device), D)
    flat = buf.view(blocks * INDEX_Q_BLOCK, D + 4)[:T * H]
    return (flat[:, :D].view(torch.float8_e4m3fn).view(T, H, D),
            flat[:, D:].view(torch.float32).view(T, H))


def _score_config(num_heads: int, query_start_loc_cpu, fp8: bool) -> tuple[int, int, int, int]:
    """(H_PAD, BLOCK_T, BLOCK_N, KEYS_PER_PROG): about 128 (row, head) pairs per fp8 dot; the fp32 mode
    (exact tests, no tensor cores) keeps one row per tile so its operands stay in registers."""
    h_pad = max(16, next_pow2(num_heads))
    most = 1 if query_start_loc_cpu is None or not fp8 else max(
        (b - a for a, b in zip(query_start_loc_cpu, query_start_loc_cpu[1:])), default=1)
    block_t = max(1, min(128 // h_pad, next_pow2(most)))
    if interpreting():
        return h_pad, block_t, 16, 64
    return h_pad, block_t, 64 if fp8 else 32, 1024


def _prepare(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
             q_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(q fp8 with 4-byte aligned rows or fp32, w with the q scale folded in, fp8?)."""
    fp8 = index_cache.dtype == torch.uint8
    w = weights.float()
    if fp8 and q.dtype != torch.float8_e4m3fn:
        q, q_scale = quantize_index_q(q)
    if q_scale is not None:
        w = w * q_scale.float()
    if not fp8:
        q = q.float()
    if q.stride(2) != 1 or (fp8 and (q.stride(0) % 4 or q.stride(1) % 4)):
        q = q.contiguous()
    return q, w.contiguous(), fp8


def _use_fused(impl: str | None, fp8: bool, device: torch.device) -> bool:
    """impl None: fused for fp8 keys on compute capability >= 9.0 and under the interpreter."""
    if impl not in (None, "fused", "radix"):
        raise ValueError(f"impl must be 'fused', 'radix' or None (pick), got {impl!r}")
    if impl == "fused" and not fp8:
        raise ValueError("the fused indexer reads fp8 keys; an fp32 index cache needs impl='radix'")
    if impl is not None:
        return impl == "fused"
    return fp8 and (interpreting() or torch.cuda.get_device_capability(device) >= (9, 0))


def _launch_scores(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                   token_req_idx: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor, scores: torch.Tensor,
                   row_offset: int, cfg: tuple[int, int, int, int], fp8: bool) -> None:
    if tiles.shape[0] == 0:
        return
    T, H, D = q.shape
    h_pad, block_t, block_n, keys_per_prog = cfg
    q = q.view(torch.uint8) if fp8 else q
    (k8, k32, _), sb, st = cache_views(index_cache, D, 0, D)
    if fp8 and st != D + 4:
        raise ValueError(f"a block-major key cache needs contiguous blocks, got strides {tuple(index_cache.stride())}")
    grid = (tiles.shape[0], triton.cdiv(scores.shape[1], keys_per_prog))
    _index_scores_kernel[grid](
        q, w, k8, k32, block_table, tiles, token_req_idx, positions, scores,
        row_offset, H, q.stride(0), q.stride(1), w.stride(0), sb, st, block_table.stride(0), scores.stride(0),
        BLOCK_SIZE=index_cache.shape[1], D=D, H_PAD=h_pad, BLOCK_T=block_t, BLOCK_N=block_n,
        KEYS_PER_PROG=keys_per_prog,
        FP8=fp8, DOT_F32=interpreting() or not fp8, num_warps=4, num_stages=1 if interpreting() else 3)


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 token_req_idx: torch.Tensor, positions: torch.Tensor, max_seq_len: int, *,
                 q_scale: torch.Tensor | None = None, impl: str | None = None,
                 config: FusedConfig | None = None) -> torch.Tensor:
    """The scores `indexer_topk` (without a host layout: one row per tile) selects from, [T, max_seq_len]
    fp32 (-inf past each row's position): `index_scores_ref` computed by the kernel, for tests and benchmarks."""
    check_device(q, weights, index_cache, block_table, token_req_idx, positions)
    qk, w, fp8 = _prepare(q, weights, index_cache, q_scale)
    scores = torch.full((q.shape[0], max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0:
        return scores
    tiles = tile_tensor(0, q.shape[0], None, None, 0, 1, q.device)
    if _use_fused(impl, fp8, q.device):
        cfg = config or default_config(None)
        gmax = torch.empty((q.shape[0], num_maxima(max_seq_len, cfg.select)), dtype=torch.float32, device=q.device)
        fused_scores(qk, w, index_cache, block_table, token_req_idx, positions, tiles, scores, gmax, 0, 1, cfg)
    else:
        _launch_scores(qk, w, index_cache, block_table, token_req_idx, positions, tiles, scores, 0,
                       _score_config(q.shape[1], None, fp8), fp8)
    return scores


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 token_req_idx: torch.Tensor, positions: torch.Tensor, topk: int, *,
                 q_scale: torch.Tensor | None = None, return_slots: bool = True, max_seq_len: int | None = None,
                 query_start_loc_cpu: list[int] | None = None, seq_lens_cpu: list[int] | None = None,
                 out_width: int | None = None, impl: str | None = None,
                 config: FusedConfig | None = None) -> torch.Tensor:
    """Triton `indexer_topk_ref` -> int32 [T, out_width or topk] global slots (or positions), -1 padded.

    q [T, H, D]: fp8 with `q_scale` [T, H], or float (quantised here when the cache is fp8; used as fp32
    when the cache is fp32). The host-side layout (`query_start_loc_cpu`, `seq_lens_cpu`, `max_seq_len`)
    lets rows of one request share key loads and skips requests that need no scores; without it every
    row is its own tile and the longest context is read from `positions` (one host sync).
    Valid entries come first in ascending position order (`indexer_topk_ref` orders them by score).
    `impl` and `config` (tests, benchmarks): the module docstring and `kernels.indexer_fused.FusedConfig`.
    """
    T, H, D = q.shape
    width = out_width or topk
    check_device(q, weights, index_cache, block_table, token_req_idx, positions)
    out = torch.empty((T, width), dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    qk, w, fp8 = _prepare(q, weights, index_cache, q_scale)
    S = max(1, int(positions.max()) + 1 if max_seq_len is None else max_seq_len)
    if _use_fused(impl, fp8, q.device):
        fused_indexer_topk(qk, w, index_cache, block_table, token_req_idx, positions, out, S, query_start_loc_cpu,
                           seq_lens_cpu, config, _MAX_SCORE_BYTES, return_slots)
        return out
    cfg = _score_config(H, query_start_loc_cpu, fp8)
    rows_per_chunk = max(cfg[1], _MAX_SCORE_BYTES // (4 * S))
    for lo in range(0, T, rows_per_chunk):
        hi = min(T, lo + rows_per_chunk)
        scores = torch.empty((hi - lo, S), dtype=torch.float32, device=q.device)
        tiles = tile_tensor(lo, hi, query_start_loc_cpu, seq_lens_cpu, width, cfg[1], q.device)
        _launch_scores(qk, w, index_cache, block_table, token_req_idx, positions, tiles, scores, lo, cfg, fp8)
        topk_rows(scores, positions, width, out, lo, token_req_idx=token_req_idx if return_slots else None,
                  block_table=block_table if return_slots else None, block_size=index_cache.shape[1])
    return out


def store_index_k_ref(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> rows at `slot_mapping` [T] (slot -1: not written)."""
    if index_cache.dim() != 3:
        raise ValueError(f"index_cache must be [num_blocks, block_size, row], got {tuple(index_cache.shape)}")
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep]
    bs = index_cache.shape[1]
    if index_cache.dtype == torch.uint8:
        rows = quantize_index_rows_ref(k[keep])
    else:
        rows = k[keep].float()
    if rows.shape[1] != index_cache.shape[2]:
        raise ValueError(f"key row width {rows.shape[1]} does not match the cache row {index_cache.shape[2]}")
    write_index_rows(index_cache, slots // bs, slots % bs, rows)


def gather_index_k_ref(index_cache: torch.Tensor, slots: torch.Tensor,
                       head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows at `slots` -> (values [n, D] float32, scales [n] float32); fp32 caches give scale 1."""
    bs = index_cache.shape[1]
    slots = slots.long()
    rows = read_index_rows(index_cache, slots // bs, slots % bs)
    if index_cache.dtype == torch.uint8:
        vals = rows[:, :head_dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[:, head_dim: head_dim + 4].contiguous().view(torch.float32).reshape(-1)
        return vals, scale
    return rows.float(), torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)


def index_scores_ref(q: torch.Tensor, weights: torch.Tensor, k_vals: torch.Tensor,
                     k_scale: torch.Tensor) -> torch.Tensor:
    """q [Tq, H, D] (fp8 or float), weights [Tq, H], keys [S, D] + scales [S] -> scores [Tq, S] fp32."""
    logits = torch.einsum("thd,sd->ths", q.float(), k_vals.float())
    return torch.einsum("ths,th->ts", logits.clamp_min(0), weights.float()) * k_scale[None, :]


def topk_positions_ref(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-k of scores [Tq, S] for queries at `positions` [Tq] -> int32 [Tq, topk], -1 padded.

    Ties go to the lower position (stable sort), so every implementation selects the same set.
    """
    Tq, S = scores.shape
    cols = torch.arange(S, device=scores.device)
    causal = cols[None, :] <= positions[:, None]
    masked = torch.where(causal, scores, torch.full_like(scores, float("-inf")))
    k = min(topk, S)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    picked_ok = torch.gather(causal, 1, order)
    out = torch.full((Tq, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = torch.where(picked_ok, order, torch.full_like(order, -1)).to(torch.int32)
    return out


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                     token_req_idx: torch.Tensor, positions: torch.Tensor, topk: int,
                     q_scale: torch.Tensor | None = None, head_dim: int | None = None,
                     return_slots: bool = True) -> torch.Tensor:
    """Top-k past tokens of every query row -> int32 [T, topk] global slots (or positions), -1 padded.

    q [T, H, D] fp8 (with `q_scale` [T, H]) or float; weights [T, H] fp32; block_table [B, max_blocks];
    token_req_idx [T] and positions [T] place each row in its request.
    """
    D = head_dim or q.shape[-1]
    bs = index_cache.shape[1]
    w = weights.float() * (q_scale.float() if q_scale is not None else 1.0)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for b in torch.unique(token_req_idx).tolist():
        rows = (token_req_idx == b).nonzero().flatten()
        S = int(positions[rows].max()) + 1
        pos = torch.arange(S, device=q.device)
        slots = block_table[b].long()[pos // bs] * bs + pos % bs
        k_vals, k_scale = gather_index_k_ref(index_cache, slots, D)
        scores = index_scores_ref(q[rows], w[rows], k_vals, k_scale)
        sel = topk_positions_ref(scores, positions[rows], topk)
        if return_slots:
            sel_slots = slots[sel.clamp(min=0).long()].to(torch.int32)
            sel = torch.where(sel >= 0, sel_slots, sel)
        out[rows] = sel
    return out
