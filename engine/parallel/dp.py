"""DPEngineCore: one engine of D data-parallel ranks (`data_parallel_size`), experts split across them with
`enable_expert_parallel`; the caller's process is rank 0 and drives the group.

Each DP rank serves its own requests: it has its own Scheduler and KV manager (kept here, in the driver,
one per rank: pure Python) and its own runner process with its own KV pages, HiSparse pools and MTP
state (engine/parallel/dp_runner.py). A new request goes to the least-loaded rank. One step:

    driver:  schedule every rank ─scatter─▶ every rank executes its own SchedulerOutput ─gather─▶ update
                                             ╰── lock-step rounds + MoE all-to-alls ──╯

When no rank has anything to do the driver sends nothing and the workers wait in the control group's
receive: an idle group does not spin.
"""

from __future__ import annotations

import logging
import time

from engine.config.engine import EngineConfig
from engine.core.core import EngineStats
from engine.core.request import Request
from engine.core.scheduler import EngineCoreOutput, Scheduler
from engine.kv.manager import KVCacheManager
from engine.kv.offload import sum_stats
from engine.parallel.executor import MultiRankEngineCore

log = logging.getLogger(__name__)


class DPEngineCore(MultiRankEngineCore):
    def __init__(self, cfg: EngineConfig, check_outputs: bool | None = None, rank_pool=None):
        pc = cfg.parallel
        if not pc.enable_expert_parallel:
            log.info("data_parallel_size %d without enable_expert_parallel: every rank holds all routed experts "
                     "(replicated), the ranks share no collectives", pc.data_parallel_size)
        super().__init__(cfg, check_outputs, rank_pool)
        self.kvs, self.schedulers = [self.kv], [self.scheduler]
        for _ in range(1, pc.data_parallel_size):
            kv = KVCacheManager(self.kv.num_blocks, cfg.cache.block_size, 1, cfg.cache.enable_prefix_caching,
                                offload=self.new_offload_tier())  # every rank's offload buffer has rank 0's shape
            hisparse = getattr(self.runner, "hisparse", None)  # every rank's device pool has rank 0's shape
            if hisparse is not None:
                kv.device_footprint = hisparse.footprint()
            self.kvs.append(kv)
            self.schedulers.append(Scheduler(cfg.scheduler, kv, cfg.num_spec_tokens))
        self.rank_of: dict[str, int] = {}  # request -> its DP rank

    def _make_runner(self, cfg: EngineConfig):
        from engine.parallel.dp_runner import DPModelRunner

        return DPModelRunner(cfg, self.comm)

    # ---- requests --------------------------------------------------------------------------------
    def pick_rank(self) -> int:
        """The least-loaded rank: fewest requests (running + waiting), then most free KV blocks."""
        return min(range(len(self.schedulers)),
                   key=lambda r: (len(self.schedulers[r].running) + len(self.schedulers[r].waiting),
                                  -self.kvs[r].num_free_blocks, r))

    def validate(self, req: Request) -> None:
        if req.req_id in self.rank_of:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        super().validate(req)  # rank 0's scheduler: every rank's pool has the same size

    def add_request(self, req: Request, rank: int | None = None) -> None:
        self.validate(req)
        if not req.eos_token_ids:
            req.eos_token_ids = self.cfg.model.eos_token_ids
        rank = self.pick_rank() if rank is None else rank
        self.schedulers[rank].add_request(req)
        self.rank_of[req.req_id] = rank

    def abort(self, req_id: str) -> bool:
        rank = self.rank_of.pop(req_id, None)
        return rank is not None and self.schedulers[rank].abort(req_id)

    def reserve_import(self, req: Request, num_import_tokens: int):
        raise NotImplementedError("a DP group does not import KV yet: the decode service runs one engine per "
                                  "instance (data_parallel_size 1)")

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return [e for kv in self.kvs for e in kv.pool.drain_events()]

    def flush_kv_copies(self) -> None:
        """Every rank's queued KV offload copies, run by that rank's runner now (before a caller writes the
        blocks a rank reserved: call it after `schedulers[r].reserve_import`)."""
        by_rank = [kv.take_copies() for kv in self.kvs]
        if any(by_rank):
            self.collective_rpc("apply_rank_kv_copies", by_rank)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers)

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        scheds = [s.schedule() for s in self.schedulers]
        if all(s.is_empty and not s.finished_req_ids for s in scheds):
            return []
        self._send(("dpstep",))
        mine = self.comm.scatter_objects(scheds)
        results = self.comm.gather_objects(self.runner.execute(mine))
        outputs = []
        for sched_, sched, result in zip(self.schedulers, scheds, results):
            outputs += sched_.update(sched, result)
        for o in outputs:
            if o.finish_reason is not None:
                self.rank_of.pop(o.req_id, None)
        self.num_steps += 1
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def stats(self) -> EngineStats:
        """The group's figures: rank 0's (EngineCore.stats) plus the other ranks' counts; kv_usage is the mean."""
        total = super().stats()
        for s, kv in zip(self.schedulers[1:], self.kvs[1:]):
            total.num_running += len(s.running)
            total.num_waiting += len(s.waiting)
            total.num_held += len(s.held)
            total.num_free_blocks += kv.num_free_blocks
            total.num_blocks += kv.num_blocks
            total.prefix_queries += kv.prefix_queries
            total.prefix_hits += kv.prefix_hits
            total.num_preemptions += s.num_preemptions
            total.num_queued_tokens += sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
            for f in ("spec_drafts", "spec_accepted", "spec_steps", "spec_emitted"):
                setattr(total, f, getattr(total, f) + getattr(s, f))
        total.kv_usage = sum(kv.usage() for kv in self.kvs) / len(self.kvs)
        total.kv_offload = sum_stats([kv.offload_stats() for kv in self.kvs])
        return total
