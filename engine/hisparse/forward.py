"""Per-forward routing: how each request of a batch reaches its rows. Built once per forward (on the first
backend call), used by every layer; it only reads residency (the step's placement is already done).

    resident  every page on the device: the inner backend reads the device pages in place
    hot       not resident, at most 1 + drafts rows (decode, verification, MTP steps): the rows it selects
              come from device pages in place or from its hot buffer (engine.hisparse.hot_buffer)
    staged    not resident with more rows (a prefill chunk), or the offload-only baseline: per layer the
              whole context is gathered page by page (device pages D2D, host pages H2D) into a workspace

Where a row of this step is written (device slot; its host slot is the batch's slot_mapping):
    its page has a device copy -> that page;  hot -> its reserved newest row;  else host only (-1).

Two ways to read hot rows: `virtual` (the GPU path) hands the inner backend a block table of
[device pages (spilled ones point at block 0, never selected) | hot blocks] and selections remapped to
that layout; `assembled` copies the selected rows into a position-ordered workspace first, so the torch
reference computes exactly what it computes for a resident request (bit-identical fp32 decode).

Two ways to build it: `plan_forward` (any batch) from the metadata's host lists, memoized while the batch
repeats (`BatchRouting`); `plan_static` for the padded static decode forwards (engine/runner/static_decode.py),
which a CUDA graph replays: every request RESIDENT or HOT with R rows, the virtual layout for all of them,
and nothing read but fixed device tensors (`StaticRouting`: each request's page-table row and hot slot,
filled by the batch's one host -> device copy; the rest is computed from the metadata on the device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttnMetadata, ForwardSlot
from kernels.hisparse_plan import dev_slots, dev_slots_ref

RESIDENT, HOT, STAGED = "resident", "hot", "staged"
PAD = "pad"  # a padding request of a padded static batch (reads block 0, writes nothing)
_NO_VOID = 1 << 40  # a start past every position: the plan voids none of the slot's rows (kernels.hisparse_plan)


def to_dev(x, dev: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list / tensor -> `dev` without waiting for the GPU: through pinned memory, non-blocking (a
    plain .to() of pageable memory synchronises the stream, mid-forward here)."""
    t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


