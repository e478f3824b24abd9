"""HiSparse's per-step plan in one kernel: selections -> hits, misses and LRU victims, the hot buffer's state
updated, the virtual selections for the attention kernel and compact miss-copy slot lists written.

`plan_hot_ref` computes the same with about seventy small torch ops (`resolve_ref` is the LRU plan itself,
which `engine.hisparse.hot_buffer` runs on CPUs); `tests/unit/engine/hisparse/test_hisparse_plan_kernel.py`
checks the two agree entry for entry. One program per request:

    1. gather the request's selected positions (its 1 or 1 + drafts rows of the top-k) and sort them
       (key = position * N_PAD + entry, so duplicates sit together and the entry is recovered); where every
       row is already ascending (the indexer kernels' rows: `rows_sorted`) merge them instead, each entry's
       place found by a binary search in each other row
    2. classify: device page -> read in place;  >= start -> the reserved newest row;  else the LRU
    3. void LRU rows caching positions >= start; each row binary-searches its position among the sorted
       selections and claims the LRU entry it finds (a row's hit)
    4. victims: the n least recently used rows that no entry hits, n = the misses: the n-th smallest
       (stamp, row) found by a binary search over stamps (a count per probe), not a sort; the i-th miss, by
       position, takes the i-th victim in row order
    5. record positions and stamps of hit and victim rows; duplicates take their first entry's row
    6. write the virtual selection of every entry (device position, or hot_base + hot row) into the
       pool's selection rows, the misses (host slot -> device slot) compactly, and add the counters

The selections' sort is the only one (none with `rows_sorted`): the rows are never sorted (by position for
the lookup, or by stamp for the victims), which the kernel's first form did, three bitonic sorts in all
(docs/hisparse.md). Rows of a sorted vector are exchanged through a per-program scratch area in global
memory (a barrier between the store and the loads of other threads), as Triton has no register shuffles by
index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_support import CompiledKernel

_BIG = 1 << 40  # sorts after every position (positions are int32) and every plan clock


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_key(row_ptr, idx, ok, K, BIG: tl.constexpr):
    """A top-k row's entry at idx as a merge key: its position, BIG for -1 (invalid), past every key beyond K."""
    key = tl.load(row_ptr + idx, mask=ok & (idx < K), other=-1).to(tl.int64)
    return tl.where(idx < K, tl.where(key >= 0, key, BIG), BIG + 2)


