"""What the ModelRunner owns under HiSparse: the caches, residency, hot buffers, the backend wrapper, the
per-step hook and the counters (device tensors, read only when stats are asked for: on a GPU from a pinned
copy taken at each step's start while a step is in flight, so asking never waits for one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.engine import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.hisparse.backend import HiSparseBackend
from engine.hisparse.forward import IntMemo, to_dev
from engine.hisparse.host_pool import HiSparseKVCache, host_blocks_for
from engine.hisparse.hot_buffer import HotBuffers
from engine.hisparse.layout import HotLayout, LayerGroups
from engine.hisparse.residency import DeviceFootprint, Residency, StepActions
from engine.hisparse.row_mover import RowMover
from engine.kv.cache import KVCacheSpec

_HITS, _MISSES, _H2D, _STEP_H2D = range(4)


@dataclass
class HiSparseStats:
    hits: int  # distinct selected rows of non-resident requests served from the device (per full layer)
    misses: int  # ... copied host -> hot buffer
    h2d_bytes: int  # every host -> device byte: misses (all layers of a group), restores, staging
    h2d_bytes_last_step: int
    spilled_pages: int
    restored_pages: int
    num_resident: int
    num_mixed: int
    num_host: int
    num_device_blocks: int
    num_free_device_blocks: int
    num_host_blocks: int
    copy_path: str

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class HiSparseManager:
    def __init__(self, cfg: EngineConfig, spec: KVCacheSpec, device: torch.device, num_device_blocks: int,
                 assemble: bool | None = None):
        hs = cfg.hisparse
        self.spec = spec
        self.offload_only = hs.offload_only
        self.layout = HotLayout.create(cfg.model.index_topk, hs.device_buffer_size, cfg.num_spec_tokens,
                                       spec.block_size)
        self.groups = LayerGroups.from_spec(spec)
        num_host = host_blocks_for(spec, hs.host_pool_gib, hs.host_pool_blocks)
        if cfg.cache.num_blocks is None:  # a memory budget of full blocks: the index cache (by host block) first
            budget = num_device_blocks * spec.block_bytes - num_host * spec.index_block_bytes
            num_device_blocks = max(budget // spec.mla_block_bytes, 1)
        if not self.offload_only and num_device_blocks < self.layout.num_blocks:
            raise ValueError(f"the device pool ({num_device_blocks} blocks) cannot hold one hot buffer of "
                             f"{self.layout.num_blocks} blocks ({self.layout.rows} rows): raise num_blocks / "
                             "gpu_memory_utilization or lower hisparse device_buffer_size")
        self.cache = HiSparseKVCache(spec, num_host, num_device_blocks, device)
        max_reqs = cfg.scheduler.max_num_seqs
        self.residency = Residency(num_device_blocks, self.layout.num_blocks, max_reqs, self.offload_only)
        max_pages = -(-(cfg.scheduler.max_model_len + cfg.num_spec_tokens + 1) // spec.block_size) + 1
        # one row per request, plus a spare one that stays -1 (the padding requests of static batches read it)
        self.page_table = torch.full((max_reqs + 1, max_pages), -1, dtype=torch.int32, device=device)
        self.spare_slot = max_reqs
        self.hot = HotBuffers(self.layout, self.groups.num_groups, self.residency.max_hot, device)
        self.device = torch.device(device)
        self.capture_graphs = cfg.graphs.capture_hisparse
        self.mover = RowMover(self.device)
        self.assemble = assemble
        # the plan as one kernel (kernels.hisparse_plan) on GPUs; the torch ops elsewhere (tests may switch)
        self.fused_plan = torch.device(device).type == "cuda"
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        self.step_counters = self.counters[_STEP_H2D:]  # the per-step ones, zeroed by place()
        cuda = torch.device(device).type == "cuda"
        # the counters as a step found them (pinned copy behind an event): what stats() reads while one runs
        self.snapshot = torch.zeros(4, dtype=torch.int64, pin_memory=True) if cuda else None
        self.snapshot_ready = torch.cuda.Event() if cuda else None
        self.ints = IntMemo()  # per-forward routing lists kept on the device while they repeat
        self.version = 0  # bumped whenever placement changes (page table, hot buffers): invalidates memos
        self.routing_memo = None  # engine.hisparse.forward.BatchRouting of the last forward
        self.row_bytes = spec.mla_row * spec.mla_torch_dtype.itemsize

    @property
    def placement_version(self) -> tuple[int, int]:
        """Changes whenever any placement does (page table, hot buffers, residency): routing memos' key."""
        return self.version, self.residency.version

    def wrap(self, backend) -> HiSparseBackend:
        if self.assemble is None:  # bit-exact reads for the reference backend, the virtual layout otherwise
            self.assemble = backend.name == "torch"
        # decode forwards padded to capture sizes (and captured on CUDA) unless --enforce-eager
        # (GraphConfig.capture_hisparse); unpadded otherwise
        pads = self.device.type != "cuda" or self.capture_graphs
        return HiSparseBackend(backend, self, pads_decode=pads)

    def footprint(self) -> DeviceFootprint | None:
        """The scheduler's device-room check (none for offload-only: nothing stays on the device)."""
        if self.offload_only:
            return None
        return DeviceFootprint(self.residency.num_device_blocks, self.layout.num_blocks)

    # ---- the step hook -----------------------------------------------------------------------
    def begin_step(self, sched: SchedulerOutput, states: dict) -> None:
        """Place this step's pages (after the runner applied the scheduler's diffs)."""
        self.place(sched.finished_req_ids + sched.preempted_req_ids,
                   [(c.req_id, states[c.req_id].block_ids, c.start) for c in sched.chunks])

    def place(self, dropped: list[str], synced: list[tuple[str, list[int], int]]) -> None:
        """Drop requests; register / grow (req_id, host block ids, tokens already written); rebalance; apply.
        The margin keeps one spare block per request for next step's growth before anything is restored."""
        if self.snapshot is not None:  # behind the last step's forwards, before its per-step count is reset
            self.snapshot.copy_(self.counters, non_blocking=True)
            self.snapshot_ready.record()
        self.step_counters.zero_()  # on the device: `counters[i] = 0` would copy a host scalar in
        if dropped:
            self.version += 1
        for rid in dropped:
            self.residency.drop(rid)
        self.residency.sync_all(synced, self.spec.block_size)
        self.apply(self.residency.rebalance(margin=len(self.residency.reqs)))

    def apply(self, a: StepActions) -> None:
        dev = self.page_table.device
        if a.reset_slots or a.page_updates or a.hot_assigned or a.restores:
            self.version += 1
        for slot in a.reset_slots:
            self.page_table[slot].fill_(-1)
        if a.page_updates:
            last = {(s, p): v for s, p, v in a.page_updates}  # a page can move twice in one step
            s, p = zip(*last)
            self.page_table[to_dev(s, dev), to_dev(p, dev)] = to_dev(list(last.values()), dev, torch.int32)
        for hot_slot, blocks in a.hot_assigned:
            self.hot.assign(hot_slot, blocks)
        mla, host = self.cache.pool.mla, self.cache.mla
        for host_block, dev_block in a.restores:
            mla[dev_block].copy_(host[host_block], non_blocking=True)
        if a.restores:
            self.count_h2d(len(a.restores) * self.spec.mla_block_bytes)

    # ---- counters ----------------------------------------------------------------------------
    def count_plan(self, hits: torch.Tensor, misses: torch.Tensor, num_layers: int) -> None:
        self.counters[_HITS] += hits
        self.counters[_MISSES] += misses
        self.count_h2d(misses * (self.row_bytes * num_layers))

    def count_h2d(self, nbytes) -> None:
        self.counters[_H2D] += nbytes
        self.counters[_STEP_H2D] += nbytes

    def read_counters(self) -> list[int]:
        """hits, misses, H2D bytes, H2D bytes of the last step. An idle GPU (or the CPU) is read directly; while
        a step runs (async scheduling launches the next one before reading the last) the snapshot taken at its
        start is read: it sits behind the steps whose outputs were read already, so nothing waits for the one
        in flight."""
        if self.snapshot is None or torch.cuda.current_stream(self.counters.device).query():
            return self.counters.tolist()
        self.snapshot_ready.synchronize()
        return self.snapshot.tolist()

    def stats(self) -> HiSparseStats:
        hits, misses, h2d, step = self.read_counters()
        states = self.residency.count_states()
        return HiSparseStats(hits=hits, misses=misses, h2d_bytes=h2d, h2d_bytes_last_step=step,
                             spilled_pages=self.residency.num_spilled_pages,
                             restored_pages=self.residency.num_restored_pages, num_resident=states["resident"],
                             num_mixed=states["mixed"], num_host=states["host"],
                             num_device_blocks=self.residency.num_device_blocks,
                             num_free_device_blocks=self.residency.num_free_blocks,
                             num_host_blocks=self.cache.num_blocks, copy_path=self.mover.path)
