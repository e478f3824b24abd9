"""The fused plan kernel (kernels.hisparse_plan) and its torch reference against the torch plan
(HotBuffers.resolve plus slot arithmetic written out here), entry for entry, over random multi-step streams:
same hot-buffer state, same virtual selections, same miss copies in the same order, same counters. On CPU the
kernel runs in Triton's interpreter; on a GPU it is compiled and runs on device tensors."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.hisparse.hot_buffer import HotBuffers
from engine.hisparse.layout import HotLayout
from kernels.hisparse_plan import plan_hot, plan_hot_ref

BS = 4
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(hot: HotBuffers, group, topk, entry_rows, start, hot_slot, table_slot, hot_base, page_table,
              host_table, dst_row, sel):
    """What engine.hisparse.backend computes with torch ops (virtual layout)."""
    B, M = entry_rows.shape
    K = topk.shape[1]
    s = topk.long()[entry_rows.clamp(min=0)]
    pos = torch.where(entry_rows[..., None] >= 0, s, torch.full_like(s, -1)).reshape(B, M * K)
    page = page_table[table_slot[:, None], pos.clamp(min=0) // BS].long()
    on_dev = (pos >= 0) & (page >= 0)
    p = hot.resolve(group, pos, on_dev, start, hot_slot)
    none = torch.full_like(pos, -1)
    vpos = torch.where(on_dev, pos, torch.where(p.hot_row >= 0, hot_base[:, None] + p.hot_row, none))
    out = sel.clone()
    for b in range(B):
        for m in range(M):
            if dst_row[b, m] >= 0:
                out[dst_row[b, m]] = vpos[b, m * K:(m + 1) * K].to(out.dtype)
    mp, mr = p.miss_pos, p.miss_row
    src = torch.where(mp >= 0, host_table[torch.arange(B)[:, None], mp.clamp(min=0) // BS] * BS + mp % BS, mp)
    dst = torch.where(mr >= 0, hot.blocks[hot_slot[:, None], mr.clamp(min=0) // BS].long() * BS + mr % BS, mr)
    pairs = [[(int(a), int(c)) for a, c in zip(src[b], dst[b]) if a >= 0] for b in range(B)]
    return out, pairs, int(p.num_hits), int(p.num_misses)


@pytest.mark.parametrize("spec,buffer,rows_sorted,K", [(0, 12, False, 6), (2, 12, False, 6), (0, 16, False, 6),
                                                       (0, 12, True, 6), (2, 12, True, 6), (3, 16, True, 8)])
def test_fused_plan_equals_the_torch_plan(spec, buffer, rows_sorted, K):
    """rows_sorted: each row ascending then -1, as the indexer kernels emit them (the kernel merges the rows
    instead of sorting its entries; K a power of two, as top-k 2048, and not); otherwise any order, duplicates
    in a row included."""
    rng = random.Random(spec * 100 + buffer + rows_sorted)
    groups, slots = 2, 4
    layout = HotLayout.create(K, buffer, spec, block_size=BS)
    M, R = layout.max_new_rows, layout.lru_rows
    ref = HotBuffers(layout, groups, slots, torch.device("cpu"))
    fused = HotBuffers(layout, groups, slots, DEV)
    torch_plan = HotBuffers(layout, groups, slots, torch.device("cpu"))  # plan_hot_ref's state
    for hb in (ref, fused, torch_plan):
        for s in range(slots):
            hb.assign(s, [100 + s * layout.num_blocks + i for i in range(layout.num_blocks)])
    W = 40
    page_table = torch.full((6, W), -1, dtype=torch.int32)
    page_table[1, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)  # request in table row 1: pages 0-2 on device
    counters = torch.zeros(4, dtype=torch.int64)
    for step in range(24):
        B = rng.randint(1, 3)
        hs = rng.sample(range(slots), B)
        n_rows = [rng.randint(1, M) for _ in range(B)]
        T = sum(n_rows) + 1  # one extra batch row (a resident request) that no entry uses
        starts = [rng.randint(30, 60) for _ in range(B)]
        topk = torch.full((T, K), -1, dtype=torch.int32)
        entry_rows = torch.full((B, M), -1, dtype=torch.long)
        dst_row = torch.full((B, M), -1, dtype=torch.long)
        at = 1
        for b in range(B):
            for i in range(n_rows[b]):
                cand = list(range(starts[b] + i + 1)) + [starts[b]] * 3  # duplicates of the newest row too
                chosen = [rng.choice(cand) for _ in range(K - rng.randint(0, 2))]
                if rows_sorted:  # distinct positions, ascending (a row of the top-k)
                    chosen = sorted(rng.sample(sorted(set(cand)), min(len(set(cand)), K - rng.randint(0, 2))))
                topk[at, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                entry_rows[b, i] = at
                dst_row[b, i] = at
                at += 1
        start = torch.tensor(starts)
        hot_slot = torch.tensor(hs)
        table_slot = torch.tensor([rng.choice([0, 1, 2]) for _ in range(B)])
        hot_base = torch.tensor([1000 * (b + 1) for b in range(B)])
        host_table = torch.randint(0, 500, (B, W))
        sel = torch.randint(-1, 50, (T, K), dtype=torch.int32)
        group = step % groups
        want_sel, want_pairs, hits, misses = reference(ref, group, topk, entry_rows, start, hot_slot, table_slot,
                                                       hot_base, page_table, host_table, dst_row, sel)
        fused.clock += 1
        got_sel = sel.clone()
        before = counters.clone()
        d = [t.to(DEV) for t in (topk, entry_rows, start, hot_slot, table_slot, hot_base, page_table, host_table,
                                 dst_row, got_sel, counters)]
        src, dst = plan_hot(*d[:8], fused.blocks, fused.row_pos, fused.stamp, group, fused.clock, d[8], d[9],
                            d[10], bytes_per_miss=10, block_size=BS, rows_sorted=rows_sorted)
        got_sel, counters, src, dst = d[9].cpu(), d[10].cpu(), src.cpu(), dst.cpu()
        assert torch.equal(got_sel, want_sel), f"step {step}: virtual selections differ"
        n_pad = src.numel() // B
        got_pairs = [[(int(a), int(c)) for a, c in zip(src[b * n_pad:(b + 1) * n_pad], dst[b * n_pad:(b + 1) * n_pad])
                      if a >= 0] for b in range(B)]
        assert got_pairs == want_pairs, f"step {step}: miss copies differ"
        for b in range(B):  # compact: the misses first, then -1
            n = len(got_pairs[b])
            assert bool((src[b * n_pad + n:(b + 1) * n_pad] == -1).all())
        assert (counters - before).tolist() == [hits, misses, 10 * misses, 10 * misses]
        torch_plan.clock += 1
        ref_sel, ref_counters = sel.clone(), torch.zeros(4, dtype=torch.int64)
        rsrc, rdst = plan_hot_ref(topk, entry_rows, start, hot_slot, table_slot, hot_base, page_table, host_table,
                                  torch_plan.blocks, torch_plan.row_pos, torch_plan.stamp, group, torch_plan.clock,
                                  dst_row, ref_sel, ref_counters, bytes_per_miss=10, block_size=BS)
        assert torch.equal(ref_sel, got_sel) and torch.equal(rsrc, src) and torch.equal(rdst, dst)
        assert ref_counters.tolist() == [hits, misses, 10 * misses, 10 * misses]
        assert torch.equal(torch_plan.row_pos, ref.row_pos) and torch.equal(torch_plan.stamp, ref.stamp)
        assert torch.equal(fused.row_pos.cpu(), ref.row_pos), f"step {step}"
        assert torch.equal(fused.stamp.cpu(), ref.stamp), f"step {step}"
    assert int(counters[1]) > 0 and int(counters[0]) > 0
    assert R == layout.lru_rows


@pytest.mark.parametrize("with_hot", [False, True])
def test_dev_slots_kernel_equals_torch(with_hot):
    """Where new rows are written: device page, reserved hot row, or host only (-1)."""
    from engine.hisparse.forward import HOT, RESIDENT, BatchRouting, _dev_slots
    from engine.hisparse.residency import ReqPages
    from kernels.hisparse_plan import dev_slots

    class Mgr:
        ints = staticmethod(lambda v, d, t=torch.int64: torch.tensor(list(v), dtype=t, device=d))
        fused_plan = False

    g = torch.Generator().manual_seed(int(with_hot))
    mgr = Mgr()
    mgr.layout = HotLayout.create(8, 16, 2, block_size=BS)
    mgr.page_table = torch.randint(-1, 30, (5, 12), generator=g, dtype=torch.int32)
    mgr.page_table[3] = -1  # request 0 has no device page: its rows go to its hot buffer
    mgr.page_table[4, 10] = -1  # request 2: row 40 too; 44 is on a device page
    mgr.page_table[4, 11] = 7
    mgr.hot = HotBuffers(mgr.layout, 1, 3, torch.device("cpu"))
    mgr.hot.blocks = torch.randint(40, 90, mgr.hot.blocks.shape, generator=g, dtype=torch.int32)
    reqs = [ReqPages(slot=s, hot_slot=h) for s, h in ((3, 1), (0, -1), (4, 2))]
    paths = [HOT, RESIDENT, HOT] if with_hot else [RESIDENT] * 3
    tok = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([30, 31, 32, 5, 40, 44])
    starts = torch.tensor([30, 5, 40])
    meta = type("M", (), dict(positions=pos, token_req_idx=tok, block_size=BS))()
    hs = torch.tensor([r.hot_slot if p == HOT else -1 for r, p in zip(reqs, paths)]) if with_hot else None
    rt = BatchRouting(key=(), reqs=reqs, paths=paths, hot=[b for b, p in enumerate(paths) if p == HOT], pool=[],
                 hot_batch=None, table=None, slot_of_req=torch.tensor([r.slot for r in reqs]), hot_slot_of_req=hs,
                 q_lens=None, pool_lens=None)
    want = _dev_slots(mgr, meta, rt, starts if with_hot else None)
    got = dev_slots(pos.to(DEV), tok.to(DEV), torch.tensor([r.slot for r in reqs], device=DEV),
                    None if hs is None else hs.to(DEV), starts.to(DEV) if with_hot else None, mgr.page_table.to(DEV),
                    mgr.hot.blocks.to(DEV), BS, mgr.layout.lru_rows, mgr.layout.rows)
    assert torch.equal(got.cpu(), want)
    assert with_hot == bool((want >= 40 * BS).any()), "hot rows are used exactly when requests are hot"
    assert int(want[5]) == 7 * BS + 44 % BS, "a device page wins over the hot row"


def test_fixed_dev_slots_repeat_while_every_request_writes_its_reserved_rows():
    """Every request HOT with no device page: row i of a request goes to its reserved hot row lru_rows + i
    whatever the position, so a routing keeps its first step's device slots (`BatchRouting.fixed_slots`); they equal
    a fresh computation at the later steps' positions, with MTP rows (three per request) too."""
    from engine.hisparse.forward import HOT, BatchRouting, _dev_slots
    from engine.hisparse.residency import ReqPages

    class Mgr:
        fused_plan = False

    mgr = Mgr()
    mgr.layout = HotLayout.create(8, 16, 2, block_size=BS)
    mgr.page_table = torch.full((4, 30), -1, dtype=torch.int32)
    mgr.hot = HotBuffers(mgr.layout, 1, 2, torch.device("cpu"))
    mgr.hot.blocks = torch.arange(40, 40 + mgr.hot.blocks.numel(), dtype=torch.int32).view(mgr.hot.blocks.shape)
    reqs = [ReqPages(slot=2, hot_slot=1), ReqPages(slot=0, hot_slot=0)]
    tok = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    rt = BatchRouting(key=(), reqs=reqs, paths=[HOT, HOT], hot=[0, 1], pool=[], hot_batch=None, table=None,
                 slot_of_req=torch.tensor([2, 0]), hot_slot_of_req=torch.tensor([1, 0]), q_lens=None, pool_lens=None,
                 fixed_slots=True)
    fresh = dataclasses.replace(rt, fixed_slots=False)
    first = None
    for start in ([30, 50], [31, 53], [45, 60]):  # later steps of the same routing (pages differ, slots do not)
        pos = torch.tensor([start[0] + i for i in range(3)] + [start[1] + i for i in range(3)])
        meta = type("M", (), dict(positions=pos, token_req_idx=tok, block_size=BS))()
        got = _dev_slots(mgr, meta, rt, torch.tensor(start))
        first = got if first is None else first
        assert got is first, "the routing's first slots are reused"
        assert torch.equal(got, _dev_slots(mgr, meta, fresh, torch.tensor(start)))
    lru = mgr.layout.lru_rows
    assert int(first[0]) == int(mgr.hot.blocks[1, lru // BS]) * BS + lru % BS


def test_dev_slots_kernel_reads_strided_per_request_tensors():
    """The padded static path hands each request's start over as a strided view (the position of its first
    row): the launcher makes the per-request tensors dense, so the kernel gives the torch ops' slots."""
    from kernels.hisparse_plan import dev_slots, dev_slots_ref

    layout = HotLayout.create(8, 16, 2, block_size=BS)
    hot = HotBuffers(layout, 1, 3, torch.device("cpu"))
    hot.blocks = torch.arange(40, 40 + hot.blocks.numel(), dtype=torch.int32).view(hot.blocks.shape)
    page_table = torch.full((4, 30), -1, dtype=torch.int32)
    page_table[2, 10] = 5  # request 2's rows at 40.. are on a device page
    R = 3
    pos = torch.tensor([21, 22, 22, 30, 31, 32, 40, 41, 42])  # request 0: one padding row (repeats its last)
    tok = torch.arange(3, dtype=torch.int32).repeat_interleave(R)
    slot, hs = torch.tensor([0, 1, 2]), torch.tensor([1, 0, -1])
    start = pos.view(3, R)[:, 0]
    assert not start.is_contiguous()
    want = dev_slots_ref(pos, tok, slot, hs, start, page_table, hot.blocks, BS, layout.lru_rows, layout.rows)
    got = dev_slots(*(t.to(DEV) for t in (pos, tok, slot, hs)), start.to(DEV) if DEV.type == "cpu" else
                    pos.to(DEV).view(3, R)[:, 0], page_table.to(DEV), hot.blocks.to(DEV), BS, layout.lru_rows,
                    layout.rows)
    assert torch.equal(got.cpu(), want)
    lru = layout.lru_rows
    assert int(want[3]) == int(hot.blocks[0, lru // BS]) * BS + lru % BS, "request 1's first row: reserved row 0"


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
def test_plan_of_a_padded_batch_leaves_requests_without_entries_untouched(fused):
    """A padded static batch plans every request. Those without a hot buffer (resident and padding requests) have
    no entry, a start past every position and the spare hot slot, several of them at once: they change no slot's
    state, no selection and no counter and copy nothing, and the HOT request beside them plans as it would alone."""
    rng = random.Random(7)
    K, spec = 6, 2
    layout = HotLayout.create(K, 12, spec, block_size=BS)
    M = layout.max_new_rows
    dev = DEV if fused else torch.device("cpu")
    plan = plan_hot if fused else plan_hot_ref
    hot = HotBuffers(layout, 1, 3, dev)
    for s in range(3):
        hot.assign(s, [100 + s * layout.num_blocks + i for i in range(layout.num_blocks)])
    spare = hot.spare
    W, B = 40, 4
    page_table = torch.full((5, W), -1, dtype=torch.int32)
    host_table = torch.randint(0, 500, (B, W))
    rows = torch.arange(B)[:, None] * M + torch.arange(M)[None, :]
    entry = torch.where(torch.arange(B)[:, None] == 0, rows, torch.full_like(rows, -1))  # request 0 is HOT
    start = torch.tensor([61, 1 << 40, 1 << 40, 1 << 40])
    hot_slot = torch.tensor([1, spare, spare, spare])
    table_slot = torch.tensor([0, 1, 4, 4])
    hot_base = torch.tensor([1000, 0, 0, 0])

    def run(hb, n, topk):  # plan the first n requests -> (selections, miss pairs, counters)
        sel, counters = topk.clone(), torch.zeros(4, dtype=torch.int64)
        hb.clock += 1
        d = [t.to(dev) for t in (topk, entry[:n], start[:n], hot_slot[:n], table_slot[:n], hot_base[:n], page_table,
                                 host_table[:n], entry[:n], sel, counters)]
        src, dst = plan(*d[:8], hb.blocks, hb.row_pos, hb.stamp, 0, hb.clock, d[8], d[9], d[10], bytes_per_miss=1,
                        block_size=BS)
        pairs = sorted((int(a), int(b)) for a, b in zip(src.cpu(), dst.cpu()) if a >= 0)
        return d[9].cpu(), pairs, d[10].cpu()

    alone = HotBuffers(layout, 1, 3, dev)
    alone.blocks.copy_(hot.blocks)
    misses = 0
    for _ in range(3):  # a few steps, so that the LRU state holds hits and stamps
        topk = torch.tensor([[rng.randint(0, 60) for _ in range(K)] for _ in range(B * M)], dtype=torch.int32)
        got, want = run(hot, B, topk), run(alone, 1, topk)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])
        assert torch.equal(hot.row_pos.cpu(), alone.row_pos.cpu()) and torch.equal(hot.stamp.cpu(), alone.stamp.cpu())
        assert torch.equal(got[0][M:], topk[M:]), "the selections of requests without entries are left as they were"
        start[0] += 1
        misses += len(got[1])
    assert bool((hot.row_pos[:, spare] == -1).all()) and bool((hot.stamp[:, spare] == -1).all())
    assert misses > 0 and int(got[2][0]) > 0


@pytest.mark.parametrize("spread", [1, 1 << 35])
def test_victims_are_the_least_recently_used_rows_whatever_the_stamps(spread):
    """The kernel finds its victims by a binary search over stamps, not a sort: over LRU states with stamps far
    apart (up to 2^35 between rows), many equal, empty and voided rows, it evicts the same rows as the reference's
    sort by (stamp, row) and pairs them with the misses the same way."""
    rng = random.Random(spread % 1000)
    K, spec = 8, 1
    layout = HotLayout.create(K, 24, spec, block_size=BS)
    M, R = layout.max_new_rows, layout.lru_rows
    W, B = 64, 3
    fused, torch_plan = (HotBuffers(layout, 1, B, d) for d in (DEV, torch.device("cpu")))
    start = torch.tensor([200, 180, 190])
    for b in range(B):
        pos = rng.sample(range(230), R)
        stamps = [rng.choice([-1, 7, 7, 7] + [rng.randint(0, 5) * spread for _ in range(4)]) for _ in range(R)]
        row_pos = torch.tensor([p if s >= 0 else -1 for p, s in zip(pos, stamps)])  # some past start: voided
        for hb in (fused, torch_plan):
            hb.assign(b, [300 + b * layout.num_blocks + i for i in range(layout.num_blocks)])
            hb.row_pos[0, b], hb.stamp[0, b] = row_pos, torch.tensor(stamps)
            hb.clock.fill_(6 * spread)
    topk = torch.tensor([[rng.randint(0, 199) for _ in range(K)] for _ in range(B * M)], dtype=torch.int32)
    entry = torch.arange(B * M).view(B, M)
    page_table = torch.full((B, W), -1, dtype=torch.int32)
    host_table = torch.randint(0, 500, (B, W))
    args = (start, torch.arange(B), torch.arange(B), torch.tensor([1000, 2000, 3000]), page_table, host_table)
    outs = []
    for hb, plan, dev in ((fused, plan_hot, DEV), (torch_plan, plan_hot_ref, torch.device("cpu"))):
        sel, counters = torch.full((B * M, K), -1, dtype=torch.int32, device=dev), torch.zeros(4, dtype=torch.int64,
                                                                                                  device=dev)
        src, dst = plan(topk.to(dev), entry.to(dev), *(a.to(dev) for a in args), hb.blocks, hb.row_pos, hb.stamp, 0,
                        hb.clock, entry.to(dev), sel, counters, bytes_per_miss=1, block_size=BS)
        outs.append([t.cpu() for t in (sel, counters, src, dst, hb.row_pos, hb.stamp)])
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert int(outs[1][1][1]) > B * K, "many misses: most of the victims come from the older stamps"
