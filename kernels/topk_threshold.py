"""Exact causal top-k from a threshold: a few passes over a row's group maxima and its best groups' scores.

The fused score kernel (`kernels.indexer_fused`) also writes, per row, the maximum of every group of
GROUP consecutive positions. Those maxima come from disjoint sets of real scores, so if a row has at
least k of them, their k-th largest, theta, is a lower bound of the row's k-th largest score: at least
k scores are >= theta, and every score of the top-k is. And a score >= theta lies in a group whose
maximum is >= theta. One program per row (a persistent grid, scratch per program), n_t = positions[t] + 1:

    1. theta    the k-th largest of the row's ceil(n_t / GROUP) maxima (folded by max to <= SUM_CAP
                values first: a max over several groups is still a max over a disjoint set)
    2. groups   one pass over the maxima: the groups whose maximum is >= theta, ascending, into a list of
                at most GCAP (about k of them: k when unfolded, a little more when folded)
    3. compact  the listed groups' scores >= theta, in ascending position order, into a candidate buffer
                of at most CAP (SCAN scores per step: whole groups, 64-byte runs)
    4. select   the exact k-th largest of the candidates in registers (bisection on the 32-bit key that
                orders like the float: one count over the registers per halving), then every key above
                it and the lowest positions of the keys equal to it: the set a stable descending sort
                takes, written by a second pass over the candidates.

Steps 2-3 read ceil(n_t / GROUP) maxima and about k * GROUP scores, whatever n_t is: at S = 128K a row's
selection reads 32 KB of maxima and ~128 KB of its 512 KB of scores, at S = 1M 256 KB and ~128 KB of 4 MB.
(The previous form scanned every score of a row in one program, 16 to 128 serial steps of 8,192: 2.1 ms of
a 128K prefill's 5.6 ms on the H200, bench/data/kernels/indexer-select/NOTES.md.) Each step is a block-wide scan or
reduction; the list and the candidates go through global scratch that the same program reads back after a
barrier (L1/L2-resident).

With random-like scores and about 4k maxima per row, ~1.15 k scores pass theta (2,048 -> ~2,400). A
row with fewer than k maxima skips the threshold: with n_t <= CAP the selection reads the row itself
(S = 8K), else the radix select. A row whose passing groups outgrow GCAP or whose candidates outgrow CAP
(many equal scores) falls back to the radix select of `kernels.topk` on the full row, so the result is
exact for any input. Rows with n_t <= k take every position. Output as `topk_rows`: int32 [T, k],
ascending positions (or slots), then -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.topk import _emit_all, _radix_select_row
from kernels.triton_support import check_device, jit, num_sms

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
def _theta(gmax_row, num_groups, fold, num_folded, k, SUM_CAP: tl.constexpr):
    """The k-th largest of the row's folded group maxima (int32 key): a lower bound of its k-th largest score."""
    i = tl.arange(0, SUM_CAP)
    m = tl.full([SUM_CAP], float("-inf"), tl.float32)
    for j in range(fold):
        g = i * fold + j
        m = tl.maximum(m, tl.load(gmax_row + g, mask=(i < num_folded) & (g < num_groups), other=float("-inf")))
    return _kth_largest(tl.where(i < num_folded, _ordered(m), _KEY_MIN), k).to(tl.int32)


@jit
def _passing_groups(gmax_row, num_groups, theta, glist, GCAP: tl.constexpr, SCAN: tl.constexpr):
    """Ids of the groups whose maximum is >= theta, ascending -> glist[0, min(count, GCAP)); returns the count."""
    count = 0
    for g0 in range(0, num_groups, SCAN):
        g = g0 + tl.arange(0, SCAN)
        ok = g < num_groups
        take = ok & (_ordered(tl.load(gmax_row + g, mask=ok, other=0.0)) >= theta)
        dst = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(glist + dst, g, mask=take & (dst < GCAP))
        count += tl.sum(take.to(tl.int32), axis=0)
    return count


