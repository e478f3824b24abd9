"""The attention backend of a CP rank: wraps the engine's backend (torch or Triton) with the PCP
all-gathers, the DCP write mapping and the two DCP attention paths (step.py).

Per layer, with this rank computing its own rows only:
    store_kv / store_index_k   all-gather the new rows of every rank (PCP), write the ones this rank
                               keeps (all with DCP = 1, its shard with DCP = N) at their global slots
    indexer_topk / sparse_mla  DCP = 1: the inner backend on the local (complete) cache, own rows only;
                               DCP = N: prefill requests on the gathered context buffer, decode requests
                               through the sharded decode path
The model sees request-local positions everywhere, exactly as with one rank.
"""

from __future__ import annotations

import torch

from engine.attention.base import WrappingAttentionBackend
from engine.attention.metadata import AttnMetadata
from engine.parallel.step import CP_STEP, CPStep


class CPAttentionBackend(WrappingAttentionBackend):
    """indexer_rows_scored: query rows this rank ran the indexer for over a whole context (its 1/PCP of
    the prefill rows)."""

    name = "cp"

    def __init__(self, inner, comm):
        super().__init__(inner)
        self.topk_rows_ascending = False  # its top-k merges the ranks' shards: no row order promised
        self.comm = comm
        self.dcp_rows_scored = 0  # decode rows scored against this rank's key shard (DCP decode path)

    def begin_forward(self, meta: AttnMetadata) -> None:
        _step(meta)  # the rank runner's step builder attached the plan
        self.inner.begin_forward(meta)

    # ---- writes -------------------------------------------------------------------------------
    def store_kv(self, cache, layer: int, latent: torch.Tensor, k_rope: torch.Tensor, meta) -> None:
        step: CPStep = _step(meta)
        rows = step.rows.gather(self.comm, torch.cat([latent, k_rope], dim=-1), "pcp_kv")
        latent_all, rope_all = rows[:, : latent.shape[1]], rows[:, latent.shape[1]:]
        self.inner.store_kv(cache, layer, latent_all, rope_all, step.write_meta)
        if step.context is not None:
            step.context.after_store(layer)
            step.context.store_kv(self.inner, layer, latent_all, rope_all)

    def store_index_k(self, cache, layer: int, k: torch.Tensor, meta) -> None:
        step: CPStep = _step(meta)
        k_all = step.rows.gather(self.comm, k, "pcp_index")
        self.inner.store_index_k(cache, layer, k_all, step.write_meta)
        if step.context is not None:
            step.context.store_index_k(self.inner, layer, k_all)

    # ---- indexer -----------------------------------------------------------------------------
    def indexer_topk(self, cache, layer: int, q: torch.Tensor, weights: torch.Tensor, meta, topk: int) -> torch.Tensor:
        step: CPStep = _step(meta)
        if step.dcp_size == 1:
            if not q.shape[0]:  # this rank computes no rows in this step
                return torch.full((0, step.topk_width(topk)), -1, dtype=torch.int32, device=q.device)
            return self.inner.indexer_topk(cache, layer, q, weights, meta, topk)
        out = torch.full((q.shape[0], step.topk_width(topk)), -1, dtype=torch.int32, device=q.device)
        idx = step.own_prefill_idx
        if step.context is not None and idx.numel():
            sel = self.inner.indexer_topk(step.context.buffer(layer), layer, q[idx], weights[idx],
                                          step.context.own_meta, topk)
            out[idx, : sel.shape[1]] = sel
        decode_sel = None
        if step.decode is not None:
            didx = step.own_decode_idx
            before = step.decode.rows_scored
            decode_sel = step.decode.indexer_topk(cache, layer, q[didx], weights[didx], topk)
            self.dcp_rows_scored += step.decode.rows_scored - before
            own = decode_sel[step.decode.plan.own_rows]
            out[didx, : own.shape[1]] = own
        step.last_topk = (out, decode_sel)
        return out

    # ---- attention ---------------------------------------------------------------------------
    def sparse_mla(self, cache, layer: int, q: torch.Tensor, topk_pos: torch.Tensor, meta,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        step: CPStep = _step(meta)
        T, H, _ = q.shape
        if step.dcp_size == 1 and T:
            return self.inner.sparse_mla(cache, layer, q, topk_pos, meta, sm_scale)
        out = torch.zeros((T, H, self.spec.latent_dim), dtype=q.dtype, device=q.device)
        lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
        if step.dcp_size == 1:
            return out, lse
        idx = step.own_prefill_idx
        if step.context is not None:
            if idx.numel():
                o, l = self.inner.sparse_mla(step.context.buffer(layer), layer, q[idx], topk_pos[idx],
                                             step.context.own_meta, sm_scale)
                out[idx], lse[idx] = o.to(q.dtype), l
            step.context.release(layer)
        if step.decode is not None:
            didx = step.own_decode_idx
            kept_for, decode_sel = step.last_topk or (None, None)
            if kept_for is not topk_pos or decode_sel is None:  # not the indexer's output: gather it
                decode_sel = step.decode.gather_selection(topk_pos[didx])
            o, l = step.decode.sparse_mla(cache, layer, q[didx], decode_sel, sm_scale)
            out[didx], lse[didx] = o.to(q.dtype), l
        return out, lse


def _step(meta: AttnMetadata) -> CPStep:
    step = CP_STEP.get(meta)
    if step is None:
        raise RuntimeError("the CP backend needs the step plan on the metadata (CP_STEP; "
                           "engine.parallel.step.build_step puts it there)")
    return step
