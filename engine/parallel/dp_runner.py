"""The ModelRunner of one DP rank of a DP × EP group: its own requests, KV pages, HiSparse pools and MTP
state, with the routed experts split across the group (each rank holds 1/D of them, `MoE.dispatcher`
moves tokens to them and back; engine/parallel/ep.py). docs/dp_ep.md has the whole picture.

Two kinds of step, chosen by rank 0 for the whole group before the step (`plan_step`, sent with each rank's
SchedulerOutput in the scatter that starts the step):

    planned (decode)   every rank's chunks fit the static buffers (at most the largest capture size of
                       requests, at most 1 + the speculative tokens rows each): the plan fixes the step's
                       passes, (kind, rows) each, from the group's bucket G = the capture size of the largest
                       rank's batch: the target pass and the MTP catch-up with G · (1 + k) rows, then k - 1
                       draft passes of G rows. Every rank runs exactly these passes with the static dispatch
                       (fixed shapes, no host sync): its static batches are padded to G, so its captured
                       graphs replay (the whole step as one graph where it qualifies), an eager pass is padded
                       to the planned rows inside the dispatcher, and a rank with fewer passes (or none: idle)
                       runs the rest on padding. Nothing is agreed inside the step.
    dynamic            anything else (a prompt chunk, a batch past the capture sizes): the all-to-alls are
                       sized by exchanged counts; every forward pass starts with one small all-reduce (max)
                       of [this rank runs a pass, its rows] over the group, a rank without (more) passes joins
                       with [0, 0] and runs a dummy pass (no rows through every MoE layer of that pass) while
                       anyone else runs one, and the step ends at the first round nobody runs a pass. Round 0
                       is the target pass, later rounds are MTP passes. The static path is off for such a
                       step (its graphs hold the static dispatch).

`ParallelConfig.ep_decode_dispatch = "dynamic"` plans nothing: every step is dynamic, as before the static
dispatch. With replicated experts (DP without expert parallelism) the ranks share nothing and never sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.kv.budget import num_kv_blocks
from engine.kv.cache import KVCacheSpec
from engine.loading.loader import build_model, dummy_init
from engine.model.moe import MoE
from engine.parallel.dist import RankComm
from engine.parallel.ep import AllToAllDispatcher, StaticDispatcher, expert_shard
from engine.runner.model_runner import ModelRunner
from engine.runner.padded_batch import PaddedBatch


@dataclass(frozen=True)
class StepPlan:
    """A planned step: the group's bucket (padded requests per rank), rows per request of the verify pass, and
    every pass of the step in order, (kind, rows per rank): "target" or "mtp"."""

    bucket: int
    rows_per_req: int
    passes: tuple[tuple[str, int], ...] = field(default=())


def plan_step(chunk_rows: list[list[int]], sizes: list[int], num_spec_tokens: int, with_mtp: bool) -> StepPlan | None:
    """Rank 0's plan of a step from each rank's chunks' row counts (`chunk_rows[r]`), or None (dynamic)."""
    R = 1 + num_spec_tokens
    most = max((len(c) for c in chunk_rows), default=0)
    if most == 0:
        return StepPlan(0, R, ())  # nobody runs a pass
    if most > sizes[-1] or any(n > R or n < 1 for c in chunk_rows for n in c):
        return None
    G = next(s for s in sizes if s >= most)
    passes = [("target", G * R)]
    if with_mtp:
        passes += [("mtp", G * R)] + [("mtp", G)] * (num_spec_tokens - 1)
    return StepPlan(G, R, tuple(passes))


class GroupDispatcher:
    """`MoE.dispatcher` of a DP rank: the static dispatch in planned steps, the dynamic one otherwise."""

    def __init__(self, comm: RankComm, num_experts: int):
        self.dynamic = AllToAllDispatcher(comm, num_experts)
        self.static = StaticDispatcher(comm, num_experts)
        self.use_static = False

    def __call__(self, x, weights, ids, experts):
        return (self.static if self.use_static else self.dynamic)(x, weights, ids, experts)


@dataclass
class RankStepResult:
    """What a DP rank sends back for one step (gathered on rank 0): its RunnerOutput, and its HiSparse
    figures after the step (None without HiSparse), so the group's stats cost no extra round."""

    output: RunnerOutput
    hisparse: object | None = None  # engine.hisparse.HiSparseStats


def build_rank_model(cfg, rank: int, device: torch.device):
    """DP rank `rank`'s model: everything but the routed experts replicated, 1/D of those with expert
    parallelism (all of them without). On the meta device it only counts (memory planning, tests)."""
    pc, mc = cfg.parallel, cfg.model
    ep = pc.enable_expert_parallel and mc.n_routed_experts > 0
    shard = expert_shard(mc.n_routed_experts, rank, pc.data_parallel_size) if ep else None
    return build_model(mc, device=device, dtype=cfg.torch_dtype, with_mtp=cfg.with_mtp,
                       checkpoint=cfg.checkpoint if device.type != "meta" else None, expert_shard=shard)


