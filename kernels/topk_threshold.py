"""Exact causal top-k from a threshold: one pass over the scores instead of the radix select's five.

The fused score kernel (`kernels.indexer_fused`) also writes, per row, the maximum of every group of
GROUP consecutive positions. Those maxima come from disjoint sets of real scores, so if a row has at
least k of them, their k-th largest, theta, is a lower bound of the row's k-th largest score: at least
k scores are >= theta, and every score of the top-k is. Selection per row t (n_t = positions[t] + 1):

    1. theta    the k-th largest of the row's ceil(n_t / GROUP) maxima (folded by max to <= SUM_CAP
                values first: a max over several groups is still a max over a disjoint set)
    2. compact  one pass over the scores: those >= theta, in ascending position order, into a
                candidate buffer (NCHUNK programs per row, each a contiguous range of positions)
    3. select   the exact k-th largest of the <= CAP candidates in registers (bisection on the 32-bit
                key that orders like the float), then every key above it and the lowest positions of
                the keys equal to it: the set a stable descending sort takes.

With random-like scores and about 4k maxima per row, ~1.15 k scores pass theta (2,048 -> ~2,400). A
row with fewer than k maxima skips the threshold: with n_t <= CAP the selection reads the row itself
(S = 8K), else its candidates are all of it. A row whose candidates outgrow CAP (many equal scores)
falls back to the radix select of `kernels.topk` on the full row, so the result is exact for any input.
Rows with n_t <= k take every position. Output as `topk_rows`: int32 [T, k], ascending positions (or
slots), then -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._jit import check_device, jit, num_sms
from kernels.topk import _emit_all, _radix_select_row

_KEY_MIN = tl.constexpr(-2147483648)  # below every float's key: masked entries are never counted


@jit
def _ordered(x):
    """fp32 -> int32 key with the float's order; -0.0 and +0.0 map to the same key."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@jit
def _kth_largest(key, valid, k):
    """int64 T with count(key >= T) >= k > count(key > T) over key[valid] (at least k valid): the k-th
    largest key, or a value with exactly k keys above or at it and none equal (the bisection's early exit)."""
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(valid, key, _KEY_MIN), axis=0).to(tl.int64)
    key = tl.where(valid, key, _KEY_MIN)  # every probe is > lo >= the smallest valid key
    while lo < hi:  # count(key >= lo) >= k, count(key > hi) < k
        mid = lo + (hi - lo + 1) // 2
        c = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        hi = tl.where(c >= k, tl.where(c == k, mid, hi), mid - 1)
        lo = tl.where(c >= k, mid, lo)
    return lo


@jit
def _folded_maxima(n, GROUP: tl.constexpr, SUM_CAP: tl.constexpr):
    """(groups of a row of n positions, groups per folded maximum, folded maxima)."""
    num_groups = tl.cdiv(n, GROUP)
    fold = tl.cdiv(num_groups, SUM_CAP)
    return num_groups, fold, tl.cdiv(num_groups, fold)