class IntMemo:
    """Small host int lists -> device tensors, kept while they repeat: a decode batch repeats most of its
    routing lists step after step, so in steady state they cost a dictionary lookup, not a transfer.
    The tensors are shared: callers never write into them."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self.memo: dict = {}

    def __call__(self, values, dev: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        key = (tuple(values), dtype)
        t = self.memo.get(key)
        if t is None:
            if len(self.memo) >= self.limit:
                self.memo.clear()
            t = self.memo[key] = to_dev(list(values), dev, dtype)
        return t


MAX_STAGE_PAGES = 1 << 14  # one staged workspace holds at most this many pages per layer (1M tokens)


@dataclass
class SubBatch:
    req_idx: list[int]  # requests of the full batch, in batch order
    rows: torch.Tensor | None  # their rows in the full batch (None: every row, in order)
    meta: AttnMetadata  # over those rows, with this part's own block table and context lengths


@dataclass
class HotBatch:
    req_idx: list[int]
    entry_rows: torch.Tensor  # [B, M] rows of each request in the full batch, -1 padded
    start: torch.Tensor | None  # [B] first position written this step
    hot_slot: torch.Tensor  # [B]
    table_slot: torch.Tensor  # [B] page-table rows
    host_table: torch.Tensor | None  # [B, W] host block ids
    hot_base: torch.Tensor  # [B] virtual position of hot row 0 (virtual mode)
    ws_base: torch.Tensor | None  # [B] first workspace block (assembled mode)
    dst_row: torch.Tensor | None = None  # virtual mode: [B, M] the pool row of each entry row, -1 padded
    idx: torch.Tensor | None = None  # the hot requests' rows in the batch's request order (None: every request)


@dataclass
class Workspace:
    sub: SubBatch
    num_blocks: int
    src_dev: torch.Tensor | None = None  # staged: page copies, device block or -1
    src_host: torch.Tensor | None = None  # host block or -1
    dst: torch.Tensor | None = None  # workspace block
    num_host_pages: torch.Tensor | None = None  # [] pages read from the host per layer
    buf: torch.Tensor | None = None  # [num_blocks, 64, row] of this layer's rows


@dataclass
class ForwardState:
    paths: list[str]
    dev_slots: torch.Tensor  # [T] device slot each row is written to, -1: host only
    pool: SubBatch | None = None  # resident (+ hot in virtual mode) requests, on the device pool
    hot: HotBatch | None = None
    assembled: Workspace | None = None
    staged: list[Workspace] = field(default_factory=list)
    plans: dict = field(default_factory=dict)  # group -> GroupPlan
    events: dict = field(default_factory=dict)  # layer -> (stream, CUDA event) of its miss copies
    waited: tuple | None = None  # the last of those waited for (the layers copied together share one)
    scratch: torch.Tensor | None = None  # [ceil(T/64), 64, row] where the inner backend quantises rows
    scratch_meta: AttnMetadata | None = None  # the batch's metadata with slots 0..T-1 (into `scratch`)
    dev_meta: AttnMetadata | None = None  # the batch's metadata with the rows' device slots
    stage_buf: torch.Tensor | None = None  # shared by the staged workspaces (one layer at a time)


# where HiSparse keeps its state on a forward's metadata (engine.attention.metadata.ForwardSlot)
FORWARD_STATE: ForwardSlot[ForwardState] = ForwardSlot("hisparse")  # this forward's routing, plans and copies
STATIC_ROUTING: ForwardSlot[StaticRouting] = ForwardSlot("hisparse.static")  # padded static decode: device inputs


@dataclass
class BatchRouting:
    """The part of a forward's routing that repeats while the batch (requests, rows, pages) and the placement
    do: built once, reused step after step of a decode batch (mgr.routing_memo)."""

    key: tuple
    reqs: list
    paths: list[str]
    hot: list[int]
    pool: list[int]
    hot_batch: HotBatch | None  # start and host_table are filled per step
    table: torch.Tensor | None  # the pool's block table
    slot_of_req: torch.Tensor  # page-table row of each request
    hot_slot_of_req: torch.Tensor | None  # hot slot of each HOT request, -1 for the others
    q_lens: torch.Tensor | None  # rows of each request this step (int64): start = seq_len - rows
    pool_lens: tuple[list[int], torch.Tensor] | None  # the pool's lengths when all its requests are HOT (constant)
    fixed_slots: bool = False  # every new row goes to its request's reserved hot rows: dev_slots repeat
    dev_slots: torch.Tensor | None = None  # ... and are kept here once computed


@dataclass
class StaticRouting:
    """A padded static decode batch's routing inputs (`static_routing`, before the forward; the forward reads
    only `slot` and `hot_slot`, views of the static builder's `req_ints` at fixed addresses)."""

    rows_per_req: int
    slots: list[int]  # page-table row of each request (padding requests: the spare row, -1 everywhere)
    hot_slots: list[int]  # hot slot of each HOT request, -1 for the others
    paths: list[str]  # RESIDENT / HOT / PAD: this step's, for the host (instrumentation, not the forward)
    pool_lens_cpu: list[int]  # the pool part's lengths from the host lists (read only where those are exact)
    slot: torch.Tensor | None = None  # [B] int64 on the device
    hot_slot: torch.Tensor | None = None  # [B] int64 on the device

    @property
    def ints(self) -> tuple[list[int], list[int]]:
        """What travels in the batch's copy (StaticMetadataBuilder.build's req_ints)."""
        return self.slots, self.hot_slots


