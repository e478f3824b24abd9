"""EngineCore: scheduler + runner, stepped by the offline LLM, the AsyncEngine and the services."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config.engine import EngineConfig
from engine.core.async_scheduler import AsyncScheduler
from engine.core.request import Request
from engine.core.scheduler import EngineCoreOutput, Scheduler
from engine.kv.export import KVExport, kv_exports
from engine.kv.manager import KVCacheManager
from engine.kv.offload import OffloadTier
from engine.structured.grammar import engine_backend

log = logging.getLogger(__name__)

# EngineCore.step's phases: schedule (plan the step), launch (the runner builds its inputs and queues its work),
# device_wait (blocked on the device for a step's read-back: the device's time not hidden behind the host's),
# read_back (the step's tokens to host lists and outputs), update (the scheduler applies them)
STEP_PHASES = ("schedule", "launch", "device_wait", "read_back", "update")
# the engine thread's CPU time (time.thread_time) in the phases it computes in; a phase's wall time above its CPU
# time is time the thread did not run (waiting for the interpreter lock, descheduled, blocked in a call)
CPU_PHASES = ("schedule", "launch", "update")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_queries: int
    prefix_hits: int
    spec_drafts: int
    spec_accepted: int
    spec_steps: int
    spec_emitted: int
    num_preemptions: int
    num_queued_tokens: int = 0  # prompt tokens of waiting requests still to compute (a load figure)
    hisparse: object | None = None  # engine.hisparse.HiSparseStats when HiSparse is on
    kv_offload: object | None = None  # engine.kv.offload.KVOffloadStats with --kv-offloading-size
    weight_bytes: tuple = ()  # per rank: {dtype name: bytes} of its weights (engine.loading.weight_stats)
    num_steps: int = 0  # steps that ran a forward
    step_seconds: float = 0.0  # their wall time, summed (schedule + forward + update)
    # that wall time by phase, summed (STEP_PHASES; docs/async_scheduling.md, "Where a step's host time goes"):
    # one-rank engines only (zeros for the multi-rank core, empty for a DP group)
    step_phase_seconds: dict = field(default_factory=dict)
    step_phase_cpu_seconds: dict = field(default_factory=dict)  # CPU_PHASES: the engine thread's CPU time, summed
    dp_ranks: tuple = ()  # a DP group (engine/parallel/dp.py): each rank's own EngineStats; the fields above
    # are then the group's (counts summed, kv_usage the mean)
    dp_steps: dict = field(default_factory=dict)  # a DP x EP group's steps by kind: planned / dynamic

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_drafts if self.spec_drafts else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus token)."""
        return self.spec_emitted / self.spec_steps if self.spec_steps else 0.0


