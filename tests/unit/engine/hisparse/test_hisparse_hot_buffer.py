"""The hot-buffer plan on its own: every entry ends up reading the row of its position, hits are reuse,
capacity holds the verify rows' union, rewritten positions are never served stale."""

from __future__ import annotations

import random

import torch

from engine.hisparse.hot_buffer import HotBuffers
from engine.hisparse.layout import HotLayout


class Sim:
    """Runs plans and applies them like the runner: misses copied in, newest rows written."""

    def __init__(self, topk=4, buffer=8, spec=0, slots=2, groups=1):
        self.layout = HotLayout.create(topk, buffer, spec, block_size=4)
        self.hot = HotBuffers(self.layout, groups, slots, torch.device("cpu"))
        self.content = torch.full((groups, slots, self.layout.rows), -1, dtype=torch.long)  # position held

    def step(self, sels: list[list[list[int]]], starts: list[int], on_dev=None, group=0, slots=None):
        K = self.layout.topk
        M = self.layout.max_new_rows
        B = len(sels)
        pos = torch.full((B, M * K), -1, dtype=torch.long)
        for b, rows in enumerate(sels):
            flat = [p for row in rows for p in row]
            pos[b, : len(flat)] = torch.tensor(flat)
        dev = torch.zeros_like(pos, dtype=torch.bool) if on_dev is None else on_dev(pos)
        slot_t = torch.tensor(slots or list(range(B)))
        plan = self.hot.resolve(group, pos, dev, torch.tensor(starts), slot_t)
        R = self.layout.lru_rows
        for b in range(B):
            s = int(slot_t[b])
            for p, r in zip(plan.miss_pos[b].tolist(), plan.miss_row[b].tolist()):
                if p >= 0:
                    self.content[group, s, r] = p
            for i, _row in enumerate(sels[b]):  # this step writes positions start .. start + rows - 1
                self.content[group, s, R + i] = starts[b] + i
            for p, r, d in zip(pos[b].tolist(), plan.hot_row[b].tolist(), dev[b].tolist()):
                if p < 0 or d:
                    assert r == -1
                else:
                    assert r >= 0 and int(self.content[group, s, r]) == p, f"position {p} reads row {r}"
        return plan


def test_repeats_hit_and_new_positions_miss():
    sim = Sim(topk=4, buffer=8)
    p1 = sim.step([[[0, 5, 9, 2]]], starts=[20])
    assert (int(p1.num_hits), int(p1.num_misses)) == (0, 4)
    p2 = sim.step([[[5, 0, 2, 9]]], starts=[21])
    assert (int(p2.num_hits), int(p2.num_misses)) == (4, 0), "the same selection is all hits"
    p3 = sim.step([[[40, 5, 30, 31]]], starts=[40])
    assert int(p3.num_hits) == 2 and int(p3.num_misses) == 2, "the newest row (40) is served from its own slot"
    assert int(p3.hot_row[0, 0]) == sim.layout.lru_rows


def test_lru_evicts_least_recently_used():
    sim = Sim(topk=4, buffer=8)
    sim.step([[[0, 1, 2, 3]]], starts=[100])
    sim.step([[[4, 5, 6, 7]]], starts=[100])
    sim.step([[[0, 1, 2, 3]]], starts=[100])  # refresh 0..3: 4..7 are now the oldest
    p = sim.step([[[8, 9, 10, 11]]], starts=[100])
    assert int(p.num_misses) == 4
    back = sim.step([[[0, 1, 2, 3]]], starts=[100])
    assert int(back.num_misses) == 0, "recently used rows survive the eviction"
    old = sim.step([[[4, 5, 6, 7]]], starts=[100])
    assert int(old.num_misses) == 4


def test_verify_rows_union_fits_and_duplicates_share_a_row():
    sim = Sim(topk=4, buffer=4, spec=3)
    assert sim.layout.lru_rows == 16
    rows = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # 16 distinct: the whole LRU
    p = sim.step([rows], starts=[40])
    assert int(p.num_misses) == 16
    p = sim.step([[[0, 1, 2, 3], [0, 1, 2, 41], [40, 41, 16, 0], [17, 18, 19, 1]]], starts=[40])
    assert int(p.num_hits) == 4 + 2 and int(p.num_misses) == 4


def test_rewritten_positions_are_not_served_stale():
    sim = Sim(topk=2, buffer=4)
    sim.step([[[7, 8]]], starts=[10])  # 7 and 8 cached
    sim.content[0, 0][sim.content[0, 0] == 8] = -99  # pretend position 8's cached copy is now stale
    p = sim.step([[[8, 3]]], starts=[8])  # position 8 is rewritten in this step: its reserved row, not the LRU
    assert int(p.num_misses) == 1 and int(p.hot_row[0, 0]) == sim.layout.lru_rows


def test_device_pages_bypass_the_lru_and_requests_are_independent():
    sim = Sim(topk=4, buffer=8, slots=3)
    on_dev = lambda pos: (pos >= 0) & (pos < 16)  # pages 0..3 resident
    p = sim.step([[[1, 20, 21, 2]], [[22, 23, 24, 25]]], starts=[50, 50], on_dev=on_dev, slots=[2, 0])
    assert (int(p.num_hits), int(p.num_misses)) == (2, 6)
    p = sim.step([[[20, 21, 3, 4]], [[20, 21, 22, 23]]], starts=[50, 50], on_dev=on_dev, slots=[2, 0])
    assert (int(p.num_hits), int(p.num_misses)) == (4 + 2, 2), "slot 0 never held 20 and 21: misses there"


def test_random_streams_read_their_positions():
    rng = random.Random(0)
    sim = Sim(topk=6, buffer=12, spec=2, slots=3, groups=2)
    for step in range(60):
        sels, starts = [], []
        for _b in range(3):
            start = 40 + step
            rows = [rng.sample(range(start + i + 1), 6) for i in range(rng.randint(1, 3))]
            sels.append(rows)
            starts.append(start)
        plan = sim.step(sels, starts, group=step % 2, slots=[2, 0, 1])
        distinct = sum(len({p for row in rows for p in row}) for rows in sels)
        assert int(plan.num_hits) + int(plan.num_misses) == distinct
