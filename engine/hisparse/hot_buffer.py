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
        self.blocks[hot_slot] = torch.tensor(blocks, dtype=torch.int32).to(self.blocks.device)
        self.row_pos[:, hot_slot] = -1
        self.stamp[:, hot_slot] = -1

    def resolve(self, group: int, pos: torch.Tensor, on_device: torch.Tensor, start: torch.Tensor,
                hot_slot: torch.Tensor) -> HotPlan:
        """pos [B, N] int64 selected positions (-1 none), on_device [B, N] bool, start [B] int64 (first
        position written this step), hot_slot [B] int64 -> the plan; updates the LRU state."""
        R = self.layout.lru_rows
        B = pos.shape[0]
        self.clock += 1
        sorted_pos, order = torch.where(pos >= 0, pos, torch.full_like(pos, _BIG)).sort(dim=1)
        first = torch.ones_like(sorted_pos, dtype=torch.bool)
        first[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
        valid = sorted_pos != _BIG
        newest = valid & (sorted_pos >= start[:, None])
        lru = first & valid & ~on_device.gather(1, order) & ~newest

        row_pos = self.row_pos[group, hot_slot]  # [B, R] copies
        stamp = self.stamp[group, hot_slot]
        void = row_pos >= start[:, None]
        row_pos = torch.where(void, torch.full_like(row_pos, -1), row_pos)
        stamp = torch.where(void, torch.full_like(stamp, -1), stamp)
        rp_sorted, rp_order = row_pos.sort(dim=1)
        idx = torch.searchsorted(rp_sorted, sorted_pos).clamp(max=R - 1)
        found = lru & (rp_sorted.gather(1, idx) == sorted_pos)
        hit_row = rp_order.gather(1, idx)
        miss = lru & ~found

        sink = torch.full((B, 1), R, dtype=torch.int64, device=pos.device)
        is_hit = torch.zeros((B, R + 1), dtype=torch.bool, device=pos.device)
        is_hit.scatter_(1, torch.where(found, hit_row, sink), True)
        age = torch.where(is_hit[:, :R], torch.full_like(stamp, _BIG), stamp)
        victims = age.argsort(dim=1, stable=True)
        rank = (miss.long().cumsum(dim=1) - 1).clamp(0, R - 1)
        victim_row = victims.gather(1, rank)
        row = torch.where(found, hit_row, torch.where(miss, victim_row, torch.full_like(hit_row, -1)))

        touched = torch.where(found | miss, row, sink)
        self.row_pos[group, hot_slot] = torch.cat([row_pos, sink], 1).scatter(1, touched, sorted_pos)[:, :R]
        self.stamp[group, hot_slot] = torch.cat([stamp, sink], 1).scatter(1, touched, self.clock)[:, :R]

        # duplicates take their first occurrence's row; newest positions take their reserved row
        first_idx = torch.searchsorted(sorted_pos, sorted_pos)
        row = row.gather(1, first_idx)
        reserved = R + sorted_pos - start[:, None]
        row = torch.where(newest, reserved, row)
        row = torch.where(valid & ~on_device.gather(1, order), row, torch.full_like(row, -1))
        hot_row = torch.empty_like(row).scatter_(1, order, row)
        none = torch.full_like(row, -1)
        num_distinct = (first & valid).sum()
        num_misses = miss.sum()
        return HotPlan(hot_row=hot_row, miss_pos=torch.where(miss, sorted_pos, none),
                       miss_row=torch.where(miss, victim_row, none), num_hits=num_distinct - num_misses,
                       num_misses=num_misses)
