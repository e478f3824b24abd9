"""Exact causal top-k from a threshold: one pass over the scores instead of the radix select's five.

The fused score kernel (`kernels.indexer_fused`) also writes, per row, the maximum of every group of
GROUP consecutive positions. Those maxima come from disjoint sets of real scores, so if a row has at
least k of them, their k-th largest, theta, is a lower bound of the row's k-th largest score: at least
k scores are >= theta, and every score of the top-k is. Selection per row t (n_t = positions[t] + 1):

    1. theta    the k-th largest of the row's ceil(n_t / GROUP) maxima (folded by max to <= SUM_CAP
                values first: a max over several groups is still a max over a disjoint set)
    2. compact  one pass over the scores: those >= theta, in ascending position order, into a
                candidate buffer (NCHUNK programs per row, each a contiguous range of positions; a small
                kernel then appends chunk c's candidates after those of chunks < c)
    3. select   the exact k-th largest of the <= CAP candidates in registers (bisection on the 32-bit
                key that orders like the float: one count over the registers per halving, ~15-20 of
                them), then every key above it and the lowest positions of the keys equal to it: the
                set a stable descending sort takes, written by a second pass over the candidates.

Costs (sm_90a, Triton 3.6): the compaction program has 16 warps streaming 32 KB of scores per step; the
selection 4 warps and under 170 registers, three per SM, so their reductions' latencies overlap. At
S = 128K the pass reads the 1 GB of scores once (the radix select read them five times).

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
def _kth_largest(key, k):
    """int64 T with count(key >= T) >= k > count(key > T), over the keys that are not _KEY_MIN (at least
    k of them): the k-th largest key, or, when a probe leaves exactly k keys at or above it, that probe."""
    lo = tl.min(tl.where(key != _KEY_MIN, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64)
    while lo < hi:  # count(key >= lo) >= k > count(key > hi); every probe is > lo, so _KEY_MIN never counts
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
                       SCAN: tl.constexpr):
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
        theta = _kth_largest(tl.where(i < num_folded, _ordered(m), _KEY_MIN), k).to(tl.int32)
        span = tl.cdiv(tl.cdiv(n, NCHUNK), SCAN) * SCAN
        lo = chunk * span
        hi = tl.minimum(n, lo + span)
        slot = (r * NCHUNK + chunk) * CAP
        count = 0
        for c0 in range(lo, hi, SCAN):
            cols = c0 + tl.arange(0, SCAN)
            key = _ordered(tl.load(score_ptr + r * ss_row + cols, mask=cols < hi, other=0.0))
            take = (cols < hi) & (key >= theta)
            dst = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(cand_ptr + slot + dst, key, mask=take & (dst < CAP))
            tl.store(cpos_ptr + slot + dst, cols, mask=take & (dst < CAP))
            count += tl.sum(take.to(tl.int32), axis=0)
        tl.store(count_ptr + r * NCHUNK + chunk, count)


@jit
def _gather_chunks_kernel(cand_ptr, cpos_ptr, count_ptr, pos_ptr, row_offset, k, GROUP: tl.constexpr,
                          SUM_CAP: tl.constexpr, CAP: tl.constexpr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r, chunk c >= 1): chunk c's candidates -> row r's chunk-0 slots, after those of chunks
    < c (position order), where they fit. Chunk 0's own candidates stay; no program reads another's writes."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) + 1
    n = tl.load(pos_ptr + row_offset + r).to(tl.int32) + 1
    _, _, num_folded = _folded_maxima(n, GROUP, SUM_CAP)
    if (n > k) & (num_folded >= k):
        j = tl.arange(0, NCHUNK)
        counts = tl.load(count_ptr + r * NCHUNK + j)
        start = tl.sum(tl.where(j < c, counts, 0), axis=0)
        cnt = tl.minimum(tl.sum(tl.where(j == c, counts, 0), axis=0), CAP - start)
        for i0 in range(0, cnt, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            ok = i < cnt
            src = (r * NCHUNK + c) * CAP + i
            dst = r * NCHUNK * CAP + start + i
            tl.store(cand_ptr + dst, tl.load(cand_ptr + src, mask=ok), mask=ok)
            tl.store(cpos_ptr + dst, tl.load(cpos_ptr + src, mask=ok), mask=ok)


@jit
def _emit_selected(key, src_ptr, cpos_row, num, k, bt_row, o_row, AS_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   FROM_SCORES: tl.constexpr, BLOCK: tl.constexpr):
    """The k largest of `key` (the `num` entries of src_ptr in registers, _KEY_MIN elsewhere) -> o_row[0, k)
    in entry order (ascending positions); of the keys equal to the k-th largest, the first ones win. The
    emission streams the entries again, BLOCK at a time, so the registers hold only the one [CAP] tensor:
    src_ptr holds scores (FROM_SCORES: an entry's position is its index) or candidate keys (its position is
    cpos_row[index])."""
    thr = _kth_largest(key, k).to(tl.int32)
    k_eq = k - tl.sum((key > thr).to(tl.int32), axis=0)
    gt_seen = 0
    eq_seen = 0
    for c0 in range(0, num, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < num
        if FROM_SCORES:
            kk = _ordered(tl.load(src_ptr + cols, mask=ok, other=0.0))
        else:
            kk = tl.load(src_ptr + cols, mask=ok, other=0)
        gt = ok & (kk > thr)
        eq = ok & (kk == thr)
        seen = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)  # both counts < 2^15: one scan
        eq_rank = eq_seen + (seen >> 16)
        take = gt | (eq & (eq_rank <= k_eq))
        dst = gt_seen + (seen & 0xFFFF) + tl.minimum(eq_rank, k_eq) - 1
        val = cols
        if not FROM_SCORES:
            val = tl.load(cpos_row + cols, mask=take, other=0)
        if AS_SLOTS:  # slots fit int32 (the output's type)
            val = tl.load(bt_row + val // BLOCK_SIZE, mask=take, other=0) * BLOCK_SIZE + val % BLOCK_SIZE
        tl.store(o_row + dst, val, mask=take)
        gt_seen += tl.sum(gt.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)


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
    s_row = score_ptr + r * ss_row
    if n <= k:
        _emit_all(n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
    elif num_folded >= k:
        total = tl.sum(tl.load(count_ptr + r * NCHUNK + tl.arange(0, NCHUNK)), axis=0)
        if total <= CAP:  # else a chunk overflowed its slots, or they do not fit the registers together
            c_row = cand_ptr + r * NCHUNK * CAP
            key = tl.load(c_row + i, mask=i < total, other=_KEY_MIN)
            _emit_selected(key, c_row, cpos_ptr + r * NCHUNK * CAP, total, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE,
                           False, BLOCK)
        else:
            _radix_select_row(s_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
    elif n <= CAP:
        key = tl.where(i < n, _ordered(tl.load(s_row + i, mask=i < n, other=0.0)), _KEY_MIN)
        _emit_selected(key, s_row, cpos_ptr, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, True, BLOCK)
    else:
        _radix_select_row(s_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)


@dataclass(frozen=True)
class SelectConfig:
    """`group` positions per maximum (the score kernel's GROUP), at most `sum_cap` folded maxima and `cap`
    candidates per row held in registers, `scan` scores per step of the compaction pass (several KB in
    flight per program), `block` per step of the radix fallback, `num_chunks` compaction programs per row
    (None: enough to fill the GPU)."""
    group: int = 16
    sum_cap: int = 8192
    cap: int = 8192
    scan: int = 8192
    block: int = 2048
    num_chunks: int | None = None

    def __post_init__(self):
        for name in ("group", "sum_cap", "cap", "scan", "block", "num_chunks"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"SelectConfig.{name} = {v} must be a power of two")
        if self.block > 1 << 14:
            raise ValueError(f"SelectConfig.block = {self.block}: at most 16384 (the emission packs two counts)")


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
    consts = dict(GROUP=cfg.group, SUM_CAP=cfg.sum_cap, CAP=cfg.cap, NCHUNK=nchunk)
    _candidates_kernel[(rows, nchunk)](scores, gmax, positions, cand, cand_pos, counts, row_offset, scores.stride(0),
                                       gmax.stride(0), k, **consts, SCAN=cfg.scan, num_warps=16)
    if nchunk > 1:
        _gather_chunks_kernel[(rows, nchunk - 1)](cand, cand_pos, counts, positions, row_offset, k, **consts,
                                                  BLOCK=cfg.block, num_warps=4)
    _select_kernel[(rows,)](scores, positions, req, table, out, cand, cand_pos, counts, row_offset, scores.stride(0),
                            out.stride(0), table.stride(0) if as_slots else 0, k, BLOCK_SIZE=block_size,
                            AS_SLOTS=as_slots, **consts, BLOCK=cfg.block, num_warps=4)


def num_maxima(seq_len: int, cfg: SelectConfig) -> int:
    """Columns of the group-maxima buffer for rows of up to `seq_len` positions."""
    return triton.cdiv(max(seq_len, 1), cfg.group)
