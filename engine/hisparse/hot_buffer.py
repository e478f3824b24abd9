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

The plan clock is a device tensor (a captured forward advances it and its plans stamp with it on replay).
One more slot than requests can hold, `spare`, is never assigned: the padded static decode path points its
requests without a hot buffer there (their plans read and write back its empty state, nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.hisparse.forward import to_dev
from engine.hisparse.layout import HotLayout
from kernels.hisparse_plan import resolve_ref


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
        self.spare = max(max_hot, 1)
        shape = (num_groups, self.spare + 1, layout.lru_rows)
        self.row_pos = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.stamp = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.blocks = torch.zeros((self.spare + 1, layout.num_blocks), dtype=torch.int32, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)  # advanced in place (`+= 1`): on the device

    def assign(self, hot_slot: int, blocks: list[int]) -> None:
        """A request takes hot slot `hot_slot` with these device blocks: its LRU starts empty."""
        self.blocks[hot_slot] = to_dev(blocks, self.blocks.device, torch.int32)
        self.row_pos[:, hot_slot].fill_(-1)
        self.stamp[:, hot_slot].fill_(-1)

    def resolve(self, group: int, pos: torch.Tensor, on_device: torch.Tensor, start: torch.Tensor,
                hot_slot: torch.Tensor) -> HotPlan:
        """pos [B, N] int64 selected positions (-1 none), on_device [B, N] bool, start [B] int64 (first
        position written this step), hot_slot [B] int64 -> the plan (kernels.hisparse_plan.resolve_ref);
        updates the LRU state."""
        self.clock += 1
        r = resolve_ref(self.row_pos[group, hot_slot], self.stamp[group, hot_slot], pos, on_device, start,
                        self.clock)
        self.row_pos[group, hot_slot], self.stamp[group, hot_slot] = r.row_pos, r.stamp
        return HotPlan(hot_row=r.hot_row, miss_pos=r.miss_pos, miss_row=r.miss_row, num_hits=r.num_hits,
                       num_misses=r.num_misses)
