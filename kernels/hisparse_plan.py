"""HiSparse's per-step plan in one kernel: selections -> hits, misses and LRU victims, the hot buffer's state
updated, the virtual selections for the attention kernel and compact miss-copy slot lists written.

It computes exactly what `engine.hisparse.hot_buffer.HotBuffers.resolve` plus the backend's slot arithmetic
compute with about seventy small torch ops (the reference; `tests/unit/test_hisparse_plan_kernel.py`
checks the two agree entry for entry). One program per request:

    1. gather the request's selected positions (its 1 or 1 + drafts rows of the top-k) and sort them
       (key = position * N_PAD + entry, so duplicates sit together and the entry is recovered)
    2. classify: device page -> read in place;  >= start -> the reserved newest row;  else the LRU
    3. void LRU rows caching positions >= start; sort the rows by position; binary-search each LRU entry
    4. victims: rows that no entry hits, ordered by (stamp, row); the i-th miss takes the i-th
    5. record positions and stamps of hit and victim rows; duplicates take their first entry's row
    6. write the virtual selection of every entry (device position, or hot_base + hot row) into the
       pool's selection rows, the misses (host slot -> device slot) compactly, and add the counters

Rows of a sorted vector are exchanged through a per-program scratch area in global memory (a barrier
between the store and the loads of other threads), as Triton has no register shuffles by index.
"""

from __future__ import annotations

import os
import sys

import torch

