"""MultiRankEngineCore: the EngineCore of a PCP x DCP x EP engine; the caller's process is rank 0.

Same interface as `engine.core.core.EngineCore` (add_request, validate, abort, step, has_unfinished, stats,
and the `scheduler` / `kv` / `runner` attributes): the scheduler and KV manager live on rank 0 only and
stay CP-agnostic (the manager's `dcp_size` gives virtual blocks of 64·N tokens). Each step rank 0
broadcasts the SchedulerOutput to the workers and every rank runs it; rank 0's RunnerOutput is the
step's result (all ranks sample the same tokens, see runner.py).

    rank 0 (caller):  schedule ─broadcast─▶ execute ─▶ update          workers: wait ─▶ execute ─▶ wait
                                              ╰──── per-layer collectives ────╯
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable

import torch

from engine.config.engine import EngineConfig
from engine.core.core import EngineCore
from engine.core.scheduler import EngineCoreOutput
from engine.parallel.cp_runner import CPModelRunner, rank_output_digest
from engine.parallel.dist import DistEnv, RankComm
from engine.parallel.spawn import RankPool, RankSpawner, started_by_torchrun
from engine.parallel.worker import call_rpc, check_rank_call


class MultiRankEngineCore(EngineCore):
    def __init__(self, cfg: EngineConfig, check_outputs: bool = False, rank_pool: RankPool | None = None):
        """`check_outputs`: after every step, check that all ranks sampled the same tokens (one extra small
        gather; tests and benchmarks turn it on). `rank_pool`: take idle ranks of this world size from it, and give
        them back at `shutdown`."""
        world = cfg.parallel.world_size
        if world < 2:
            raise ValueError("a multi-rank engine needs prefill_context_parallel_size or data_parallel_size >= 2; "
                             "use EngineCore")
        device = torch.device(cfg.device)
        self._closed = False
        self.rank_pool = rank_pool
        pooled = rank_pool.take(world, device.type) if rank_pool is not None else None
        if pooled is not None:
            self.spawner, self.comm = pooled
        else:
            self.spawner, self.comm = self._start_ranks(world, device)
        try:
            self.comm.broadcast_object(("engine", cfg))
            super().__init__(cfg, runner_factory=self._make_runner)
        except BaseException:
            self._abandon()
            raise
        self.check_outputs = check_outputs
        ref = weakref.ref(self)  # not a strong reference: the engine may be collected before exit
        atexit.register(lambda: ref() is not None and ref().shutdown())

    def _make_runner(self, cfg: EngineConfig):
        return CPModelRunner(cfg, self.comm)

    def _start_ranks(self, world: int, device: torch.device) -> tuple[RankSpawner | None, RankComm]:
        if torch.distributed.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one multi-rank engine "
                               "per process (shut the other down first: core.shutdown())")
        spawner = None
        if started_by_torchrun():
            env = DistEnv.from_environ()
            if env.world_size != world or env.rank != 0:
                raise ValueError(f"torchrun started rank {env.rank} of {env.world_size}; this engine needs rank 0 "
                                 f"of {world} (prefill_context_parallel_size)")
        else:
            spawner = RankSpawner(world, device.type)
            env = spawner.start()
        if device.type == "cuda":
            torch.cuda.set_device(env.local_rank)
        try:
            return spawner, RankComm(env, device)
        except BaseException:
            self.spawner = spawner
            self._abandon()
            raise

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids:
            return []
        self._send(("step", sched, self.check_outputs))
        result = self.runner.execute(sched)
        if self.check_outputs:
            digests = self.comm.all_gather_objects(rank_output_digest(result))
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            if bad:
                raise RuntimeError(f"ranks {bad} sampled differently from rank 0: {digests[bad[0]]} vs {digests[0]}")
        out = self.scheduler.update(sched, result)
        self.num_steps += 1
        self.step_seconds += time.perf_counter() - t0
        return out

    def flush_kv_copies(self) -> None:
        """EngineCore.flush_kv_copies on every rank: each copies its share of the blocks."""
        copies = self.kv.take_copies()
        if copies:
            self.collective_rpc("apply_kv_copies", copies)

    def collective_rpc(self, method: str | Callable, *args) -> list:
        """On every rank: the runner's method named `method`, or the function `method(runner, *args)` -> the
        results by rank. A function travels by reference (pickled as its module and name), so it must be
        defined at a module's top level; the ranks import its module when they first receive it."""
        check_rank_call(method)
        self._send(("rpc", method, args))
        results = self.comm.gather_objects(call_rpc(self.runner, method, args))
        for rank, (ok, value) in enumerate(results):
            if not ok:
                raise RuntimeError(f"rank {rank} failed in {method}:\n{value}")
        return [value for _, value in results]

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise RuntimeError("this multi-rank engine was shut down")
        if self.spawner is not None and self.spawner.dead_ranks():
            raise RuntimeError(f"worker ranks {self.spawner.dead_ranks()} died; see their stderr")
        self.comm.broadcast_object(msg)

    def _collect_weight_reports(self) -> list[dict]:
        return self.collective_rpc("weight_report")

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the worker ranks, or, for an engine built with a `rank_pool`, leave its spawned ranks idle in
        the pool for the next engine of the same world size in this process."""
        if self._closed:
            return
        self._closed = True
        alive = self.spawner is None or not self.spawner.dead_ranks()
        if self.rank_pool is not None and alive and self.spawner is not None:
            self.comm.broadcast_object(("release",))
            self.comm.reset_counters()
            self.rank_pool.put(self.cfg.parallel.world_size, self.comm.device.type, self.spawner, self.comm)
            return
        try:
            if alive:
                self.comm.broadcast_object(("shutdown",))
            self.comm.shutdown()
        finally:
            if self.spawner is not None:
                self.spawner.stop()

    def _abandon(self) -> None:
        """Start-up failed: nothing of ours may stay behind (the process group was not there before)."""
        self._closed = True
        if self.spawner is not None:
            self.spawner.kill()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
