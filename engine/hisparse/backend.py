"""The attention backend the model sees under HiSparse: it wraps the real one (torch or Triton).

    store_kv       every new row has a device slot (page or reserved hot row) unless a request is staged: the
                   inner backend writes it there, and once a group's last layer is stored one copy backs the
                   group's rows up to the host pool; with staged requests (rows of host-only pages) the rows
                   are quantised into a scratch page and copied to both (write-through, in stream order)
    store_index_k  \\ unchanged: the index cache is addressed by host blocks, exactly like the block tables
    indexer_topk   /
    sparse_mla     full layer: resolve this step's plan for the hot requests (hits / misses / victims) and
                   start the miss copies of every layer of its group (side stream on CUDA); shared layers
                   replay it. Then attend: resident + hot requests on the device pool, staged ones on a
                   workspace gathered for this layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.attention.base import WrappingAttentionBackend
from engine.attention.metadata import AttnMetadata
from engine.attention.static import StaticMetadataBuilder
from engine.hisparse.builder import HiSparseMetadataBuilder
from engine.hisparse.forward import (
    FORWARD_STATE,
    STAGED,
    STATIC_ROUTING,
    ForwardState,
    Workspace,
    plan_forward,
    plan_static,
)
from kernels.hisparse_plan import plan_hot, plan_hot_ref


@dataclass
class GroupPlan:
    pool_sel: torch.Tensor | None  # selections of the pool rows, hot rows remapped (virtual mode)
    asm_src: torch.Tensor | None  # assembled mode: device-pool slot of each selected entry
    asm_dst: torch.Tensor | None  # and its workspace slot


class _OneLayer:
    """A cache whose every layer is one [num_blocks, 64, row] tensor (scratch rows and workspaces)."""

    def __init__(self, view: torch.Tensor):
        self.view = view

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self.view


class HiSparseBackend(WrappingAttentionBackend):
    def __init__(self, inner, mgr, pads_decode: bool):
        super().__init__(inner)
        self.mgr = mgr
        self.name = f"hisparse+{inner.name}"
        # a padded static decode forward routes from device tensors only (plan_static): capturable when the inner
        # backend is; the offload-only baseline stages whole contexts per step and never takes that path
        self.graph_safe = inner.graph_safe and not mgr.offload_only
        # padded decode forwards carry their routing in the builder's copy (HiSparseMetadataBuilder); unpadded
        # ones route from the metadata's host lists per forward (plan_forward)
        self.pads_decode = pads_decode and not mgr.offload_only

    def metadata_builder(self, max_rows: int, max_reqs: int, max_blocks: int,
                         device: torch.device | str) -> StaticMetadataBuilder:
        """The inner backend's buffers plus two per-request ints, page-table row and hot slot (StaticRouting),
        when decode forwards are padded; the plain buffers otherwise."""
        if not self.pads_decode:
            return StaticMetadataBuilder(max_rows, max_reqs, max_blocks, self.spec.block_size, device)
        return HiSparseMetadataBuilder(self.mgr, max_rows, max_reqs, max_blocks, device)

    def begin_forward(self, meta: AttnMetadata) -> None:
        """This forward's routing (resident / hot / staged requests), device slots and sub-batches: from the
        static routing's device tensors on the padded static path, else from the metadata's host lists."""
        self.inner.begin_forward(meta)
        rt = STATIC_ROUTING.get(meta)
        fw = plan_static(self.mgr, meta, rt) if rt is not None else plan_forward(self.mgr, meta)
        if fw.hot is not None and fw.assembled is None:
            self.mgr.hot.clock += 1  # one tick per forward (on the device): its plans stamp the rows they touch
        FORWARD_STATE.put(meta, fw)

    def state(self, meta: AttnMetadata) -> ForwardState:
        fw = FORWARD_STATE.get(meta)
        if fw is None:  # a caller that drives the layers itself (benchmarks) may skip begin_forward
            self.begin_forward(meta)
            fw = FORWARD_STATE.get(meta)
        return fw

    # ---- writes -------------------------------------------------------------------------------
    def store_kv(self, cache, layer: int, latent: torch.Tensor, k_rope: torch.Tensor, meta: AttnMetadata) -> None:
        fw = self.state(meta)
        if STAGED not in fw.paths:  # every new row has a device slot: write it there, back it up per group
            self._store_direct(fw, cache, layer, latent, k_rope, meta)
            return
        T = latent.shape[0]
        spec = self.spec
        if fw.scratch is None:  # made once per forward, used by every layer
            fw.scratch = torch.empty((-(-T // spec.block_size), spec.block_size, spec.mla_row),
                                     dtype=spec.mla_torch_dtype, device=latent.device)
            rows = torch.arange(T, device=latent.device)
            fw.scratch_meta = dataclasses.replace(meta, slot_mapping=rows)
        rows = fw.scratch_meta.slot_mapping
        self.inner.store_kv(_OneLayer(fw.scratch), layer, latent, k_rope, fw.scratch_meta)
        # the device slot (page or reserved hot row) and the host pool (write-through), one read
        self.mgr.mover.copy2(fw.scratch, rows, cache.pool.mla_layer(layer), fw.dev_slots,
                             cache.mla_layer(layer), meta.slot_mapping)

    def _store_direct(self, fw: ForwardState, cache, layer: int, latent, k_rope, meta: AttnMetadata) -> None:
        """The rows go to their device slot (page or reserved hot row) like a resident cache's; once the last
        layer of the group stored its rows, one copy backs the group's rows up to the host pool (nothing
        reads this step's host rows before: they are served from the device until the next step)."""
        if fw.dev_meta is None:
            fw.dev_meta = dataclasses.replace(meta, slot_mapping=fw.dev_slots)
        self.inner.store_kv(cache.pool, layer, latent, k_rope, fw.dev_meta)
        group = self.mgr.groups.group_of[layer]
        layers = self.mgr.groups.layers[group]
        if layer == layers[-1]:
            self.mgr.mover.copy_group(("back", id(cache), group), _back_pairs(cache, layers), fw.dev_slots,
                                      meta.slot_mapping)

    def store_index_k(self, cache, layer: int, k: torch.Tensor, meta: AttnMetadata) -> None:
        self.inner.store_index_k(cache, layer, k, meta)

    def indexer_topk(self, cache, layer: int, q: torch.Tensor, weights: torch.Tensor, meta: AttnMetadata,
                     topk: int) -> torch.Tensor:
        return self.inner.indexer_topk(cache, layer, q, weights, meta, topk)

    # ---- attention ---------------------------------------------------------------------------
    def sparse_mla(self, cache, layer: int, q: torch.Tensor, topk_pos: torch.Tensor, meta: AttnMetadata,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        fw = self.state(meta)
        group = self.mgr.groups.group_of[layer]
        plan = fw.plans.get(group)
        if plan is None:
            plan = fw.plans[group] = self._resolve(fw, cache, group, topk_pos, meta)
        waiter = fw.events.pop(layer, None)
        if waiter is not None and waiter is not fw.waited:  # layers copied together share one wait
            self.mgr.mover.wait(waiter)
            fw.waited = waiter
        parts = []
        if fw.pool is not None:
            sel = plan.pool_sel if plan.pool_sel is not None else _rows(topk_pos, fw.pool.rows)
            parts.append((fw.pool.rows, self.inner.sparse_mla(cache.pool, layer, _rows(q, fw.pool.rows), sel,
                                                              fw.pool.meta, sm_scale)))
        if fw.assembled is not None:
            self._assemble(fw.assembled, cache.pool.mla_layer(layer), plan)
            parts.append((fw.assembled.sub.rows, self._attend(fw.assembled, layer, q, topk_pos, sm_scale)))
        for ws in fw.staged:
            self._stage(fw, ws, cache, layer)
            parts.append((ws.sub.rows, self._attend(ws, layer, q, topk_pos, sm_scale)))
        return _merge(parts, q, self.spec.latent_dim)

    def _attend(self, ws: Workspace, layer: int, q, topk_pos, sm_scale):
        rows = ws.sub.rows
        return self.inner.sparse_mla(_OneLayer(ws.buf), layer, _rows(q, rows), _rows(topk_pos, rows), ws.sub.meta,
                                     sm_scale)

    def _resolve(self, fw: ForwardState, cache, group: int, topk_pos: torch.Tensor, meta: AttnMetadata) -> GroupPlan:
        hb, mgr = fw.hot, self.mgr
        if hb is None:
            return GroupPlan(None, None, None)
        if fw.assembled is None:  # the virtual layout (always on the padded static path)
            return self._resolve_virtual(fw, cache, group, topk_pos)
        bs = meta.block_size
        B, M = hb.entry_rows.shape
        sel = topk_pos.long()[hb.entry_rows.clamp(min=0)]  # [B, M, K]
        K = sel.shape[-1]
        pos = torch.where(hb.entry_rows[..., None] >= 0, sel, torch.full_like(sel, -1)).reshape(B, M * K)
        page = mgr.page_table[hb.table_slot[:, None], pos.clamp(min=0) // bs].long()
        on_dev = (pos >= 0) & (page >= 0)
        p = mgr.hot.resolve(group, pos, on_dev, hb.start, hb.hot_slot)
        self._start_copies(fw, cache, group, hb, p)
        hr = p.hot_row.clamp(min=0)
        hot_dev = mgr.hot.blocks[hb.hot_slot[:, None], hr // bs].long() * bs + hr % bs
        none = torch.full_like(pos, -1)
        dev_slot = torch.where(on_dev, page * bs + pos % bs, torch.where(p.hot_row >= 0, hot_dev, none))
        dst = torch.where(pos >= 0, hb.ws_base[:, None] * bs + pos, none)
        return GroupPlan(None, dev_slot.flatten(), dst.flatten())

    def _resolve_virtual(self, fw: ForwardState, cache, group: int, topk_pos: torch.Tensor) -> GroupPlan:
        """The plan (kernels.hisparse_plan: one kernel on GPUs, its torch reference elsewhere): state,
        remapped selections, counters and compact miss lists, then the group's copies."""
        hb, mgr = fw.hot, self.mgr
        topk_pos = topk_pos if topk_pos.dtype == torch.int32 else topk_pos.to(torch.int32)
        pool_sel = _rows(topk_pos, fw.pool.rows).contiguous().clone()
        layers = mgr.groups.layers[group]
        plan = plan_hot if mgr.fused_plan else plan_hot_ref
        src, dst = plan(topk_pos.contiguous(), hb.entry_rows, hb.start, hb.hot_slot, hb.table_slot, hb.hot_base,
                        mgr.page_table, hb.host_table, mgr.hot.blocks, mgr.hot.row_pos, mgr.hot.stamp, group,
                        mgr.hot.clock, hb.dst_row, pool_sel, mgr.counters, mgr.row_bytes * len(layers),
                        self.spec.block_size, rows_sorted=self.topk_rows_ascending)
        fw.events.update(mgr.mover.copy_layers(("miss", id(cache), group), _miss_pairs(cache, layers), src, dst,
                                               layers))
        return GroupPlan(pool_sel, None, None)

    def _start_copies(self, fw: ForwardState, cache, group: int, hb, p) -> None:
        """Assembled mode: misses host -> LRU victims, for every layer of the group (replayed plan), counted
        once per row."""
        mgr, bs = self.mgr, self.spec.block_size
        mp, mr = p.miss_pos, p.miss_row
        b_idx = torch.arange(mp.shape[0], device=mp.device)[:, None]
        src = torch.where(mp >= 0, hb.host_table[b_idx, mp.clamp(min=0) // bs].long() * bs + mp % bs, mp)
        mrc = mr.clamp(min=0)
        dst = torch.where(mr >= 0, mgr.hot.blocks[hb.hot_slot[:, None], mrc // bs].long() * bs + mrc % bs, mr)
        layers = mgr.groups.layers[group]
        mgr.count_plan(p.num_hits, p.num_misses, len(layers))
        fw.events.update(mgr.mover.copy_layers(("miss", id(cache), group), _miss_pairs(cache, layers), src.flatten(),
                                               dst.flatten(), layers))

    def _assemble(self, ws: Workspace, pool_layer: torch.Tensor, plan: GroupPlan) -> None:
        """Selected rows (device pages or hot rows) -> their positions in a zeroed workspace."""
        spec = self.spec
        ws.buf = torch.zeros((ws.num_blocks, spec.block_size, spec.mla_row), dtype=spec.mla_torch_dtype,
                             device=pool_layer.device)
        self.mgr.mover.copy(pool_layer, plan.asm_src, ws.buf, plan.asm_dst)

    def _stage(self, fw: ForwardState, ws: Workspace, cache, layer: int) -> None:
        """This layer's whole context of the staged requests, page by page (device D2D, host H2D)."""
        spec = self.spec
        if fw.stage_buf is None:  # one buffer for every staged workspace: they are used one after the other
            fw.stage_buf = torch.empty((max(w.num_blocks for w in fw.staged), spec.block_size, spec.mla_row),
                                       dtype=spec.mla_torch_dtype, device=cache.pool.mla.device)
        ws.buf = fw.stage_buf[: ws.num_blocks]
        dst = _pages(ws.buf)
        self.mgr.mover.copy(_pages(cache.pool.mla_layer(layer)), ws.src_dev, dst, ws.dst)
        self.mgr.mover.copy(_pages(cache.mla_layer(layer)), ws.src_host, dst, ws.dst)
        self.mgr.count_h2d(ws.num_host_pages * spec.block_size * spec.mla_row * spec.mla_torch_dtype.itemsize)


def _miss_pairs(cache, layers):
    """(host view, device view) of each layer of a group: where its misses are copied from and to."""
    return lambda: [(cache.mla_layer(l), cache.pool.mla_layer(l)) for l in layers]


def _back_pairs(cache, layers):
    """(device view, host view) of each layer of a group: where its new rows are backed up."""
    return lambda: [(cache.pool.mla_layer(l), cache.mla_layer(l)) for l in layers]


def _pages(view: torch.Tensor) -> torch.Tensor:
    """[NB, 64, row] -> [NB, 1, 64 * row]: whole pages as single rows (one copy per page)."""
    return view.view(view.shape[0], 1, view.shape[1] * view.shape[2])


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _merge(parts, q: torch.Tensor, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if parts[0][0] is None:  # one part holding every row, in order
        return parts[0][1]
    T, H = q.shape[0], q.shape[1]
    out = torch.empty((T, H, latent_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    for rows, (o, l) in parts:
        out[rows] = o
        lse[rows] = l
    return out, lse