if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_BIG = 1 << 40  # sorts after every position (positions are int32) and every plan clock


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["bytes_per_miss", "clock"])  # the clock changes every call: no recompiles
def _plan_kernel(topk_ptr, s_topk, entry_ptr, start_ptr, hot_slot_ptr, table_slot_ptr, hot_base_ptr,
                 page_ptr, s_page, host_ptr, s_host, hblk_ptr, s_hblk,
                 rowpos_ptr, stamp_ptr, state_off, s_state,
                 dst_row_ptr, sel_ptr, s_sel, msrc_ptr, mdst_ptr, scratch_ptr, counters_ptr,
                 bytes_per_miss, clock, R, K, M, BS,
                 N_PAD: tl.constexpr, R_PAD: tl.constexpr, LOG_R: tl.constexpr):
    BIG: tl.constexpr = 1 << 40
    b = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, N_PAD).to(tl.int64)
    r = tl.arange(0, R_PAD).to(tl.int64)
    scr = scratch_ptr + b * (2 * N_PAD + 3 * R_PAD)
    s_sorted = scr  # [N_PAD] sorted positions, later the rows of the sorted entries
    s_rows = scr + N_PAD  # [R_PAD] LRU rows sorted by position
    s_flags = scr + N_PAD + R_PAD  # [R_PAD] rows hit by this plan
    s_vict = scr + N_PAD + 2 * R_PAD  # [R_PAD] rows in victim order
    s_first = scr + N_PAD + 3 * R_PAD  # [N_PAD] row of each sorted entry

    # 1. the request's selections, sorted by position (invalid last)
    in_n = e < M * K
    m = e // K
    erow = tl.load(entry_ptr + b * M + m, mask=in_n, other=-1)
    p = tl.load(topk_ptr + erow * s_topk + e % K, mask=in_n & (erow >= 0), other=-1).to(tl.int64)
    skey = tl.sort(tl.where(p >= 0, p, BIG) * N_PAD + e)
    spos = skey // N_PAD
    order = skey % N_PAD
    valid = spos != BIG
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

    # 3. the LRU state (rows caching positions >= start are voided) and the lookup
    hs = tl.load(hot_slot_ptr + b)
    in_r = r < R
    st_off = state_off + hs * s_state + r
    rp = tl.load(rowpos_ptr + st_off, mask=in_r, other=-1)
    stp = tl.load(stamp_ptr + st_off, mask=in_r, other=-1)
    void = rp >= start
    rp = tl.where(void, -1, rp)
    stp = tl.where(void, -1, stp)
    tl.store(s_rows + r, tl.sort(tl.where(in_r, rp + 1, BIG) * R_PAD + r))
    tl.store(s_flags + r, tl.zeros([R_PAD], dtype=tl.int64))
    tl.debug_barrier()
    target = (spos + 1) * R_PAD
    lo = tl.zeros([N_PAD], dtype=tl.int64)
    for j in tl.static_range(LOG_R):
        step = R_PAD >> (j + 1)
        probe = tl.load(s_rows + lo + step - 1, mask=lru, other=BIG * R_PAD)
        lo = tl.where(lru & (probe < target), lo + step, lo)
    cand = tl.load(s_rows + lo, mask=lru, other=-1)
    found = lru & (cand // R_PAD == spos + 1)
    hit_row = cand % R_PAD
    miss = lru & (cand // R_PAD != spos + 1)

    # 4. victims: the least recently used rows that no entry of this plan hits (empty rows first)
    tl.store(s_flags + hit_row, tl.full([N_PAD], 1, tl.int64), mask=found)
    tl.debug_barrier()
    is_hit = tl.load(s_flags + r) != 0
    age = tl.where(is_hit, BIG, stp)
    tl.store(s_vict + r, tl.sort(tl.where(in_r, age + 1, BIG + 2) * R_PAD + r))
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    victim = tl.load(s_vict + rank, mask=miss, other=0) % R_PAD
    row = tl.where(found, hit_row, tl.where(miss, victim, -1))

    # 5. record, then the rows of duplicates and of the newest positions
    touched = found | miss
    tl.store(rowpos_ptr + st_off, rp, mask=in_r)
    tl.store(stamp_ptr + st_off, stp, mask=in_r)
    tl.store(s_first + e, row)
    tl.debug_barrier()
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
    num_miss = tl.sum(miss.to(tl.int64), 0)
    num_hit = tl.sum((first & valid).to(tl.int64), 0) - num_miss
    tl.atomic_add(counters_ptr, num_hit)
    tl.atomic_add(counters_ptr + 1, num_miss)
    tl.atomic_add(counters_ptr + 2, num_miss * bytes_per_miss)
    tl.atomic_add(counters_ptr + 3, num_miss * bytes_per_miss)


def plan_hot(topk_pos: torch.Tensor, entry_rows: torch.Tensor, start: torch.Tensor, hot_slot: torch.Tensor,
             table_slot: torch.Tensor, hot_base: torch.Tensor, page_table: torch.Tensor, host_table: torch.Tensor,
             hot_blocks: torch.Tensor, row_pos: torch.Tensor, stamp: torch.Tensor, group: int, clock: int,
             dst_row: torch.Tensor, sel: torch.Tensor, counters: torch.Tensor, bytes_per_miss: int,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One plan for B requests. Updates `row_pos` / `stamp` (the hot buffers' state [G, S, R] int64), writes
    each entry's virtual position into `sel[dst_row[b, m], k]` and adds hits, misses and H2D bytes to
    `counters` [4] int64. Returns the miss copies (host slot, hot-buffer device slot) as two flat int64
    lists, -1 where there is no copy.

    topk_pos [T, K] int32 selections of the batch rows; entry_rows [B, M] int64 batch row of each of a
    request's entries (-1 pad); start, hot_slot, table_slot, hot_base [B] int64; page_table [S', P] int32
    (-1: no device page); host_table [B, W] host block ids; hot_blocks [S, H] int32 device blocks of each hot
    slot; dst_row [B, M] int64 row of `sel` each entry fills (-1: none); sel [P, K] int32.
    """
    B, M = entry_rows.shape
    K = topk_pos.shape[1]
    R = row_pos.shape[-1]
    n_pad = triton.next_power_of_2(max(M * K, 2))
    r_pad = triton.next_power_of_2(max(R, 2))
    dev = topk_pos.device
    msrc = torch.empty((B, n_pad), dtype=torch.int64, device=dev)
    mdst = torch.empty((B, n_pad), dtype=torch.int64, device=dev)
    if B == 0:
        return msrc.view(-1), mdst.view(-1)
    for name, t in (("topk_pos", topk_pos), ("page_table", page_table), ("host_table", host_table),
                    ("hot_blocks", hot_blocks), ("sel", sel)):
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be 2-D with contiguous rows, got {tuple(t.shape)} {t.stride()}")
    if not (row_pos.is_contiguous() and stamp.is_contiguous() and row_pos.shape == stamp.shape):
        raise ValueError("row_pos and stamp must be contiguous [G, S, R] tensors of one shape")
    scratch = torch.empty((B, 2 * n_pad + 3 * r_pad), dtype=torch.int64, device=dev)
    _plan_kernel[(B,)](
        topk_pos, topk_pos.stride(0), entry_rows.contiguous(), start.contiguous(), hot_slot.contiguous(),
        table_slot.contiguous(), hot_base.contiguous(), page_table, page_table.stride(0),
        host_table, host_table.stride(0), hot_blocks, hot_blocks.stride(0),
        row_pos, stamp, group * row_pos.stride(0), row_pos.stride(1),
        dst_row.contiguous(), sel, sel.stride(0), msrc, mdst, scratch, counters,
        bytes_per_miss, clock, R, K, M, block_size,
        N_PAD=n_pad, R_PAD=r_pad, LOG_R=r_pad.bit_length() - 1, num_warps=8)
    return msrc.view(-1), mdst.view(-1)


@triton.jit
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
    hs = hot_slot_of_req if has_hot else slot_of_req
    st = start_of_req if has_hot else slot_of_req
    block = 128
    _dev_slots_kernel[(triton.cdiv(T, block),)](
        positions, token_req, slot_of_req, hs, st, page_table, page_table.stride(0), hot_blocks,
        hot_blocks.stride(0), out, T, block_size, lru_rows, hot_rows, HAS_HOT=has_hot, BLOCK=block)
    return out
