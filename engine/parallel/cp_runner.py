"""The ModelRunner of one CP rank: same contract (execute(SchedulerOutput) -> RunnerOutput), with

* its own rows only (DualChunkSwap) through the model, and the CP attention backend around the engine's;
* `slot_fn` = the DCP write mapping (this rank's local slot, -1 for other ranks' tokens);
* expert parallelism: only its experts are allocated, `MoE.dispatcher` moves tokens by all-to-all;
* the final hidden rows gathered back into step order — only the rows something reads (sampling,
  prompt logits; every row when MTP runs) — so every rank samples the same tokens from the same bits.

Sampling: every rank runs the full sampler on the gathered (bit-identical) logits with identically
seeded generators advanced in the same order, so all ranks draw the same tokens and keep the same
request state (needed by MTP drafting on every rank) without broadcasting results.
"""

from __future__ import annotations

import torch

from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.kv.budget import num_kv_blocks
from engine.kv.cache import KVCacheSpec
from engine.loading.loader import build_model, dummy_init
from engine.model.moe import MoE
from engine.parallel.cp_backend import CPAttentionBackend
from engine.parallel.dcp import dcp_slot_fn
from engine.parallel.dist import RankComm
from engine.parallel.ep import AllToAllDispatcher, expert_shard
from engine.parallel.step import CPStep, build_step
from engine.runner.model_runner import ModelRunner