class DPModelRunner(ModelRunner):
    def __init__(self, cfg, comm: RankComm, model=None):
        self.comm, self.rank = comm, comm.rank
        pc, mc = cfg.parallel, cfg.model
        self.ep = pc.enable_expert_parallel and mc.n_routed_experts > 0
        self.planned = self.ep and pc.ep_decode_dispatch == "static"
        self.static_decode = self.planned or not self.ep  # the dynamic dispatch cannot sit in a captured pass
        if model is None:
            model = build_rank_model(cfg, comm.rank, torch.device(cfg.device))
            if cfg.checkpoint is None:
                dummy_init(model, cfg.seed)
        self.main_moe = [m for m in model.model.modules() if isinstance(m, MoE)]
        self.mtp_moe = [m for m in model.mtp.modules() if isinstance(m, MoE)] if model.mtp else []
        self.dispatcher = GroupDispatcher(comm, mc.n_routed_experts) if self.ep else None
        for m in self.main_moe + self.mtp_moe:
            m.dispatcher = self.dispatcher
        self.plan: StepPlan | None = None  # the step being run, if planned
        self._pass = 0  # passes of the planned step run so far
        self._round = 0
        self.padded_tokens = 0  # the group's largest pass of the last dynamic round
        self.dummy_passes = 0  # passes run on padding only (a rank with fewer passes than the group's step)
        self.planned_steps = 0
        self.in_flight = None  # async scheduling in a group: the StepHandle of the step launched last
        self.dynamic_steps = 0
        if self.planned:
            _check_capture_set(cfg, comm)
        spec = KVCacheSpec.from_model(mc, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                      indexer_precision=cfg.cache.indexer_precision, with_mtp=cfg.with_mtp)
        if self.dispatcher is not None:
            self.dispatcher.use_static = self.planned  # start-up captures record the static dispatch
        # the group's KV managers (in the driver) are sized alike: every rank takes the smallest pool
        super().__init__(cfg, num_blocks=comm.all_reduce_min(num_kv_blocks(cfg, spec)), model=model)
        if self.dispatcher is not None:
            self.dispatcher.use_static = False

    # ---- lock-step -----------------------------------------------------------------------------
    def _agree(self, runs: bool, num_tokens: int) -> bool:
        """One round: [runs a pass, tokens] max over the group -> whether anyone runs a pass."""
        anyone, self.padded_tokens = self.comm.control_max([int(runs), num_tokens], "dp_sync")
        self._round += 1
        return bool(anyone)

    def _dummy_pass(self, layers: list[MoE]) -> None:
        """No rows through the MoE layers of a pass: this rank's side of the others' collectives."""
        H, k = self.cfg.model.hidden_size, self.cfg.model.num_experts_per_tok
        x = torch.zeros((0, H), dtype=self.cfg.torch_dtype, device=self.device)
        w = torch.zeros((0, k), dtype=torch.float32, device=self.device)
        ids = torch.zeros((0, k), dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for m in layers:
                m.dispatcher(x, w, ids, m.experts)
        self.dummy_passes += 1

    # ---- passes ----------------------------------------------------------------------------------
    def make_context(self, meta, rope_offset: int = 0):
        if self.dispatcher is not None:  # the padding rows of a static batch (slot -1) claim no expert
            self.dispatcher.static.row_valid = meta.slot_mapping >= 0
        return super().make_context(meta, rope_offset)

    def begin_pass(self, kind: str, rows: int | None) -> None:
        plan = self.plan
        if plan is None:
            return
        if kind == "step":  # the whole planned step as one graph (or its padded body): every pass at once
            self._pass = len(plan.passes)
            self.dispatcher.static.rows = None
            return
        if self._pass >= len(plan.passes):
            raise RuntimeError(f"DP rank {self.rank} runs pass {self._pass + 1} of a step planned with "
                               f"{len(plan.passes)}: {plan.passes}")
        want_kind, want_rows = plan.passes[self._pass]
        if kind != want_kind or (rows is not None and rows != want_rows):
            raise RuntimeError(f"DP rank {self.rank}'s pass {self._pass + 1} is ({kind}, {rows} rows); the group "
                               f"planned ({want_kind}, {want_rows})")
        self.dispatcher.static.rows = None if rows is not None else want_rows  # eager: padded in the dispatcher
        self._pass += 1

    def forward(self, rows):
        if self.ep and self.plan is None:
            self._agree(True, sum(len(t) for _, _, t in rows))
        return super().forward(rows)

    def mtp_forward(self, rows, prev_hidden, keep=None, input_ids=None):
        if self.ep and self.plan is None:
            self._agree(True, sum(len(t) for _, _, t in rows))
        return super().mtp_forward(rows, prev_hidden, keep, input_ids)

    def _finish_plan(self) -> None:
        """The planned passes this rank's step did not run, on padding: the whole step graph of the bucket
        when nothing ran yet and one is captured, else each pass on its own."""
        plan, st = self.plan, self.static
        sg = self.device_decode.step_graphs if self.device_decode is not None else None
        if self._pass == 0 and plan.passes and sg is not None and plan.bucket in sg.graphs:
            self.begin_pass("step", None)
            sg.run_padding(plan.bucket)
            self.dummy_passes += len(plan.passes)
            return
        H = self.cfg.model.hidden_size
        while self._pass < len(plan.passes):
            kind, rows = plan.passes[self._pass]
            if st is not None and st.pad:
                batch: PaddedBatch = st.dummy(plan.bucket, rows // plan.bucket)
                prev = torch.zeros((1, H), dtype=self.cfg.torch_dtype, device=self.device) if kind == "mtp" else None
                with torch.inference_mode():
                    st.run(kind, batch, prev)
                self.dummy_passes += 1
            else:
                self.begin_pass(kind, None)
                self.dispatcher.static.row_valid = None
                self._dummy_pass(self.main_moe if kind == "target" else self.mtp_moe)

    # ---- one step ------------------------------------------------------------------------------
    def apply_rank_kv_copies(self, by_rank: list) -> None:
        """DPEngineCore.flush_kv_copies: this rank's own offload copies (by_rank[rank])."""
        if by_rank[self.rank]:
            self.apply_kv_copies(by_rank[self.rank])

    def step_plan(self, sched: SchedulerOutput) -> StepPlan | None:
        """This step's plan when no driver sent one (the one-GPU emulation overrides it)."""
        return None

    def execute_async(self, sched: SchedulerOutput):
        if not self.ep:
            return super().execute_async(sched)
        plan = self.plan if self.plan is not None else self.step_plan(sched)
        self.plan, self._pass, self._round = plan, 0, 0
        self.dispatcher.use_static = plan is not None
        static = self.static
        if plan is None:
            self.static = None  # its graphs hold the static dispatch: this step runs eager
            self.dynamic_steps += 1
        elif plan.passes:
            if static is not None:
                static.force(plan.bucket, plan.rows_per_req)
            self.planned_steps += 1
        try:
            handle = super().execute_async(sched)
            if plan is None:
                while self._agree(False, 0):  # others still run passes: join them with no rows
                    self._dummy_pass(self.main_moe if self._round == 1 else self.mtp_moe)
            else:
                self._finish_plan()
        finally:
            self.static = static
            if static is not None:
                static.force(None)
            self.plan = None
            self.dispatcher.use_static = False
            self.dispatcher.static.rows = self.dispatcher.static.row_valid = None
        return handle

    def run_step(self, msg: tuple[SchedulerOutput, StepPlan | None] | None,
                 async_scheduling: bool = False) -> RankStepResult | None:
        """One step of this rank's own requests and the group's plan of it (the "dpstep" message). With async
        scheduling the step is launched and the result returned is the one of the step launched before it (None
        when none was in flight); `msg` None launches nothing (the group collects the step in flight)."""
        handle = None
        if msg is not None:
            sched, self.plan = msg
            handle = self.execute_async(sched)
        if not async_scheduling:
            return RankStepResult(handle.get(), self.hisparse_stats())
        done, self.in_flight = self.in_flight, handle
        return None if done is None else RankStepResult(done.get(), self.hisparse_stats())

    def wait_in_flight(self) -> None:
        """Until the step in flight (async scheduling) has run on the device: what it writes is written."""
        if self.in_flight is not None:
            self.in_flight.wait()

    def hisparse_stats(self):
        return self.hisparse.stats() if self.hisparse is not None else None

    def dp_stats(self) -> dict:
        return {"planned_steps": self.planned_steps, "dynamic_steps": self.dynamic_steps,
                "dummy_passes": self.dummy_passes}


def _check_capture_set(cfg, comm) -> None:
    """Every rank must plan and capture alike (the planned passes' shapes come from rank 0's sizes)."""
    mine = {"capture_sizes": cfg.graphs.capture_sizes(cfg.scheduler.max_num_seqs),
            "num_spec_tokens": cfg.num_spec_tokens, "mtp": cfg.with_mtp,
            "static_path": cfg.graphs.use_static_path(cfg.device), "hisparse": cfg.hisparse is not None}
    for r, theirs in enumerate(comm.all_gather_objects(mine)):
        if theirs != mine:
            raise ValueError(f"DP rank {r} joins the group with {theirs}, rank {comm.rank} has {mine}: every rank of "
                             "a DP x EP group must use the same capture sizes, speculative tokens and paths")
