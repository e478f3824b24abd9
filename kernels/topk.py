"""Exact causal top-k of score rows by radix select (the indexer's selection step).

Row t holds scores for positions [0, n_t), n_t = positions[t] + 1. Each score maps to a 32-bit key that
orders like the float (sign bit flipped for positives, all bits for negatives; -0.0 counts as +0.0).
Four 8-bit passes over the row, from the top byte down, count the keys that share the prefix found so far
and pick the digit holding the k-th largest key; after them `thr` is exactly that key and `k_eq` says how
many keys equal to it are taken. A last pass writes, in position order, every key > thr and the first
k_eq keys == thr: the lowest positions win ties, the same set as a stable descending sort.

    pass:   digit 31..24  ->  23..16  ->  15..8  ->  7..0  ->  emit (positions ascending)

Rows with n_t <= k take every position 0..n_t-1 without reading scores. Output: int32 [T, k], valid
entries first in ascending position order, then -1. `topk_positions_ref` (kernels.indexer) returns the
same set ordered by score.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit


@jit
def _emit_all(n, k, bt_row, o_row, AS_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Row with n <= k candidates: positions 0..n-1 in order (as slots with AS_SLOTS), then -1."""
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        val = cols.to(tl.int64)
        if AS_SLOTS:
            page = tl.load(bt_row + val // BLOCK_SIZE, mask=cols < n, other=0).to(tl.int64)
            val = page * BLOCK_SIZE + val % BLOCK_SIZE
        tl.store(o_row + cols, tl.where(cols < n, val, -1).to(tl.int32), mask=cols < k)


@jit
def _radix_select_row(s_row, n, k, bt_row, o_row, AS_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Top-k of the scores s_row[0, n) (n > k) into o_row[0, k), ascending positions (module docstring)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    k_rem = k
    for i in tl.static_range(4):
        shift = 24 - 8 * i
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, n, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(s_row + cols, mask=cols < n, other=0.0)
            bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.int64) & 0xFFFFFFFF
            match = (cols < n) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = tl.where(match, (key >> shift) & 255, 0).to(tl.int32)
            # non-matching keys were counted in bin 0: take them back out (no masked histogram in 3.6)
            h = tl.histogram(digit, 256)
            hist += h - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= d
        d = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
        k_rem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
        prefix = prefix | (d.to(tl.int64) << shift)
    taken = 0
    eq_seen = 0
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(s_row + cols, mask=cols < n, other=0.0)
        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, ~bits, bits | -2147483648).to(tl.int64) & 0xFFFFFFFF
        eq = (cols < n) & (key == prefix)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0)
        take = ((cols < n) & (key > prefix)) | (eq & (eq_rank <= k_rem))
        dst = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        val = cols.to(tl.int64)
        if AS_SLOTS:
            page = tl.load(bt_row + val // BLOCK_SIZE, mask=take, other=0).to(tl.int64)
            val = page * BLOCK_SIZE + val % BLOCK_SIZE
        tl.store(o_row + dst, val.to(tl.int32), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)


@jit(do_not_specialize=["s_bt"])  # the step's block-table width
def _topk_kernel(score_ptr, pos_ptr, req_ptr, bt_ptr, out_ptr, row_offset, ss_row, so_row, s_bt, k,
                 BLOCK_SIZE: tl.constexpr, AS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = row_offset + r
    n = tl.load(pos_ptr + row).to(tl.int32) + 1
    bt_row = bt_ptr + tl.load(req_ptr + row).to(tl.int64) * s_bt
    o_row = out_ptr + row * so_row
    if n <= k:
        _emit_all(n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
    else:
        _radix_select_row(score_ptr + r * ss_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)


def topk_rows(scores: torch.Tensor, positions: torch.Tensor, k: int, out: torch.Tensor, row_offset: int = 0, *,
              token_req_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
              block_size: int = 1) -> None:
    """Rows [row_offset, row_offset + len(scores)) of `out` [T, k] int32 <- top-k positions of scores [rows, S]
    (row i scores positions [0, positions[row_offset + i]]). With `block_table` (and `token_req_idx`) the
    positions are written as global slots."""
    rows = scores.shape[0]
    if rows == 0:
        return
    if out.dtype != torch.int32 or out.shape[1] != k or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [T, {k}] with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError("scores must be float32 with contiguous rows")
    as_slots = block_table is not None
    req = token_req_idx if as_slots else positions
    table = block_table if as_slots else positions
    check_device(scores, positions, out, req, table)
    block = 256 if interpreting() else 2048
    _topk_kernel[(rows,)](scores, positions, req, table, out, row_offset, scores.stride(0), out.stride(0),
                          table.stride(0) if as_slots else 0, k, BLOCK_SIZE=block_size, AS_SLOTS=as_slots, BLOCK=block,
                          num_warps=8 if block >= 2048 else 4)
