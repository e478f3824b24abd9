"""The static metadata builder of HiSparse's padded decode forwards: the inner backend's buffers plus, per
request, its page-table row and hot slot (engine.hisparse.forward.StaticRouting).

    route   on the host, after the step's placement: request ids ("" for padding) and seq lens -> the
            routing (`static_routing`); its two int lists travel in the batch's one host -> device copy
            into the builder's `req_ints` rows at fixed addresses (a CUDA graph replays on them)
    attach  the routing, with its device views, on the metadata (`STATIC_ROUTING`), where the backend's
            begin_forward finds it and plans from device tensors only (`plan_static`)

A padding request takes the spare page-table row (all -1) and no hot slot.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttnMetadata
from engine.attention.static import StaticMetadataBuilder
from engine.hisparse.forward import STATIC_ROUTING, StaticRouting, static_routing


class HiSparseMetadataBuilder(StaticMetadataBuilder):
    def __init__(self, mgr, max_rows: int, max_reqs: int, max_blocks: int, device: torch.device | str):
        super().__init__(max_rows, max_reqs, max_blocks, mgr.spec.block_size, device, num_req_ints=2)
        self.mgr = mgr
        self.pad_req_ints = (mgr.spare_slot, -1)
        self.routing: StaticRouting | None = None  # of the last build (host lists; the device views once attached)

    def route(self, req_ids: list[str], seq_lens: list[int], rows_per_req: int) -> tuple[list[int], ...]:
        self.routing = static_routing(self.mgr, req_ids, seq_lens, rows_per_req)
        return self.routing.ints

    def attach(self, meta: AttnMetadata) -> None:
        rt, B = self.routing, meta.seq_lens.shape[0]
        if rt is None or meta.req_ids is None:
            return
        self.routing = None
        rt.slot, rt.hot_slot = self.req_ints[0, :B], self.req_ints[1, :B]
        STATIC_ROUTING.put(meta, rt)