class EngineCore:
    """`runner_factory(cfg)` builds the runner (engine.runner.ModelRunner, or a rank's runner): the core knows
    it only through what it calls (execute / execute_async, kv_cache, weight_report, ...), and
    engine.frontend.core_factory picks it."""

    def __init__(self, cfg: EngineConfig, runner_factory: Callable[[EngineConfig], object]):
        self.cfg = cfg
        # the runner sizes the KV pool after loading the weights (what is left of the memory budget)
        self.runner = runner_factory(cfg)
        self.kv = KVCacheManager(self.runner.kv_cache.num_blocks, cfg.cache.block_size,
                                 cfg.parallel.decode_context_parallel_size, cfg.cache.enable_prefix_caching,
                                 offload=self.new_offload_tier())
        hisparse = getattr(self.runner, "hisparse", None)
        if hisparse is not None:  # admission by host blocks (the pool above) and by device room
            self.kv.device_footprint = hisparse.footprint()
        # the scheduler plans like the synchronous one while no step is in flight, and ahead of the one in
        # flight with async scheduling; the mode may change between steps with none in flight (benchmarks)
        self.async_scheduling = cfg.scheduler.async_scheduling
        self.scheduler = AsyncScheduler(cfg.scheduler, self.kv, cfg.num_spec_tokens)
        self._inflight = None  # async scheduling: (SchedulerOutput, the runner's StepHandle) still running
        self.num_steps, self.step_seconds = 0, 0.0
        self.last_step_forward = False
        self.step_phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self.step_phase_cpu_seconds = dict.fromkeys(CPU_PHASES, 0.0)

    def new_offload_tier(self) -> OffloadTier | None:
        """The bookkeeping of the runner's KV offload buffer (one per KV manager), None without one. Every
        rank of a CP engine holds a buffer alike: a block's bytes are those of all of them."""
        buf = getattr(self.runner, "kv_offload", None)
        return buf.tier(self.cfg.parallel.prefill_context_parallel_size) if buf is not None else None

    def validate(self, req: Request) -> None:
        """Raise ValueError for a request the engine cannot serve (nothing is changed)."""
        vocab, ids = self.cfg.model.vocab_size, req.prompt_token_ids
        # the fast check first (a 1M-token prompt is on the TTFT path); `type is int` also rejects bools
        if not (all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab))):
            bad = [t for t in ids if not (type(t) is int and 0 <= t < vocab)]
            raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        self.scheduler.validate(req)
        self._check_structured(req)

    def _check_structured(self, req: Request) -> None:
        """A structured output must compile for this model's tokenizer (ValueError names why not)."""
        spec = req.sampling_params.structured_outputs
        if spec is not None:
            engine_backend(self.cfg).compile(spec)

    def add_request(self, req: Request) -> None:
        self.validate(req)
        if not req.eos_token_ids:
            req.eos_token_ids = self.cfg.model.eos_token_ids
        self.scheduler.add_request(req)

    def abort(self, req_id: str) -> bool:
        return self.scheduler.abort(req_id)

    # ---- disaggregation hooks (services/prefill, services/decode) --------------------------------
    def reserve_import(self, req: Request, num_import_tokens: int) -> tuple[list[int], int] | None:
        """Admit a request whose first `num_import_tokens` tokens' KV the caller writes (see Scheduler)."""
        self._prepare_import(req)
        if self._inflight is not None:
            # blocks freed while a step runs (a request it ends) may still be written by it; the caller's
            # transfer into them is not ordered behind the GPU's work, so that step must be done first
            self._inflight[1].wait()
        reserved = self.scheduler.reserve_import(req, num_import_tokens)
        self.flush_kv_copies()  # the caller writes the reserved blocks next: stores of evicted ones first
        return reserved

    def _prepare_import(self, req: Request) -> None:
        vocab = self.cfg.model.vocab_size
        if any(not (0 <= t < vocab) for t in req.all_token_ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")
        self._check_structured(req)
        if not req.eos_token_ids:
            req.eos_token_ids = self.cfg.model.eos_token_ids

    def flush_kv_copies(self) -> None:
        """Run the KV offload copies the KV manager queued outside a step now (they are done on return)."""
        copies = self.kv.take_copies()
        if copies:
            self.runner.apply_kv_copies(copies)

    def import_done(self, req_id: str, ok: bool, num_tokens: int | None = None) -> None:
        self.scheduler.import_done(req_id, ok, num_tokens)

    def held_block_ids(self, req_id: str) -> list[int]:
        """Blocks of a finished request kept for export (`Request.hold_kv_on_finish`)."""
        return self.scheduler.held_block_ids(req_id)

    def kv_exports(self, req_id: str) -> list[KVExport]:
        """Which ranks hold a held request's KV, and at which blocks (engine/kv/export.py)."""
        pc = self.cfg.parallel
        return kv_exports(self.held_block_ids(req_id), pc.decode_context_parallel_size,
                          pc.cp_kv_cache_interleave_size)

    def held_exports(self, req_ids: list[str]) -> dict[str, list[KVExport]]:
        """`kv_exports` of those of `req_ids` whose KV is held for export (the others left out): read right after
        the step that finished them, so a service exporting them needs no other call between two steps."""
        held = self.scheduler.held
        return {r: self.kv_exports(r) for r in req_ids if r in held}

    def release_held(self, req_id: str) -> bool:
        return self.scheduler.release_held(req_id)

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        """("stored" | "removed", 16-byte block hash) since the last call, for the Redis prefix index."""
        return self.kv.pool.drain_events()

    def drain_rank_kv_events(self) -> list[list[tuple[str, bytes]]]:
        """`drain_kv_events` per rank with a pool of its own (a DP group's ranks; here one)."""
        return [self.drain_kv_events()]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    @property
    def in_flight(self) -> bool:
        """Async scheduling: a step was launched whose result is not applied yet."""
        return self._inflight is not None

    def has_finished_to_drop(self) -> bool:
        """Finished requests the runner has not dropped yet (one more step hands it their ids)."""
        return self.scheduler.has_finished_to_drop

    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule, run, apply. With async scheduling the step scheduled now is launched first
        and the outputs returned are the previous step's (docs/async_scheduling.md)."""
        clock, cpu = time.perf_counter, time.thread_time
        t0, c0 = clock(), cpu()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids:
            sched = None
        t1, c1 = clock(), cpu()
        if not self.async_scheduling:
            if sched is None:
                return []
            handle = self.runner.execute_async(sched)
            t2, c2 = clock(), cpu()
            result, wait = _read_back(handle)
            t3, c3 = clock(), cpu()
            out = self.scheduler.update(sched, result)
        else:
            if sched is None and self._inflight is None:
                return []
            launched = (sched, self.runner.execute_async(sched)) if sched is not None else None
            t2, c2 = clock(), cpu()
            t3, c3 = t2, c2
            out, wait = [], 0.0
            if self._inflight is not None:  # N+1 is queued behind it: reading N's tokens keeps the GPU busy
                prev_sched, handle = self._inflight
                result, wait = _read_back(handle)
                t3, c3 = clock(), cpu()
                out = self.scheduler.update(prev_sched, result)
            self._inflight = launched
        t4, c4 = clock(), cpu()
        if sched is not None:
            self.num_steps += 1
        self.last_step_forward = sched is not None and not sched.is_empty  # not a step that only drops finished ids
        self.step_seconds += t4 - t0
        ph = self.step_phase_seconds
        for name, secs in zip(STEP_PHASES, (t1 - t0, t2 - t1, wait, t3 - t2 - wait, t4 - t3)):
            ph[name] += secs
        pc = self.step_phase_cpu_seconds
        for name, secs in zip(CPU_PHASES, (c1 - c0, c2 - c1, c4 - c3)):
            pc[name] += secs
        return out

    def stats(self) -> EngineStats:
        hisparse = getattr(self.runner, "hisparse", None)
        st = scheduler_stats(self.scheduler, hisparse.stats() if hisparse is not None else None)
        st.weight_bytes = tuple(r["weight_bytes"] for r in self.weight_reports())
        st.num_steps, st.step_seconds = self.num_steps, self.step_seconds
        st.step_phase_seconds = dict(self.step_phase_seconds)
        st.step_phase_cpu_seconds = dict(self.step_phase_cpu_seconds)
        return st

    def weight_reports(self) -> list[dict]:
        """Per rank: weight bytes by dtype and what loading read (engine.loading.weight_stats); fixed after load."""
        if getattr(self, "_weight_reports", None) is None:
            self._weight_reports = self._collect_weight_reports()
        return self._weight_reports

    def _collect_weight_reports(self) -> list[dict]:
        return [self.runner.weight_report()]


def _read_back(handle):
    """(the step's RunnerOutput, seconds get() spent blocked on the device)."""
    before = handle.wait_seconds
    result = handle.get()
    return result, handle.wait_seconds - before


def scheduler_stats(s: Scheduler, hisparse=None) -> EngineStats:
    """The figures of one scheduler and its KV manager (one rank's requests and pool)."""
    kv = s.kv
    return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting), num_held=len(s.held),
                       kv_usage=kv.usage(), num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks,
                       prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits, spec_drafts=s.spec_drafts,
                       spec_accepted=s.spec_accepted, spec_steps=s.spec_steps, spec_emitted=s.spec_emitted,
                       num_preemptions=s.num_preemptions,
                       num_queued_tokens=sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
                       hisparse=hisparse, kv_offload=kv.offload_stats())