def static_routing(mgr, req_ids: list[str], seq_lens: list[int], rows_per_req: int) -> StaticRouting:
    """The host side of a padded decode batch's routing (after the step's placement): request ids ("" for a
    padding request) and seq lens -> page-table rows and hot slots. Every request takes at most 1 + drafts
    rows, so one with a hot buffer is HOT and one without is RESIDENT."""
    slots, hot, paths, lens = [], [], [], []
    bs, rows = mgr.spec.block_size, mgr.layout.rows
    for rid, n in zip(req_ids, seq_lens):
        r = mgr.residency.reqs.get(rid) if rid else None
        if r is None:
            slots.append(mgr.spare_slot)
            hot.append(-1)
            paths.append(PAD)
            lens.append(n)
            continue
        slots.append(r.slot)
        hot.append(r.hot_slot if r.hot_slot >= 0 else -1)
        paths.append(HOT if r.hot_slot >= 0 else RESIDENT)
        lens.append(-(-n // bs) * bs + rows if r.hot_slot >= 0 else n)
    return StaticRouting(rows_per_req, slots, hot, paths, lens)


def plan_static(mgr, meta: AttnMetadata, rt: StaticRouting) -> ForwardState:
    """The routing of a padded static decode forward, from device tensors only (a CUDA graph replays it):
    B requests of R consecutive rows each (a request's padding rows and padding requests write nowhere:
    slot -1). The pool part is the whole batch in the virtual layout; one plan covers every request, those
    without a hot buffer with no entry, on the spare hot slot (kernels.hisparse_plan.plan_hot)."""
    lay, bs = mgr.layout, meta.block_size
    B, R, M, H = rt.slot.shape[0], rt.rows_per_req, lay.max_new_rows, lay.num_blocks
    dev = meta.positions.device
    hot = rt.hot_slot >= 0
    start = meta.positions.view(B, R)[:, 0].contiguous()  # first position written this step
    fn = dev_slots if mgr.fused_plan else dev_slots_ref
    slots = fn(meta.positions, meta.token_req_idx, rt.slot, rt.hot_slot, start, mgr.page_table, mgr.hot.blocks, bs,
               lay.lru_rows, lay.rows)
    slots = torch.where(meta.slot_mapping >= 0, slots, torch.full_like(slots, -1))
    # the pool's block table: each request's device pages (spilled or none -> block 0), then a HOT one's hot blocks
    pages = (meta.seq_lens.long() + bs - 1) // bs
    own = mgr.page_table[rt.slot].clamp(min=0)
    own = torch.cat([own, own.new_zeros((B, H))], dim=1)
    cols = torch.arange(own.shape[1], device=dev)[None, :]
    rel = cols - pages[:, None]
    hot_slot = torch.where(hot, rt.hot_slot, torch.full_like(rt.hot_slot, mgr.hot.spare))
    hot_blk = mgr.hot.blocks[hot_slot].gather(1, rel.clamp(0, H - 1))
    table = torch.where(cols < pages[:, None], own,
                        torch.where(hot[:, None] & (rel < H), hot_blk, torch.zeros_like(hot_blk)))
    base = pages * bs
    vlens = torch.where(hot, base + lay.rows, meta.seq_lens.long()).to(torch.int32)
    pool = SubBatch(req_idx=list(range(B)), rows=None,
                    meta=dataclasses.replace(meta, block_table=table, seq_lens=vlens, seq_lens_cpu=rt.pool_lens_cpu))
    j = torch.arange(M, device=dev)[None, :]  # entries: a HOT request's real rows
    rows = torch.arange(B, device=dev)[:, None] * R + j.clamp(max=R - 1)
    entry = torch.where(hot[:, None] & (j < R) & (meta.slot_mapping[rows] >= 0), rows, torch.full_like(rows, -1))
    hb = HotBatch(req_idx=[b for b, p in enumerate(rt.paths) if p == HOT], entry_rows=entry,
                  start=torch.where(hot, start, torch.full_like(start, _NO_VOID)), hot_slot=hot_slot,
                  table_slot=rt.slot, host_table=meta.block_table, hot_base=base, ws_base=None, dst_row=entry)
    return ForwardState(paths=rt.paths, dev_slots=slots, pool=pool, hot=hb)


def plan_forward(mgr, meta: AttnMetadata) -> ForwardState:
    req_ids = meta.req_ids
    if req_ids is None or len(req_ids) != meta.num_reqs:
        raise RuntimeError("hisparse needs the batch's request ids in meta.req_ids "
                           "(set by engine.runner.inputs.build_batch)")
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    num_pages = [-(-s // meta.block_size) for s in lens]
    key = (tuple(req_ids), tuple(qsl), tuple(num_pages), mgr.placement_version, mgr.assemble, mgr.fused_plan)
    rt = mgr.routing_memo
    if rt is None or rt.key != key:
        rt = mgr.routing_memo = _routing(mgr, meta, key, req_ids, num_pages)
    paths = rt.paths
    starts_t = None  # first position written this step, per request (computed on the device: no transfer)
    if rt.hot:
        starts_t = meta.seq_lens - rt.q_lens  # int32 - int64 -> int64
    fw = ForwardState(paths=paths, dev_slots=_dev_slots(mgr, meta, rt, starts_t))
    if rt.hot:
        every = rt.hot_batch.idx is None
        fw.hot = dataclasses.replace(rt.hot_batch, start=starts_t if every else starts_t[rt.hot_batch.idx],
                                     host_table=meta.block_table if every else meta.block_table[rt.hot_batch.idx])
        if mgr.assemble:
            fw.assembled = _workspace(meta, rt.hot, num_pages)
    if rt.pool:
        if rt.pool_lens is not None:  # every pool request is HOT: virtual lengths fixed by the routing
            fw.pool = sub_batch(meta, rt.pool, rt.table, *rt.pool_lens, ints=mgr.ints)
        else:
            vlens = [_virtual_len(mgr, meta, b, num_pages) if paths[b] == HOT else lens[b] for b in rt.pool]
            fw.pool = sub_batch(meta, rt.pool, rt.table, vlens, ints=mgr.ints)
    fw.staged = _staged(mgr, meta, rt.reqs, [b for b, p in enumerate(paths) if p == STAGED], num_pages)
    return fw


def _routing(mgr, meta: AttnMetadata, key: tuple, req_ids: list[str], num_pages: list[int]) -> BatchRouting:
    qsl = meta.query_start_loc_cpu
    dev = meta.positions.device
    reqs = [mgr.residency.reqs[rid] for rid in req_ids]
    paths = []
    for b, r in enumerate(reqs):
        n = qsl[b + 1] - qsl[b]
        if mgr.offload_only:
            paths.append(STAGED)
        elif r.hot_slot < 0:
            paths.append(RESIDENT)
        else:
            paths.append(HOT if n <= mgr.layout.max_new_rows else STAGED)
    hot = [b for b, p in enumerate(paths) if p == HOT]
    resident = [b for b, p in enumerate(paths) if p == RESIDENT]
    pool = sorted(resident + ([] if mgr.assemble else hot))
    pool_lens = None
    if pool and not resident:
        vlens = [_virtual_len(mgr, meta, b, num_pages) for b in pool]
        pool_lens = (vlens, to_dev(vlens, dev, torch.int32))
    return BatchRouting(key=key, reqs=reqs, paths=paths, hot=hot, pool=pool,
                   hot_batch=_hot_batch(mgr, meta, reqs, hot, num_pages, pool) if hot else None,
                   table=_pool_table(mgr, reqs, pool, num_pages, paths) if pool else None,
                   slot_of_req=mgr.ints([r.slot for r in reqs], dev),
                   hot_slot_of_req=mgr.ints([r.hot_slot if p == HOT else -1 for r, p in zip(reqs, paths)], dev)
                   if hot else None,
                   q_lens=to_dev([qsl[b + 1] - qsl[b] for b in range(len(reqs))], dev) if hot else None,
                   pool_lens=pool_lens,
                   fixed_slots=len(hot) == len(reqs) and all(r.num_dev_pages == 0 for r in reqs))


def _virtual_len(mgr, meta: AttnMetadata, b: int, num_pages: list[int]) -> int:
    """A HOT request's length in the pool's virtual layout: its pages, then its hot buffer."""
    return num_pages[b] * meta.block_size + mgr.layout.rows


def _dev_slots(mgr, meta: AttnMetadata, rt: BatchRouting, starts: torch.Tensor | None) -> torch.Tensor:
    """Device slot of each new row (kernels.hisparse_plan.dev_slots: a kernel on GPUs, its reference elsewhere).
    When every request is HOT with no device page (`rt.fixed_slots`), row i of a request goes to its reserved
    hot row lru_rows + i whatever the position, so the slots of the routing's first step are reused."""
    if rt.dev_slots is not None:
        return rt.dev_slots
    fn = dev_slots if mgr.fused_plan else dev_slots_ref
    out = fn(meta.positions, meta.token_req_idx, rt.slot_of_req, rt.hot_slot_of_req, starts, mgr.page_table,
             mgr.hot.blocks, meta.block_size, mgr.layout.lru_rows, mgr.layout.rows)
    if rt.fixed_slots:
        rt.dev_slots = out
    return out


def _hot_batch(mgr, meta, reqs, hot: list[int], num_pages, pool: list[int]) -> HotBatch:
    """The hot requests' routing (start and host_table are filled per step by plan_forward)."""
    dev = meta.positions.device
    qsl = meta.query_start_loc_cpu
    M = mgr.layout.max_new_rows
    ints = mgr.ints
    rows = [r for b in hot for r in [qsl[b] + i for i in range(qsl[b + 1] - qsl[b])] + [-1] * (M - qsl[b + 1] + qsl[b])]
    ws_base, at = [], 0
    for b in hot:
        ws_base.append(at)
        at += num_pages[b]
    hb = HotBatch(req_idx=hot, entry_rows=ints(rows, dev).view(len(hot), M), start=None,
                  hot_slot=ints([reqs[b].hot_slot for b in hot], dev),
                  table_slot=ints([reqs[b].slot for b in hot], dev), host_table=None,
                  hot_base=ints([num_pages[b] * meta.block_size for b in hot], dev),
                  ws_base=ints(ws_base, dev), idx=None if len(hot) == len(reqs) else ints(hot, dev))
    if not mgr.assemble:  # where each hot request's rows sit inside the pool part
        at, where_in_pool = 0, {}
        for b in pool:
            where_in_pool[b] = at
            at += qsl[b + 1] - qsl[b]
        dst = [-1] * (len(hot) * M)
        for j, b in enumerate(hot):
            for i in range(qsl[b + 1] - qsl[b]):
                dst[j * M + i] = where_in_pool[b] + i
        hb.dst_row = ints(dst, dev).view(len(hot), M)
    return hb


def _pool_table(mgr, reqs, pool: list[int], num_pages: list[int], paths: list[str]) -> torch.Tensor:
    """[len(pool), W] device blocks: each request's pages (spilled -> 0), then its hot blocks if hot."""
    dev = mgr.page_table.device
    H = mgr.layout.num_blocks
    widths = [num_pages[b] + (H if paths[b] == HOT else 0) for b in pool]
    wp = max(num_pages[b] for b in pool)
    table = torch.zeros((len(pool), max(widths)), dtype=torch.int32, device=dev)
    slots = to_dev([reqs[b].slot for b in pool], dev)
    table[:, :wp] = mgr.page_table[slots, :wp].clamp(min=0)
    hot_i = [i for i, b in enumerate(pool) if paths[b] == HOT]
    if hot_i:
        cols = torch.tensor([num_pages[pool[i]] for i in hot_i])[:, None] + torch.arange(H)[None, :]
        hs = to_dev([reqs[pool[i]].hot_slot for i in hot_i], dev)
        table[to_dev(hot_i, dev)[:, None], to_dev(cols, dev)] = mgr.hot.blocks[hs]
    return table


def _workspace(meta: AttnMetadata, req_idx: list[int], num_pages: list[int]) -> Workspace:
    """A position-ordered workspace: request i owns blocks [base_i, base_i + pages_i)."""
    dev = meta.positions.device
    base, at = [], 0
    for b in req_idx:
        base.append(at)
        at += num_pages[b]
    width = max(num_pages[b] for b in req_idx)
    table = to_dev((torch.tensor(base)[:, None] + torch.arange(width)[None, :]).clamp(max=at - 1).to(torch.int32), dev)
    return Workspace(sub=sub_batch(meta, req_idx, table, [meta.seq_lens_cpu[b] for b in req_idx]), num_blocks=at)


def _staged(mgr, meta: AttnMetadata, reqs, staged: list[int], num_pages: list[int]) -> list[Workspace]:
    groups: list[list[int]] = []
    for b in staged:  # split so that one workspace stays below MAX_STAGE_PAGES per layer
        if not groups or sum(num_pages[x] for x in groups[-1]) + num_pages[b] > MAX_STAGE_PAGES:
            groups.append([])
        groups[-1].append(b)
    out = []
    dev = meta.positions.device
    for group in groups:
        ws = _workspace(meta, group, num_pages)
        counts = torch.tensor([num_pages[b] for b in group])
        req_of = to_dev(torch.repeat_interleave(torch.arange(len(group)), counts), dev)
        page = torch.arange(ws.num_blocks, device=dev) - to_dev(torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts), dev)
        slots = to_dev([reqs[b].slot for b in group], dev)[req_of]
        host = meta.block_table[to_dev(group, dev)[req_of], page].long()
        src_dev = mgr.page_table[slots, page].long()
        ws.src_dev, ws.dst = src_dev, torch.arange(ws.num_blocks, device=dev)
        ws.src_host = torch.where(src_dev < 0, host, torch.full_like(host, -1))
        ws.num_host_pages = (src_dev < 0).sum()
        out.append(ws)
    return out


def sub_batch(meta: AttnMetadata, req_idx: list[int], block_table: torch.Tensor, seq_lens: list[int],
              seq_lens_t: torch.Tensor | None = None, ints: IntMemo | None = None) -> SubBatch:
    """Metadata over the rows of some requests of the batch, with their own block table and lengths
    (`seq_lens_t`: those lengths on the device already; `ints`: keep the small lists on the device while
    they repeat)."""
    dev = meta.positions.device
    ints = ints or (lambda v, d, t=torch.int64: to_dev(v, d, t))
    qsl = meta.query_start_loc_cpu
    counts = [qsl[b + 1] - qsl[b] for b in req_idx]
    new_qsl = [0]
    for n in counts:
        new_qsl.append(new_qsl[-1] + n)
    if req_idx == list(range(meta.num_reqs)):
        rows, positions, slot_mapping, tok = None, meta.positions, meta.slot_mapping, meta.token_req_idx
    else:
        rows = to_dev(torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in req_idx]), dev)
        positions, slot_mapping = meta.positions[rows], meta.slot_mapping[rows]
        tok = to_dev(torch.repeat_interleave(torch.arange(len(req_idx), dtype=torch.int32),
                                             torch.tensor(counts, dtype=torch.int64)), dev)
    sub = AttnMetadata(positions=positions, slot_mapping=slot_mapping,
                       query_start_loc=ints(new_qsl, dev, torch.int32),
                       seq_lens=ints(seq_lens, dev, torch.int32) if seq_lens_t is None else seq_lens_t,
                       block_table=block_table,
                       token_req_idx=tok, query_start_loc_cpu=new_qsl, seq_lens_cpu=list(seq_lens),
                       block_size=meta.block_size)
    return SubBatch(req_idx=list(req_idx), rows=rows, meta=sub)