@triton.jit(do_not_specialize=["bytes_per_miss"])
def _plan_kernel(topk_ptr, s_topk, entry_ptr, start_ptr, hot_slot_ptr, table_slot_ptr, hot_base_ptr,
                 page_ptr, s_page, host_ptr, s_host, hblk_ptr, s_hblk,
                 rowpos_ptr, stamp_ptr, state_off, s_state,
                 dst_row_ptr, sel_ptr, s_sel, msrc_ptr, mdst_ptr, scratch_ptr, counters_ptr,
                 bytes_per_miss, clock_ptr, R, K, M, BS,
                 N_PAD: tl.constexpr, R_PAD: tl.constexpr, LOG_N: tl.constexpr, ROWS_SORTED: tl.constexpr,
                 K_PAD: tl.constexpr, LOG_K: tl.constexpr):
    BIG: tl.constexpr = 1 << 40
    b = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, N_PAD).to(tl.int64)
    r = tl.arange(0, R_PAD).to(tl.int64)
    scr = scratch_ptr + b * (4 * N_PAD + R_PAD)
    s_sorted = scr  # [N_PAD] sorted positions (BIG: none)
    s_lru = scr + N_PAD  # [N_PAD] 1 where the sorted entry is an LRU lookup
    s_hit = scr + 2 * N_PAD  # [N_PAD] the LRU row holding the sorted entry's position (-1: none)
    s_first = scr + 3 * N_PAD  # [N_PAD] row of each sorted entry
    s_vict = scr + 4 * N_PAD  # [R_PAD] victim rows, in row order

    # 1. the request's selections in the order of (position, entry), invalid last
    in_n = e < M * K
    m = e // K
    kk = e % K
    erow = tl.load(entry_ptr + b * M + m, mask=in_n, other=-1)
    p = tl.load(topk_ptr + erow * s_topk + kk, mask=in_n & (erow >= 0), other=-1).to(tl.int64)
    if ROWS_SORTED:
        # every row of the top-k ascending, then -1 (the indexer kernels' rows): a merge instead of a sort. An
        # entry's place is its index in its row plus, in each other row, the entries before it (rows above it:
        # positions <= its own; rows below: < its own), a binary search each; entries past M * K stay last
        v = tl.where(p >= 0, p, BIG)
        rank = tl.where(in_n, kk, e)
        for mm in range(0, M):
            orow = tl.load(entry_ptr + b * M + mm + e * 0)  # the row's batch row, on every lane
            row_ok = in_n & (orow >= 0)
            t = v + (m > mm).to(tl.int64)
            lo = tl.zeros([N_PAD], dtype=tl.int64)
            for j in tl.static_range(LOG_K):
                probe = _row_key(topk_ptr + orow * s_topk, lo + (K_PAD >> (j + 1)) - 1, row_ok, K, BIG)
                lo = tl.where(probe < t, lo + (K_PAD >> (j + 1)), lo)
            probe = _row_key(topk_ptr + orow * s_topk, lo, row_ok, K, BIG)  # lo < K_PAD: the last place too
            rank += tl.where(in_n & (m != mm), lo + (probe < t).to(tl.int64), 0)
        tl.store(s_sorted + rank, v)
        tl.store(s_first + rank, e)  # scratch until step 5: the entry at each place
        tl.debug_barrier()
        spos = tl.load(s_sorted + e)
        order = tl.load(s_first + e)
    else:  # any order: the kernel's one sort
        skey = tl.sort(tl.where(p >= 0, p, BIG) * N_PAD + e)
        spos = skey // N_PAD
        order = skey % N_PAD
    valid = spos != BIG
    tl.debug_barrier()
    tl.store(s_sorted + e, spos)
    tl.debug_barrier()
    prev = tl.load(s_sorted + e - 1, mask=e > 0, other=-1)
    first = spos != prev

    # 2. classify
    tslot = tl.load(table_slot_ptr + b)
    page = tl.load(page_ptr + tslot * s_page + spos // BS, mask=valid, other=-1)
    on_dev = valid & (page >= 0)
    start = tl.load(start_ptr + b)
    hot = valid & (page < 0)
    newest = hot & (spos >= start)
    lru = first & hot & (spos < start)
    tl.store(s_lru + e, lru.to(tl.int64))
    tl.store(s_hit + e, tl.full([N_PAD], -1, tl.int64))

    # 3. the LRU state (rows caching positions >= start are voided); each row looks its position up among the
    #    sorted selections (lower bound: the first of its duplicates) and, if an LRU entry is there, claims it
    hs = tl.load(hot_slot_ptr + b)
    in_r = r < R
    st_off = state_off + hs * s_state + r
    rp = tl.load(rowpos_ptr + st_off, mask=in_r, other=-1)
    stp = tl.load(stamp_ptr + st_off, mask=in_r, other=-1)
    void = rp >= start
    rp = tl.where(void, -1, rp)
    stp = tl.where(void, -1, stp)
    tl.debug_barrier()
    cached = in_r & (rp >= 0)
    target = tl.where(cached, rp, -1)
    lo = tl.zeros([R_PAD], dtype=tl.int64)
    for j in tl.static_range(LOG_N):
        step = N_PAD >> (j + 1)
        probe = tl.load(s_sorted + lo + step - 1, mask=cached, other=BIG)
        lo = tl.where(cached & (probe < target), lo + step, lo)
    cand = tl.load(s_sorted + lo, mask=cached, other=-1)
    is_hit = cached & (cand == target) & (tl.load(s_lru + lo, mask=cached, other=0) != 0)
    tl.store(s_hit + lo, r, mask=is_hit)  # rows hold distinct positions: one row per entry
    tl.debug_barrier()
    hit_row = tl.load(s_hit + e)
    found = lru & (hit_row >= 0)
    miss = lru & (hit_row < 0)

    # 4. victims: the n least recently used rows that no entry hits (empty and voided rows first, ties by row),
    #    found by a search for the n-th smallest stamp instead of a sort; the i-th miss takes the i-th in row order
    num_miss = tl.sum(miss.to(tl.int64), 0)
    free = in_r & ~is_hit
    key = tl.where(free, stp + 1, BIG)  # 0: empty or voided
    lo_k = tl.min(key, 0)
    hi_k = tl.max(tl.where(free, key, 0), 0)
    hi_k = tl.maximum(hi_k, lo_k)
    while lo_k < hi_k:  # the least stamp with at least num_miss free rows at or below it
        mid = (lo_k + hi_k) >> 1
        enough = tl.sum((key <= mid).to(tl.int64), 0) >= num_miss
        hi_k = tl.where(enough, mid, hi_k)
        lo_k = tl.where(enough, lo_k, mid + 1)
    below = key < lo_k
    tie = (key == lo_k) & free
    tie_rank = tl.cumsum(tie.to(tl.int64), 0) - 1
    take = below | (tie & (tie_rank < num_miss - tl.sum(below.to(tl.int64), 0)))
    vrank = tl.cumsum(take.to(tl.int64), 0) - 1
    tl.store(s_vict + vrank, r, mask=take)
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int64), 0) - 1
    victim = tl.load(s_vict + rank, mask=miss, other=0)
    row = tl.where(found, hit_row, tl.where(miss, victim, -1))

    # 5. record, then the rows of duplicates and of the newest positions
    touched = found | miss
    tl.store(rowpos_ptr + st_off, rp, mask=in_r)
    tl.store(stamp_ptr + st_off, stp, mask=in_r)
    tl.store(s_first + e, row)
    tl.debug_barrier()
    clock = tl.load(clock_ptr)
    tl.store(rowpos_ptr + state_off + hs * s_state + row, spos, mask=touched)
    tl.store(stamp_ptr + state_off + hs * s_state + row, tl.full([N_PAD], 1, tl.int64) * clock, mask=touched)
    first_idx = tl.associative_scan(tl.where(first, e, 0), 0, _max)
    row = tl.load(s_first + first_idx)
    row = tl.where(newest, R + spos - start, row)
    row = tl.where(hot, row, -1)

    # 6. outputs: virtual selections, compact misses, counters
    hot_base = tl.load(hot_base_ptr + b)
    vpos = tl.where(on_dev, spos, tl.where(row >= 0, hot_base + row, -1))
    prow = tl.load(dst_row_ptr + b * M + order // K, mask=order < M * K, other=-1)
    tl.store(sel_ptr + prow * s_sel + order % K, vpos.to(sel_ptr.dtype.element_ty), mask=prow >= 0)
    vr = tl.where(miss, victim, 0)
    blk = tl.load(hblk_ptr + hs * s_hblk + vr // BS, mask=miss, other=0).to(tl.int64)
    hblock = tl.load(host_ptr + b * s_host + tl.where(miss, spos, 0) // BS, mask=miss, other=0).to(tl.int64)
    none = tl.full([N_PAD], -1, tl.int64)
    tl.store(msrc_ptr + b * N_PAD + e, none)
    tl.store(mdst_ptr + b * N_PAD + e, none)
    tl.debug_barrier()
    tl.store(msrc_ptr + b * N_PAD + rank, hblock * BS + spos % BS, mask=miss)
    tl.store(mdst_ptr + b * N_PAD + rank, blk * BS + vr % BS, mask=miss)
    num_hit = tl.sum((first & valid).to(tl.int64), 0) - num_miss
    tl.atomic_add(counters_ptr, num_hit)
    tl.atomic_add(counters_ptr + 1, num_miss)
    tl.atomic_add(counters_ptr + 2, num_miss * bytes_per_miss)
    tl.atomic_add(counters_ptr + 3, num_miss * bytes_per_miss)


_PLAN = CompiledKernel(_plan_kernel)  # launched every decode step: skip the JIT's argument binding
PLAN_WARPS = 8  # warps of the one program per request at small sizes (BENCHMARKS.md, HiSparse plan kernel)


def plan_warps(n_pad: int, r_pad: int) -> int:
    """Warps of the plan's program for N_PAD selections and R_PAD hot rows. Triton's compile time grows with
    the elements each thread holds through the sorts: at 8 warps the service's shapes (top-k 2048 with MTP3:
    N_PAD 8192, R_PAD 4096) took minutes to compile on an H200 host, at 32 about 25 s (docs/hisparse.md)."""
    big = max(n_pad, r_pad)
    return 32 if big >= 4096 else 16 if big >= 2048 else PLAN_WARPS


def plan_hot(topk_pos: torch.Tensor, entry_rows: torch.Tensor, start: torch.Tensor, hot_slot: torch.Tensor,
             table_slot: torch.Tensor, hot_base: torch.Tensor, page_table: torch.Tensor, host_table: torch.Tensor,
             hot_blocks: torch.Tensor, row_pos: torch.Tensor, stamp: torch.Tensor, group: int,
             clock: torch.Tensor | int, dst_row: torch.Tensor, sel: torch.Tensor, counters: torch.Tensor,
             bytes_per_miss: int, block_size: int, num_warps: int | None = None,
             rows_sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One plan for B requests. Updates `row_pos` / `stamp` (the hot buffers' state [G, S, R] int64), writes
    each entry's virtual position into `sel[dst_row[b, m], k]` and adds hits, misses and H2D bytes to
    `counters` [4] int64. Returns the miss copies (host slot, hot-buffer device slot) as two flat int64
    lists, -1 where there is no copy.

    topk_pos [T, K] int32 selections of the batch rows; entry_rows [B, M] int64 batch row of each of a
    request's entries (-1 pad); start, hot_slot, table_slot, hot_base [B] int64; page_table [S', P] int32
    (-1: no device page); host_table [B, W] host block ids; hot_blocks [S, H] int32 device blocks of each hot
    slot; dst_row [B, M] int64 row of `sel` each entry fills (-1: none); sel [P, K] int32; clock: the stamp of
    the rows this plan touches, read on the device from a one-element int64 tensor (a CUDA graph replays it
    with the value it holds then; an int is put into one).

    rows_sorted: every row of topk_pos holds its positions ascending, then -1 (what the indexer kernels emit):
    the entries are merged by binary searches instead of sorted (BENCHMARKS.md, HiSparse plan kernel). Rows in
    any other order need False.

    A request whose entries are all -1, with start >= 2^40 (nothing voided), only reads its hot slot's state
    and writes it back unchanged: the padded static decode path gives its non-hot requests a spare slot so.
    """
    B, M = entry_rows.shape
    K = topk_pos.shape[1]
    R = row_pos.shape[-1]
    n_pad = triton.next_power_of_2(max(M * K, 2))
    r_pad = triton.next_power_of_2(max(R, 2))
    k_pad = triton.next_power_of_2(max(K, 2))
    dev = topk_pos.device
    # one allocation: the two miss lists, then the programs' scratch
    buf = torch.empty(B * (6 * n_pad + r_pad), dtype=torch.int64, device=dev)
    msrc, mdst = buf[: B * n_pad], buf[B * n_pad: 2 * B * n_pad]
    if B == 0:
        return msrc, mdst
    for name, t in (("topk_pos", topk_pos), ("page_table", page_table), ("host_table", host_table),
                    ("hot_blocks", hot_blocks), ("sel", sel)):
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be 2-D with contiguous rows, got {tuple(t.shape)} {t.stride()}")
    if not (row_pos.is_contiguous() and stamp.is_contiguous() and row_pos.shape == stamp.shape):
        raise ValueError("row_pos and stamp must be contiguous [G, S, R] tensors of one shape")
    scratch = buf[2 * B * n_pad:]
    if not isinstance(clock, torch.Tensor):
        clock = torch.full((1,), clock, dtype=torch.int64, device=dev)
    _PLAN((B,), (topk_pos, topk_pos.stride(0), entry_rows.contiguous(), start.contiguous(), hot_slot.contiguous(),
                 table_slot.contiguous(), hot_base.contiguous(), page_table, page_table.stride(0),
                 host_table, host_table.stride(0), hot_blocks, hot_blocks.stride(0),
                 row_pos, stamp, group * row_pos.stride(0), row_pos.stride(1),
                 dst_row.contiguous(), sel, sel.stride(0), msrc, mdst, scratch, counters,
                 bytes_per_miss, clock, R, K, M, block_size),
          dict(N_PAD=n_pad, R_PAD=r_pad, LOG_N=n_pad.bit_length() - 1, ROWS_SORTED=bool(rows_sorted),
               K_PAD=k_pad, LOG_K=k_pad.bit_length() - 1), num_warps or plan_warps(n_pad, r_pad))
    return msrc, mdst


@triton.jit(do_not_specialize=["T"])
def _dev_slots_kernel(pos_ptr, tok_ptr, slot_ptr, hs_ptr, start_ptr, page_ptr, s_page, hblk_ptr, s_hblk, out_ptr,
                      T, BS, LRU, ROWS, HAS_HOT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    pos = tl.load(pos_ptr + t, mask=m, other=0).to(tl.int64)
    req = tl.load(tok_ptr + t, mask=m, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + req, mask=m, other=0)
    page = tl.load(page_ptr + slot * s_page + pos // BS, mask=m, other=-1).to(tl.int64)
    out = tl.where(page >= 0, page * BS + pos % BS, -1)
    if HAS_HOT:
        hs = tl.load(hs_ptr + req, mask=m, other=-1)
        row = tl.minimum(tl.maximum(LRU + pos - tl.load(start_ptr + req, mask=m, other=0), 0), ROWS - 1)
        blk = tl.load(hblk_ptr + tl.maximum(hs, 0) * s_hblk + row // BS, mask=m & (hs >= 0), other=0).to(tl.int64)
        out = tl.where((page < 0) & (hs >= 0), blk * BS + row % BS, out)
    tl.store(out_ptr + t, out, mask=m)


def dev_slots(positions: torch.Tensor, token_req: torch.Tensor, slot_of_req: torch.Tensor,
              hot_slot_of_req: torch.Tensor | None, start_of_req: torch.Tensor | None, page_table: torch.Tensor,
              hot_blocks: torch.Tensor, block_size: int, lru_rows: int, hot_rows: int) -> torch.Tensor:
    """Where each new row of a step is written on the device (one kernel): its page's device copy when
    there is one (page_table[slot, pos // bs]), else the reserved newest row lru_rows + pos - start of its
    request's hot buffer (hot_slot >= 0), else -1 (host only). Per-request tensors are int64; the result
    is int64 [T]."""
    T = positions.shape[0]
    out = torch.empty(T, dtype=torch.int64, device=positions.device)
    if T == 0:
        return out
    has_hot = hot_slot_of_req is not None
    slot_of_req = slot_of_req.contiguous()  # the kernel indexes them densely
    hs = hot_slot_of_req.contiguous() if has_hot else slot_of_req
    st = start_of_req.contiguous() if has_hot else slot_of_req
    block = 128
    _dev_slots_kernel[(triton.cdiv(T, block),)](
        positions, token_req, slot_of_req, hs, st, page_table, page_table.stride(0), hot_blocks,
        hot_blocks.stride(0), out, T, block_size, lru_rows, hot_rows, HAS_HOT=has_hot, BLOCK=block)
    return out


# ---- references (plain torch) ------------------------------------------------------------------------

class Resolved(NamedTuple):
    hot_row: torch.Tensor  # [B, N] hot-buffer row of each entry; -1: invalid or on a device page
    miss_pos: torch.Tensor  # [B, N] position to copy from the host (-1: none), one per distinct miss (sorted)
    miss_row: torch.Tensor  # [B, N] its destination LRU row (-1: none)
    num_hits: torch.Tensor  # [] int64
    num_misses: torch.Tensor  # [] int64
    row_pos: torch.Tensor  # [B, R] the requests' LRU state after the plan
    stamp: torch.Tensor  # [B, R]


def resolve_ref(row_pos: torch.Tensor, stamp: torch.Tensor, pos: torch.Tensor, on_device: torch.Tensor,
                start: torch.Tensor, clock: torch.Tensor | int) -> Resolved:
    """The LRU plan of B requests (steps 1-5 of the kernel) in torch ops, on copies of their state.

    row_pos / stamp [B, R] int64: position cached in each LRU row and the clock when it was last selected
    (-1: empty); pos [B, N] int64 selected positions (-1 none); on_device [B, N] bool; start [B] int64 (first
    position written this step). Works on each request's entries sorted by position, so duplicates sit next
    to each other and the LRU lookup is a searchsorted against the sorted rows."""
    R = row_pos.shape[1]
    sorted_pos, order = torch.where(pos >= 0, pos, torch.full_like(pos, _BIG)).sort(dim=1)
    first = torch.ones_like(sorted_pos, dtype=torch.bool)
    first[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
    valid = sorted_pos != _BIG
    hot = valid & ~on_device.gather(1, order)  # served by the hot buffer (LRU or newest rows)
    newest = hot & (sorted_pos >= start[:, None])
    lru = first & hot & ~newest
    void = row_pos >= start[:, None]  # rows of positions rewritten this step: never reused
    row_pos = torch.where(void, torch.full_like(row_pos, -1), row_pos)
    stamp = torch.where(void, torch.full_like(stamp, -1), stamp)
    rp_sorted, rp_order = row_pos.sort(dim=1)
    idx = torch.searchsorted(rp_sorted, sorted_pos).clamp(max=R - 1)
    found = lru & (rp_sorted.gather(1, idx) == sorted_pos)
    hit_row = rp_order.gather(1, idx)
    miss = lru & ~found
    # victims: the n least recently used rows that no entry hits (empty rows first, ties by row), n = the misses;
    # the i-th miss (by position) takes the i-th of them in row order
    sink = torch.full_like(hit_row[:, :1], R)
    is_hit = torch.zeros((stamp.shape[0], R + 1), dtype=torch.bool, device=stamp.device)
    is_hit.scatter_(1, torch.where(found, hit_row, sink), True)
    age = torch.where(is_hit[:, :R], torch.full_like(stamp, _BIG), stamp)
    rows = torch.arange(R, device=stamp.device).expand_as(stamp)
    lru_rank = torch.empty_like(rows).scatter_(1, age.argsort(dim=1, stable=True), rows)
    taken = lru_rank < miss.sum(dim=1, keepdim=True)
    in_row_order = torch.where(taken, rows, torch.full_like(rows, R)).sort(dim=1).values.clamp(max=R - 1)
    rank = (miss.long().cumsum(dim=1) - 1).clamp(0, R - 1)
    victim_row = in_row_order.gather(1, rank)
    row = torch.where(found, hit_row, torch.where(miss, victim_row, torch.full_like(hit_row, -1)))
    idx = torch.where(found | miss, row, sink)  # hit and victim rows now hold their positions, stamped
    row_pos = torch.cat([row_pos, sink], 1).scatter(1, idx, sorted_pos)[:, :R]
    now = torch.as_tensor(clock, device=idx.device).expand(idx.shape)
    stamp = torch.cat([stamp, sink], 1).scatter(1, idx, now)[:, :R]
    row = row.gather(1, torch.searchsorted(sorted_pos, sorted_pos))  # duplicates: their first's row
    row = torch.where(newest, R + sorted_pos - start[:, None], row)
    row = torch.where(hot, row, torch.full_like(row, -1))
    none = torch.full_like(row, -1)
    num_misses = miss.sum()
    return Resolved(hot_row=torch.empty_like(row).scatter_(1, order, row),
                    miss_pos=torch.where(miss, sorted_pos, none), miss_row=torch.where(miss, victim_row, none),
                    num_hits=(first & valid).sum() - num_misses, num_misses=num_misses, row_pos=row_pos, stamp=stamp)


def plan_hot_ref(topk_pos, entry_rows, start, hot_slot, table_slot, hot_base, page_table, host_table, hot_blocks,
                 row_pos, stamp, group: int, clock: torch.Tensor | int, dst_row, sel, counters, bytes_per_miss: int,
                 block_size: int, rows_sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`plan_hot` in torch ops: the same state update, selections, counters and compact miss lists (it sorts
    whatever the rows' order: `rows_sorted` changes nothing here)."""
    B, M = entry_rows.shape
    K, bs = topk_pos.shape[1], block_size
    s = topk_pos.long()[entry_rows.clamp(min=0)]
    pos = torch.where(entry_rows[..., None] >= 0, s, torch.full_like(s, -1)).reshape(B, M * K)
    page = page_table[table_slot[:, None], pos.clamp(min=0) // bs].long()
    on_dev = (pos >= 0) & (page >= 0)
    r = resolve_ref(row_pos[group, hot_slot], stamp[group, hot_slot], pos, on_dev, start, clock)
    row_pos[group, hot_slot], stamp[group, hot_slot] = r.row_pos, r.stamp
    none = torch.full_like(pos, -1)
    vpos = torch.where(on_dev, pos, torch.where(r.hot_row >= 0, hot_base[:, None] + r.hot_row, none))
    rows = dst_row.reshape(-1)
    keep = rows >= 0
    sel[rows[keep]] = vpos.view(B * M, K)[keep].to(sel.dtype)
    counters += torch.stack([r.num_hits, r.num_misses, r.num_misses * bytes_per_miss, r.num_misses * bytes_per_miss])
    mp, mr = r.miss_pos, r.miss_row  # sorted by position; compact them (misses first, in that order)
    first = (mp < 0).to(torch.int8).argsort(dim=1, stable=True)
    mp, mr = mp.gather(1, first), mr.gather(1, first)
    b_idx = torch.arange(B, device=mp.device)[:, None]
    src = torch.where(mp >= 0, host_table[b_idx, mp.clamp(min=0) // bs].long() * bs + mp % bs, mp)
    dst = torch.where(mr >= 0, hot_blocks[hot_slot[:, None], mr.clamp(min=0) // bs].long() * bs + mr % bs, mr)
    n_pad = triton.next_power_of_2(max(M * K, 2))
    pad = torch.full((B, n_pad - M * K), -1, dtype=torch.int64, device=mp.device)
    return torch.cat([src, pad], 1).view(-1), torch.cat([dst, pad], 1).view(-1)


def dev_slots_ref(positions, token_req, slot_of_req, hot_slot_of_req, start_of_req, page_table, hot_blocks,
                  block_size: int, lru_rows: int, hot_rows: int) -> torch.Tensor:
    """`dev_slots` in torch ops."""
    bs = block_size
    tok, pos = token_req.long(), positions.long()
    page = page_table[slot_of_req[tok], pos // bs].long()
    out = torch.where(page >= 0, page * bs + pos % bs, torch.full_like(pos, -1))
    if hot_slot_of_req is not None:
        hs = hot_slot_of_req[tok]
        row = (lru_rows + pos - start_of_req[tok]).clamp(0, hot_rows - 1)
        hot = hot_blocks[hs.clamp(min=0), row // bs].long() * bs + row % bs
        out = torch.where((page < 0) & (hs >= 0), hot, out)
    return out
