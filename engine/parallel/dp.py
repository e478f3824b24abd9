"""DPEngineCore: one engine of D data-parallel ranks (`data_parallel_size`), experts split across them with
`enable_expert_parallel`; the caller's process is rank 0 and drives the group.

Each DP rank serves its own requests: it has its own Scheduler and KV manager (kept here, in the driver,
one per rank: pure Python) and its own runner process with its own KV pages, HiSparse pools and MTP
state (engine/parallel/dp_runner.py). A new request goes to the rank the caller names (the decode service:
the DP rank whose instance the router chose), else to the least-loaded one. One step:

    driver:  schedule every rank, plan the step ─scatter─▶ every rank executes its own SchedulerOutput ─gather─▶ update
                                                          ╰── the planned passes' static dispatch (decode), or
                                                              lock-step rounds + dynamic all-to-alls ──╯
         (the gather also brings each rank's HiSparse figures: the group's stats need no extra round)

With async scheduling each rank launches the step it is sent before it reads back the one before, and the gather
brings that one's results: rank 0 plans step N + 1 from every rank's AsyncScheduler while N runs everywhere.

Imported KV (the decode service's pulls) goes into the pages of the rank that admitted the request:
`reserve_import(req, n, rank)` reserves them in that rank's KV manager; the bytes are written by that
rank's process (services/transfer/rank_pull.py).

When no rank has anything to do the driver sends nothing and the workers wait in the control group's
receive: an idle group does not spin.
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields, replace

from engine.config.engine import EngineConfig
from engine.core.async_scheduler import AsyncScheduler
from engine.core.core import EngineStats, scheduler_stats
from engine.core.request import Request
from engine.core.scheduler import EngineCoreOutput
from engine.kv.manager import KVCacheManager
from engine.kv.offload import sum_stats
from engine.parallel.dp_runner import DPModelRunner, StepPlan, plan_step
from engine.parallel.executor import MultiRankEngineCore

log = logging.getLogger(__name__)


class DPEngineCore(MultiRankEngineCore):
    def __init__(self, cfg: EngineConfig, check_outputs: bool = False, rank_pool=None):
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
            self.schedulers.append(AsyncScheduler(cfg.scheduler, kv, cfg.num_spec_tokens))
        self.rank_of: dict[str, int] = {}  # request -> its DP rank
        self.dp_steps = {"planned": 0, "dynamic": 0}  # steps that ran passes, by kind (dp_runner.py)
        # each rank's HiSparse figures as of its last step (rank 0's are read in place)
        self.rank_hisparse = self.collective_rpc("hisparse_stats") if cfg.hisparse is not None else []

    def _make_runner(self, cfg: EngineConfig):
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
        rank = self._rank(rank)
        if not req.eos_token_ids:
            req.eos_token_ids = self.cfg.model.eos_token_ids
        self.schedulers[rank].add_request(req)
        self.rank_of[req.req_id] = rank

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.pick_rank()
        if type(rank) is not int or not 0 <= rank < len(self.schedulers):
            raise ValueError(f"DP rank {rank!r} is outside this group of {len(self.schedulers)} ranks")
        return rank

    def abort(self, req_id: str) -> bool:
        rank = self.rank_of.pop(req_id, None)
        return rank is not None and self.schedulers[rank].abort(req_id)

    def reserve_import(self, req: Request, num_import_tokens: int, rank: int | None = None):
        """EngineCore.reserve_import on DP rank `rank` (default: the least loaded): the block ids returned are
        that rank's, and the caller writes the KV into that rank's pages."""
        if req.req_id in self.rank_of:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        rank = self._rank(rank)
        self._prepare_import(req)
        if self._inflight is not None:  # blocks a running step frees may still be written by it (EngineCore)
            self.collective_rpc("wait_in_flight")
        reserved = self.schedulers[rank].reserve_import(req, num_import_tokens)
        self.flush_kv_copies()  # that rank's process writes the blocks next: stores of evicted ones first
        if reserved is not None:
            self.rank_of[req.req_id] = rank
        return reserved

    def import_done(self, req_id: str, ok: bool, num_tokens: int | None = None) -> None:
        # by the scheduler, not rank_of: an abort during the transfer already dropped the request from rank_of
        sched = next((s for s in self.schedulers if req_id in s.importing), None)
        if sched is None:
            raise KeyError(f"request {req_id!r} is not importing KV on any DP rank")
        sched.import_done(req_id, ok, num_tokens)

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return [e for kv in self.kvs for e in kv.pool.drain_events()]

    def drain_rank_kv_events(self) -> list[list[tuple[str, bytes]]]:
        return [kv.pool.drain_events() for kv in self.kvs]

    def flush_kv_copies(self) -> None:
        """Every rank's queued KV offload copies, run by that rank's runner now (before the caller writes the
        blocks a rank reserved)."""
        by_rank = [kv.take_copies() for kv in self.kvs]
        if any(by_rank):
            self.collective_rpc("apply_rank_kv_copies", by_rank)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers) or self._inflight is not None

    def has_finished_to_drop(self) -> bool:
        return any(s.has_finished_to_drop for s in self.schedulers)

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule every rank, plan the step, run it on the group, apply. With async scheduling the step
        scheduled now is launched first and the outputs returned are those of the step before it: every rank
        launches its part, then reads back its previous one (engine/core/async_scheduler.py, per rank)."""
        t0 = time.perf_counter()
        scheds = [s.schedule() for s in self.schedulers]
        launch = not all(s.is_empty and not s.finished_req_ids for s in scheds)
        if not launch and self._inflight is None:
            return []
        plan = None
        if launch:
            plan = self.plan(scheds)
            if plan is None or plan.passes:
                self.dp_steps["dynamic" if plan is None else "planned"] += 1
        self._send(("dpstep", launch, self.async_scheduling))
        mine = self.comm.scatter_objects([(s, plan) for s in scheds]) if launch else None
        results = self.comm.gather_objects(self.runner.run_step(mine, self.async_scheduling))
        done = scheds
        if self.async_scheduling:  # the step launched before this one is what the ranks returned
            done, self._inflight = self._inflight, (scheds if launch else None)
        outputs = []
        if done is not None:
            if self.rank_hisparse:
                self.rank_hisparse = [r.hisparse for r in results]
            for sched_, sched, result in zip(self.schedulers, done, results):
                outputs += sched_.update(sched, result.output)
        for o in outputs:
            if o.finish_reason is not None:
                self.rank_of.pop(o.req_id, None)
        if launch:
            self.num_steps += 1
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def plan(self, scheds) -> StepPlan | None:
        """The group's plan of this step (engine/parallel/dp_runner.py): None runs it dynamically."""
        if not self.runner.planned:
            return None
        cfg = self.cfg
        return plan_step([[len(c.token_ids) for c in s.chunks] for s in scheds],
                         cfg.graphs.capture_sizes(cfg.scheduler.max_num_seqs), cfg.num_spec_tokens, cfg.with_mtp)

    def stats(self) -> EngineStats:
        """The group's figures (counts summed over the ranks, kv_usage the mean), each rank's in `dp_ranks`."""
        hisparse = getattr(self.runner, "hisparse", None)
        ranks = self.rank_hisparse[:]
        if hisparse is not None:
            ranks[0] = hisparse.stats()  # rank 0's in place: fresher than its last step's
        per_rank = [scheduler_stats(s, ranks[r] if ranks else None) for r, s in enumerate(self.schedulers)]
        total = EngineStats(**{f.name: getattr(per_rank[0], f.name) for f in fields(EngineStats)})
        for st in per_rank[1:]:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(st, name))
        total.kv_usage = sum(st.kv_usage for st in per_rank) / len(per_rank)
        total.hisparse = _sum_hisparse(ranks) if ranks else None
        total.kv_offload = sum_stats([st.kv_offload for st in per_rank])
        total.weight_bytes = tuple(r["weight_bytes"] for r in self.weight_reports())
        total.num_steps, total.step_seconds = self.num_steps, self.step_seconds
        total.dp_ranks = tuple(per_rank)
        total.dp_steps = dict(self.dp_steps)
        return total


_SUMMED = ("num_running", "num_waiting", "num_held", "num_free_blocks", "num_blocks", "prefix_queries", "prefix_hits",
           "num_preemptions", "num_queued_tokens", "spec_drafts", "spec_accepted", "spec_steps", "spec_emitted")


def _sum_hisparse(per_rank: list):
    """The group's HiSparse figures: every count summed over the ranks (the copy path is rank 0's)."""
    first = per_rank[0]
    return replace(first, **{f.name: sum(getattr(s, f.name) for s in per_rank)
                             for f in fields(first) if f.name != "copy_path"})