@jit
def _compact(s_row, n, theta, glist, num_listed, cand, cpos, CAP: tl.constexpr, GROUP: tl.constexpr,
             SCAN: tl.constexpr):
    """Scores >= theta of the listed groups (positions < n), ascending -> cand (keys) / cpos (positions)
    [0, min(count, CAP)); returns the count."""
    count = 0
    i = tl.arange(0, SCAN)
    for e0 in range(0, num_listed * GROUP, SCAN):
        e = e0 + i
        listed = e < num_listed * GROUP
        cols = tl.load(glist + e // GROUP, mask=listed, other=0) * GROUP + e % GROUP
        ok = listed & (cols < n)
        key = _ordered(tl.load(s_row + cols, mask=ok, other=0.0))
        take = ok & (key >= theta)
        dst = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(cand + dst, key, mask=take & (dst < CAP))
        tl.store(cpos + dst, cols, mask=take & (dst < CAP))
        count += tl.sum(take.to(tl.int32), axis=0)
    return count


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


# k: the top-k, or a shorter context's width; s_bt: the step's block-table width
@jit(do_not_specialize=["rows", "row_offset", "k", "so_row", "s_bt"])
def _select_kernel(score_ptr, gmax_ptr, pos_ptr, req_ptr, bt_ptr, out_ptr, glist_ptr, cand_ptr, cpos_ptr, rows,
                   row_offset, ss_row, sg_row, so_row, s_bt, k, BLOCK_SIZE: tl.constexpr, AS_SLOTS: tl.constexpr,
                   GROUP: tl.constexpr, SUM_CAP: tl.constexpr, GCAP: tl.constexpr, CAP: tl.constexpr,
                   SCAN: tl.constexpr, BLOCK: tl.constexpr):
    """Persistent program p: rows p, p + programs, ...: each row's top-k from its threshold candidates, its
    own scores (no threshold, n <= CAP), or the radix select (too many candidates, or neither)."""
    p = tl.program_id(0).to(tl.int64)
    glist = glist_ptr + p * GCAP
    cand = cand_ptr + p * CAP
    cpos = cpos_ptr + p * CAP
    i = tl.arange(0, CAP)
    for r32 in range(tl.program_id(0), rows, tl.num_programs(0)):
        r = tl.cast(r32, tl.int64)
        row = row_offset + r
        n = tl.load(pos_ptr + row).to(tl.int32) + 1
        bt_row = bt_ptr + tl.load(req_ptr + row).to(tl.int64) * s_bt
        o_row = out_ptr + row * so_row
        s_row = score_ptr + r * ss_row
        gmax_row = gmax_ptr + r * sg_row
        num_groups, fold, num_folded = _folded_maxima(n, GROUP, SUM_CAP)
        tl.debug_barrier()  # the last row's reads of the scratch are done before it is written again
        if n <= k:
            _emit_all(n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
        elif num_folded >= k:
            theta = _theta(gmax_row, num_groups, fold, num_folded, k, SUM_CAP)
            listed = _passing_groups(gmax_row, num_groups, theta, glist, GCAP, SCAN)
            total = tl.full([], CAP + 1, tl.int32)
            if listed <= GCAP:
                tl.debug_barrier()  # the list, written by every thread, is read by every thread
                total = _compact(s_row, n, theta, glist, listed, cand, cpos, CAP, GROUP, SCAN)
            if total <= CAP:
                tl.debug_barrier()
                key = tl.load(cand + i, mask=i < total, other=_KEY_MIN)
                _emit_selected(key, cand, cpos, total, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, False, BLOCK)
            else:
                _radix_select_row(s_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)
        elif n <= CAP:
            key = tl.where(i < n, _ordered(tl.load(s_row + i, mask=i < n, other=0.0)), _KEY_MIN)
            _emit_selected(key, s_row, cpos, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, True, BLOCK)
        else:
            _radix_select_row(s_row, n, k, bt_row, o_row, AS_SLOTS, BLOCK_SIZE, BLOCK)


@dataclass(frozen=True)
class SelectConfig:
    """`group` positions per maximum (the score kernel's GROUP), at most `sum_cap` folded maxima, `gcap`
    passing groups and `cap` candidates per row (the candidates and the maxima are held in registers),
    `scan` maxima or scores per step of the list and compaction passes, `block` per step of the emission and
    the radix fallback, `num_warps` per program (`direct_warps` when no row is long enough for a threshold:
    S <= `cap`, each row ranked in registers), `programs` per multiprocessor (the persistent grid; each program
    has its own scratch). Defaults: the fastest of `python -m bench.kernels --only indexer --sweep select` on
    the H200 (bench/data/kernels/indexer-select/NOTES.md)."""
    group: int = 16
    sum_cap: int = 8192
    gcap: int = 8192
    cap: int = 8192
    scan: int = 4096
    block: int = 2048
    num_warps: int = 8
    direct_warps: int = 4
    programs: int = 4

    def __post_init__(self):
        for name in ("group", "sum_cap", "gcap", "cap", "scan", "block"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SelectConfig.{name} = {v} must be a power of two")
        if self.block > 1 << 14:
            raise ValueError(f"SelectConfig.block = {self.block}: at most 16384 (the emission packs two counts)")
        if self.scan < self.group:
            raise ValueError(f"SelectConfig.scan = {self.scan} must cover a group ({self.group})")
        if min(self.num_warps, self.direct_warps, self.programs) < 1:
            raise ValueError("SelectConfig.num_warps, direct_warps and programs must be >= 1")


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
    programs = min(rows, cfg.programs * num_sms(scores.device))
    glist = torch.empty((programs, cfg.gcap), dtype=torch.int32, device=scores.device)
    cand = torch.empty((programs, cfg.cap), dtype=torch.int32, device=scores.device)
    cand_pos = torch.empty_like(cand)
    _select_kernel[(programs,)](scores, gmax, positions, req, table, out, glist, cand, cand_pos, rows, row_offset,
                                scores.stride(0), gmax.stride(0), out.stride(0), table.stride(0) if as_slots else 0,
                                k, BLOCK_SIZE=block_size, AS_SLOTS=as_slots, GROUP=cfg.group, SUM_CAP=cfg.sum_cap,
                                GCAP=cfg.gcap, CAP=cfg.cap, SCAN=cfg.scan, BLOCK=cfg.block,
                                num_warps=cfg.direct_warps if scores.shape[1] <= cfg.cap else cfg.num_warps)


def num_maxima(seq_len: int, cfg: SelectConfig) -> int:
    """Columns of the group-maxima buffer for rows of up to `seq_len` positions."""
    return triton.cdiv(max(seq_len, 1), cfg.group)