@jit
def _candidates_kernel(score_ptr, gmax_ptr, pos_ptr, cand_ptr, cpos_ptr, count_ptr, row_offset, ss_row, sg_row, k,
                       GROUP: tl.constexpr, SUM_CAP: tl.constexpr, CAP: tl.constexpr, NCHUNK: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (row r, chunk c): theta from the row's maxima, then its positions' keys >= theta -> the
    chunk's candidate slots [r, c, 0..CAP) and its count (uncapped) -> count[r, c]."""
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n = tl.load(pos_ptr + row_offset + r).to(tl.int32) + 1
    num_groups, fold, num_folded = _folded_maxima(n, GROUP, SUM_CAP)
    if (n > k) & (num_folded >= k):
        i = tl.arange(0, SUM_CAP)
        m = tl.full([SUM_CAP], float("-inf"), tl.float32)
        for j in range(fold):
            g = i * fold + j
            m = tl.maximum(m, tl.load(gmax_ptr + r * sg_row + g, mask=(i < num_folded) & (g < num_groups),
                                      other=float("-inf")))
        theta = _kth_largest(_ordered(m), i < num_folded, k).to(tl.int32)
        span = tl.cdiv(tl.cdiv(n, NCHUNK), BLOCK) * BLOCK
        lo = chunk * span
        hi = tl.minimum(n, lo + span)
        slot = (r * NCHUNK + chunk) * CAP
        count = 0
        for c0 in range(lo, hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            key = _ordered(tl.load(score_ptr + r * ss_row + cols, mask=cols < hi, other=0.0))
            take = (cols < hi) & (key >= theta)
            dst = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(cand_ptr + slot + dst, key, mask=take & (dst < CAP))
            tl.store(cpos_ptr + slot + dst, cols, mask=take & (dst < CAP))
            count += tl.sum(take.to(tl.int32), axis=0)
        tl.store(count_ptr + r * NCHUNK + chunk, count)


@jit
def _emit_selected(key, cand_pos, valid, k, bt_row, o_row, AS_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The k largest of key[valid] -> o_row[0, k) in the order of the entries (ascending positions);
    among keys equal to the k-th largest, the first ones win."""
    thr = _kth_largest(key, valid, k).to(tl.int32)
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    k_eq = k - tl.sum(gt.to(tl.int32), axis=0)
    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= k_eq))
    dst = tl.cumsum(take.to(tl.int32), axis=0) - 1
    val = cand_pos.to(tl.int64)
    if AS_SLOTS:
        page = tl.load(bt_row + val // BLOCK_SIZE, mask=take, other=0).to(tl.int64)
        val = page * BLOCK_SIZE + val % BLOCK_SIZE
    tl.store(o_row + dst, val.to(tl.int32), mask=take)


@jit
def _select_kernel(score_ptr, pos_ptr, req_ptr, bt_ptr, out_ptr, cand_ptr, cpos_ptr, count_ptr, row_offset, ss_row,
                   so_row, s_bt, k, BLOCK_SIZE: tl.constexpr, AS_SLOTS: tl.constexpr, GROUP: tl.constexpr,
                   SUM_CAP: tl.constexpr, CAP: tl.constexpr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r): the row's top-k from its candidates, its own scores (no threshold, n <= CAP), or
    the radix select (too many candidates)."""
    r = tl.program_id(0).to(tl.int64)
    row = row_offset + r
    n = tl.load(pos_ptr + row).to(tl.int32) + 1
    bt_row = bt_ptr + tl.load(req_ptr + row).to(tl.int64) * s_bt
    o_row = out_ptr + row * so_row
    _, _, num_folded = _folded_maxima(n, GROUP, SUM_CAP)
    i = tl.arange(0, CAP)
    if n <= k:
        _emit_all(n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
    elif num_folded >= k:
        total = 0
        src = i
        for c in tl.static_range(NCHUNK):  # chunk c's candidates follow those of chunks < c
            cnt = tl.load(count_ptr + r * NCHUNK + c)
            src = tl.where((i >= total) & (i < total + cnt), c * CAP + i - total, src)
            total += cnt
        if total <= CAP:
            ok = i < total
            slot = r * NCHUNK * CAP + src
            key = tl.load(cand_ptr + slot, mask=ok, other=0)
            cand_pos = tl.load(cpos_ptr + slot, mask=ok, other=0)
            _emit_selected(key, cand_pos, ok, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE)
        else:
            _radix_select_row(score_ptr + r * ss_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
    elif n <= CAP:
        key = _ordered(tl.load(score_ptr + r * ss_row + i, mask=i < n, other=0.0))
        _emit_selected(key, i, i < n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE)
    else:
        _radix_select_row(score_ptr + r * ss_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)


@dataclass(frozen=True)
class SelectConfig:
    """`group` positions per maximum (the score kernel's GROUP), at most `sum_cap` folded maxima and `cap`
    candidates per row held in registers, `block` scores per streaming step, `num_chunks` compaction
    programs per row (None: enough to fill the GPU)."""
    group: int = 16
    sum_cap: int = 8192
    cap: int = 8192
    block: int = 2048
    num_chunks: int | None = None

    def __post_init__(self):
        for name in ("group", "sum_cap", "cap", "block", "num_chunks"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"SelectConfig.{name} = {v} must be a power of two")


def _num_chunks(rows: int, cfg: SelectConfig, device: torch.device) -> int:
    """Programs per row for the compaction: about 4 programs per SM over all rows, at most 16."""
    if cfg.num_chunks is not None:
        return cfg.num_chunks
    want = -(-4 * num_sms(device) // max(rows, 1))
    return min(16, 1 << max(0, (want - 1).bit_length()))


def topk_threshold_rows(scores: torch.Tensor, gmax: torch.Tensor, positions: torch.Tensor, k: int, out: torch.Tensor,
                        row_offset: int, cfg: SelectConfig, *, token_req_idx: torch.Tensor | None = None,
                        block_table: torch.Tensor | None = None, block_size: int = 1) -> None:
    """`topk_rows` for the fused score kernel's outputs: rows [row_offset, row_offset + len(scores)) of `out`
    [T, k] int32 <- the top-k positions (or, with `block_table`, slots) of scores [rows, S] fp32, given
    gmax [rows, >= S / cfg.group] fp32 (the maxima of each group of positions)."""
    rows = scores.shape[0]
    if rows == 0:
        return
    if out.dtype != torch.int32 or out.shape[1] != k or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [T, {k}] with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    if scores.dtype != torch.float32 or scores.stride(1) != 1 or gmax.dtype != torch.float32 or gmax.stride(1) != 1:
        raise ValueError("scores and gmax must be float32 with contiguous rows")
    as_slots = block_table is not None
    req = token_req_idx if as_slots else positions
    table = block_table if as_slots else positions
    check_device(scores, gmax, positions, out, req, table)
    nchunk = _num_chunks(rows, cfg, scores.device)
    cand = torch.empty((rows, nchunk, cfg.cap), dtype=torch.int32, device=scores.device)
    cand_pos = torch.empty_like(cand)
    counts = torch.empty((rows, nchunk), dtype=torch.int32, device=scores.device)
    consts = dict(GROUP=cfg.group, SUM_CAP=cfg.sum_cap, CAP=cfg.cap, NCHUNK=nchunk, BLOCK=cfg.block)
    _candidates_kernel[(rows, nchunk)](scores, gmax, positions, cand, cand_pos, counts, row_offset, scores.stride(0),
                                       gmax.stride(0), k, **consts, num_warps=4)
    _select_kernel[(rows,)](scores, positions, req, table, out, cand, cand_pos, counts, row_offset, scores.stride(0),
                            out.stride(0), table.stride(0) if as_slots else 0, k, BLOCK_SIZE=block_size,
                            AS_SLOTS=as_slots, **consts, num_warps=8)


def num_maxima(seq_len: int, cfg: SelectConfig) -> int:
    """Columns of the group-maxima buffer for rows of up to `seq_len` positions."""
    return triton.cdiv(max(seq_len, 1), cfg.group)
