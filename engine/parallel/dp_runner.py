"""The ModelRunner of one DP rank of a DP × EP group: its own requests, KV pages, HiSparse pools and MTP
state, with the routed experts split across the group (each rank holds 1/D of them, `MoE.dispatcher`
moves tokens by all-to-all; engine/parallel/ep.py).

Lock-step. Every forward pass (the target pass, then each MTP pass) starts with one small all-reduce
(max) of [this rank runs a pass, its token count] over the group: every rank learns whether anyone
runs a pass now and the padded token count (the largest). A rank whose step has no (more) passes
keeps joining rounds with [0, 0]; while another rank runs a pass it runs a dummy one — no rows through
every MoE layer of that pass, so the all-to-alls match — and the step ends for everyone at the first
round nobody runs a pass. Round 0 is the target pass, later rounds are MTP passes, so a dummy pass
always has the MoE layers of the real ones beside it. Each rank's acceptance decides only its own
tokens; the group only agrees on how many passes the step takes.

With replicated experts (DP without expert parallelism) the ranks share nothing and never sync.

The padded token count each round agrees on is kept (`padded_tokens`) but not used: these ranks run
eager, and each all-to-all is sized by the row counts the ranks exchange anyway, so padding a pass to
the group's largest would only add rows. It becomes the batch size once DP ranks run fixed-shape
(CUDA-graph) decode passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.kv.budget import num_kv_blocks
from engine.kv.cache import KVCacheSpec
from engine.loading.loader import build_model, dummy_init
from engine.model.moe import MoE
from engine.parallel.dist import RankComm
from engine.parallel.ep import AllToAllDispatcher, expert_shard
from engine.runner.model_runner import ModelRunner


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
    static_decode = False  # MoE all-to-alls of data-dependent sizes inside the pass: eager
    def __init__(self, cfg, comm: RankComm):
        self.comm, self.rank = comm, comm.rank
        pc, mc = cfg.parallel, cfg.model
        self.ep = pc.enable_expert_parallel and mc.n_routed_experts > 0
        model = build_rank_model(cfg, comm.rank, torch.device(cfg.device))
        if cfg.checkpoint is None:
            dummy_init(model, cfg.seed)
        spec = KVCacheSpec.from_model(mc, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                      indexer_precision=cfg.cache.indexer_precision, with_mtp=cfg.with_mtp)
        # the group's KV managers (in the driver) are sized alike: every rank takes the smallest pool
        super().__init__(cfg, num_blocks=comm.all_reduce_min(num_kv_blocks(cfg, spec)), model=model)
        self.main_moe = [m for m in self.model.model.modules() if isinstance(m, MoE)]
        self.mtp_moe = [m for m in self.model.mtp.modules() if isinstance(m, MoE)] if self.model.mtp else []
        if self.ep:
            dispatcher = AllToAllDispatcher(comm, mc.n_routed_experts)
            for m in self.main_moe + self.mtp_moe:
                m.dispatcher = dispatcher
        self._round = 0
        self.padded_tokens = 0  # the group's largest pass of the last round (what a fixed-shape pass pads to)
        self.dummy_passes = 0

    # ---- lock-step -----------------------------------------------------------------------------
    def _agree(self, runs: bool, num_tokens: int) -> bool:
        """One round: [runs a pass, tokens] max over the group -> whether anyone runs a pass."""
        t = torch.tensor([int(runs), num_tokens], dtype=torch.int64)
        self.comm._count("dp_sync", t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.control)
        self._round += 1
        self.padded_tokens = int(t[1])
        return bool(t[0])

    def _dummy_pass(self, layers: list[MoE]) -> None:
        """No rows through the MoE layers of a pass: this rank's side of the others' all-to-alls."""
        H, k = self.cfg.model.hidden_size, self.cfg.model.num_experts_per_tok
        x = torch.zeros((0, H), dtype=self.cfg.torch_dtype, device=self.device)
        w = torch.zeros((0, k), dtype=torch.float32, device=self.device)
        ids = torch.zeros((0, k), dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for m in layers:
                m.dispatcher(x, w, ids, m.experts)
        self.dummy_passes += 1

    def forward(self, rows):
        if self.ep:
            self._agree(True, sum(len(t) for _, _, t in rows))
        return super().forward(rows)

    def mtp_forward(self, rows, prev_hidden, keep=None, input_ids=None):
        if self.ep:
            self._agree(True, sum(len(t) for _, _, t in rows))
        return super().mtp_forward(rows, prev_hidden, keep, input_ids)

    def apply_rank_kv_copies(self, by_rank: list) -> None:
        """DPEngineCore.flush_kv_copies: this rank's own offload copies (by_rank[rank])."""
        if by_rank[self.rank]:
            self.apply_kv_copies(by_rank[self.rank])

    def execute(self, sched):
        self._round = 0
        out = super().execute(sched)
        while self.ep and self._agree(False, 0):  # others still run passes: join them with no rows
            self._dummy_pass(self.main_moe if self._round == 1 else self.mtp_moe)
        return out

    def run_step(self, sched: SchedulerOutput) -> RankStepResult:
        """One step of this rank's own requests (the "dpstep" message)."""
        return RankStepResult(self.execute(sched), self.hisparse_stats())

    def hisparse_stats(self):
        return self.hisparse.stats() if self.hisparse is not None else None
