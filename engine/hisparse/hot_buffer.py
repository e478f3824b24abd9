"""Hot buffers: per request and layer group, which past positions sit in which LRU row, and the plan that
turns one step's selections into hits, misses and victims. Device tensors only; nothing waits for the host.

State per (group, hot slot), `lru_rows` wide:  row_pos (position cached in the row, -1 empty) and stamp
(the plan clock when the row was last selected, -1 empty). A plan for the requests of one forward:

    entries   every selected position of the request's rows (1, or 1 + drafts rows: their union at once)
    classify  on a device page -> read in place;  >= start (written this step) -> its reserved newest row;
              otherwise the LRU: found -> hit;  not found -> miss, copied host -> the least recently used
              row that no entry of this plan hits (empty rows first; ties by row index)
    count     hits + misses = distinct selected positions (device pages and newest rows count as hits)

Rows caching positions >= start are voided first: those positions are being (re)written now (MTP drafts
that were rejected get new KV at the same positions), so an older copy must not be reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.hisparse.forward import to_dev
from engine.hisparse.layout import HotLayout

_BIG = 1 << 62  # sorts after every position


@dataclass
class HotPlan:
    hot_row: torch.Tensor  # [B, N] hot-buffer row of each entry; -1: invalid or on a device page
    miss_pos: torch.Tensor  # [B, N] position to copy from the host (-1: none), one per distinct miss
    miss_row: torch.Tensor  # [B, N] its destination LRU row (-1: none)
    num_hits: torch.Tensor  # [] int64
    num_misses: torch.Tensor  # [] int64


class HotBuffers:
    def __init__(self, layout: HotLayout, num_groups: int, max_hot: int, device: torch.device):
        self.layout = layout
        shape = (num_groups, max(max_hot, 1), layout.lru_rows)
        self.row_pos = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.stamp = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.blocks = torch.zeros((max(max_hot, 1), layout.num_blocks), dtype=torch.int32, device=device)
        self.clock = 0

    def assign(self, hot_slot: int, blocks: list[int]) -> None:
        """A request takes hot slot `hot_slot` with these device blocks: its LRU starts empty."""
        self.blocks[hot_slot] = to_dev(blocks, self.blocks.device, torch.int32)
        self.row_pos[:, hot_slot].fill_(-1)
        self.stamp[:, hot_slot].fill_(-1)

    def resolve(self, group: int, pos: torch.Tensor, on_device: torch.Tensor, start: torch.Tensor,
                hot_slot: torch.Tensor) -> HotPlan:
        """pos [B, N] int64 selected positions (-1 none), on_device [B, N] bool, start [B] int64 (first
        position written this step), hot_slot [B] int64 -> the plan; updates the LRU state.

        Works on each request's entries sorted by position, so duplicates sit next to each other and the
        LRU lookup is a searchsorted against the sorted rows."""
        self.clock += 1
        sorted_pos, order = torch.where(pos >= 0, pos, torch.full_like(pos, _BIG)).sort(dim=1)
        first = torch.ones_like(sorted_pos, dtype=torch.bool)
        first[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
        valid = sorted_pos != _BIG
        hot = valid & ~on_device.gather(1, order)  # served by the hot buffer (LRU or newest rows)
        newest = hot & (sorted_pos >= start[:, None])
        lru = first & hot & ~newest

        row_pos, stamp = self._state(group, hot_slot, start)
        found, hit_row = self._lookup(row_pos, sorted_pos, lru)
        miss = lru & ~found
        victim_row = self._victims(stamp, found, hit_row, miss)
        row = torch.where(found, hit_row, torch.where(miss, victim_row, torch.full_like(hit_row, -1)))
        self._record(group, hot_slot, row_pos, stamp, row, found | miss, sorted_pos)

        row = row.gather(1, torch.searchsorted(sorted_pos, sorted_pos))  # duplicates: their first's row
        row = torch.where(newest, self.layout.lru_rows + sorted_pos - start[:, None], row)
        row = torch.where(hot, row, torch.full_like(row, -1))
        none = torch.full_like(row, -1)
        num_misses = miss.sum()
        return HotPlan(hot_row=torch.empty_like(row).scatter_(1, order, row),
                       miss_pos=torch.where(miss, sorted_pos, none), miss_row=torch.where(miss, victim_row, none),
                       num_hits=(first & valid).sum() - num_misses, num_misses=num_misses)

    def _state(self, group: int, hot_slot: torch.Tensor, start: torch.Tensor):
        """Copies of the requests' rows; rows of positions >= start are voided (rewritten this step)."""
        row_pos = self.row_pos[group, hot_slot]
        stamp = self.stamp[group, hot_slot]
        void = row_pos >= start[:, None]
        return (torch.where(void, torch.full_like(row_pos, -1), row_pos),
                torch.where(void, torch.full_like(stamp, -1), stamp))

    def _lookup(self, row_pos: torch.Tensor, sorted_pos: torch.Tensor, lru: torch.Tensor):
        """(found [B, N], row [B, N]) of each LRU entry."""
        rp_sorted, rp_order = row_pos.sort(dim=1)
        idx = torch.searchsorted(rp_sorted, sorted_pos).clamp(max=self.layout.lru_rows - 1)
        return lru & (rp_sorted.gather(1, idx) == sorted_pos), rp_order.gather(1, idx)

    def _victims(self, stamp, found, hit_row, miss) -> torch.Tensor:
        """The i-th miss of a request takes its i-th least recently used row that no entry hits (empty rows
        first, ties by row index). The LRU holds the union of a step's selections, so enough rows remain."""
        R = self.layout.lru_rows
        sink = torch.full_like(hit_row[:, :1], R)
        is_hit = torch.zeros((stamp.shape[0], R + 1), dtype=torch.bool, device=stamp.device)
        is_hit.scatter_(1, torch.where(found, hit_row, sink), True)
        age = torch.where(is_hit[:, :R], torch.full_like(stamp, _BIG), stamp)
        rank = (miss.long().cumsum(dim=1) - 1).clamp(0, R - 1)
        return age.argsort(dim=1, stable=True).gather(1, rank)

    def _record(self, group, hot_slot, row_pos, stamp, row, touched, sorted_pos) -> None:
        """Hit and victim rows now hold their positions, stamped with this plan's clock (writes that touch
        no row go to a sink column that is dropped)."""
        R = self.layout.lru_rows
        sink = torch.full_like(row[:, :1], R)
        idx = torch.where(touched, row, sink)
        self.row_pos[group, hot_slot] = torch.cat([row_pos, sink], 1).scatter(1, idx, sorted_pos)[:, :R]
        self.stamp[group, hot_slot] = torch.cat([stamp, sink], 1).scatter(1, idx, self.clock)[:, :R]