class CPModelRunner(ModelRunner):
    def __init__(self, cfg, comm: RankComm):
        self.comm, self.rank = comm, comm.rank
        pc, mc = cfg.parallel, cfg.model
        shard = (expert_shard(mc.n_routed_experts, comm.rank, comm.world_size)
                 if pc.enable_expert_parallel and mc.n_routed_experts else None)
        with_mtp = cfg.with_mtp
        model = build_model(mc, device=torch.device(cfg.device), dtype=cfg.torch_dtype, with_mtp=with_mtp,
                            checkpoint=cfg.checkpoint, expert_shard=shard)
        if cfg.checkpoint is None:
            dummy_init(model, cfg.seed)
        spec = KVCacheSpec.from_model(mc, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                      indexer_precision=cfg.cache.indexer_precision, with_mtp=with_mtp)
        # block ids name the same local block on every rank: every rank needs the same pool size
        num_blocks = comm.all_reduce_min(num_kv_blocks(cfg, spec))
        self.dcp_size, self.interleave = pc.decode_context_parallel_size, pc.cp_kv_cache_interleave_size
        super().__init__(cfg, num_blocks=num_blocks, model=model)
        if shard is not None:
            dispatcher = AllToAllDispatcher(comm, mc.n_routed_experts)
            for m in self.model.modules():
                if isinstance(m, MoE):
                    m.dispatcher = dispatcher
        # overlap layer l+1's DCP context all-gather with layer l (always; a plain attribute so that the
        # benchmarks can time it off beside on: bench.prefill.ranks.set_kv_prefetch)
        self.kv_prefetch = True
        self.main_layers = list(range(mc.num_hidden_layers))
        self.mtp_layers = [mc.mtp_layer_index]
        self._need_rows: list[int] | None = None

    # ---- the backend stack and write mapping of a CP rank ---------------------------------------
    static_decode = False  # the step plan (row split, DCP paths) is rebuilt per forward: eager

    def make_attention_backend(self):
        return CPAttentionBackend(super().make_attention_backend(), self.comm)

    def write_slot_fn(self):
        if self.dcp_size > 1:
            return dcp_slot_fn(self.rank, self.dcp_size, self.interleave)
        return super().write_slot_fn()

    # ---- forward passes ------------------------------------------------------------------------
    def forward(self, rows):
        own_ids, meta, step, layout = build_step(self, rows, self.main_layers)
        ctx = self.make_context(meta)
        with torch.inference_mode():
            own = self.model(own_ids, ctx)
        need = self._need_rows
        hidden = self._gather(step, own, need)
        if need is not None:  # rows nobody reads stay zero
            full = hidden.new_zeros((step.rows.num_rows, hidden.shape[1]))
            full[need] = hidden
            hidden = full
        return hidden, layout, ctx

    def mtp_forward(self, rows, prev_hidden: torch.Tensor, keep: list[int] | None = None,
                    input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids is not None:  # CP builds its own rows from host ids: read the drafts back here
            rows = [(st, start, ids) for (st, start, _), ids in zip(rows, _split(input_ids.tolist(), rows))]
        own_ids, meta, step, _ = build_step(self, rows, self.mtp_layers)
        own_idx = torch.tensor(step.rows.own_rows, dtype=torch.int64, device=prev_hidden.device)
        ctx = self.make_context(meta)
        with torch.inference_mode():
            own = self.model.mtp_forward(own_ids, prev_hidden[own_idx], ctx)
        return self._gather(step, own, keep)

    def _gather(self, step: CPStep, own: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        """Own output rows -> `rows` of the step (all when None), in that order, on every rank."""
        if rows is None:
            return step.rows.gather(self.comm, own, "hidden")
        wanted = sorted(set(rows))
        sub = step.rows.subset(wanted)
        want = set(wanted)
        mine = [i for i, r in enumerate(step.rows.own_rows) if r in want]
        got = sub.gather(self.comm, own[torch.tensor(mine, dtype=torch.int64, device=own.device)], "hidden")
        at = {r: i for i, r in enumerate(wanted)}
        return got[torch.tensor([at[r] for r in rows], dtype=torch.int64, device=own.device)]

    # ---- one step ------------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        super()._update_states(sched)
        for d in sched.new_requests:
            state = self.states[d.req_id]
            state.extra["prompt_logits"] = d.return_prompt_logits  # every rank gathers those rows
            if self.rank != 0:  # but only rank 0 computes and returns the logits
                state.return_prompt_logits = False
        self._need_rows = None if self.mtp is not None else self._rows_read(sched)

    def _rows_read(self, sched: SchedulerOutput) -> list[int]:
        """Step rows whose final hidden state is read: prompt-logit rows and sampled rows."""
        rows, at = [], 0
        for c in sched.chunks:
            n_known = len(c.token_ids) - c.num_draft_tokens
            if self.states[c.req_id].extra.get("prompt_logits"):
                rows.extend(range(at, at + len(c.token_ids)))
            elif c.sample:
                rows.extend(range(at + n_known - 1, at + len(c.token_ids)))
            at += len(c.token_ids)
        return rows

    def replicate_blocks(self, block_ids: list[int]) -> int:
        """Rank 0's rows of these cache blocks -> the same blocks on every rank: KV that was written into rank
        0's cache alone (a prefix loaded from a kvstore over NIXL) becomes the full replica every rank holds
        with DCP = 1. With DCP > 1 a block is sharded across ranks, so rank 0's block is not whole."""
        if self.dcp_size > 1:
            raise RuntimeError(f"DCP {self.dcp_size} shards every block across ranks: rank 0's blocks cannot be "
                               "replicated (load sharded KV rank by rank instead)")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
        for cache in (self.kv_cache.mla, self.kv_cache.index):
            rows = cache[idx].contiguous()
            self.comm.broadcast(rows.view(torch.uint8), "kv_replicate")  # bytes: any cache dtype, any backend
            cache[idx] = rows
        return len(block_ids)


def _split(flat: list[int], rows) -> list[list[int]]:
    out, at = [], 0
    for _, _, tokens in rows:
        out.append(flat[at: at + len(tokens)])
        at += len(tokens)
    return out


def rank_output_digest(out: RunnerOutput) -> tuple:
    """What must agree across ranks after a step: sampled tokens and MTP drafts."""
    return (tuple(sorted((k, tuple(v.token_ids)) for k, v in out.sampled.items())),
            tuple(sorted((k, tuple(v)) for k, v in out.drafts.items())))
