"""DCP decode path: attention for few new rows over a context sharded across the ranks.

Nothing of the context moves. Per full layer every rank scores *all* ranks' decode rows against its
own indexer keys, proposes its local top-k (score, global position), the candidates are all-gathered
and every rank takes the same global top-k — the set a single rank would pick, ties to the lower
position. Per layer every rank then attends the part of each row's selection it owns, giving partials
(out_r, lse_r), merged exactly onto the row's owner (`ag_rs` or `a2a`, dcp.py).

    decode rows: gathered in step order [T_d]  (queries, indexer queries: a few rows x heads)
    local view:  request b's shard is an ordinary paged sequence of num_local(S_b) rows; a row at
                 global position p may see local indices < num_local(p + 1)
"""

from __future__ import annotations

import torch

from engine.attention.metadata import build_metadata
from engine.parallel.dcp import (
    MERGES,
    global_position,
    local_index,
    local_topk_candidates,
    merge_topk_candidates,
    num_local,
    owner_rank,
)
from kernels.formats import quantize_index_q_ref
from kernels.indexer import gather_index_k_ref, index_scores_ref

_MAX_TILE = 1 << 24  # Tq * H * S elements of one score tile


class DecodeAttention:
    def __init__(self, step, comm, inner, merge_backend: str):
        self.step, self.comm, self.inner = step, comm, inner
        self.merge = MERGES[merge_backend]
        self.spec = inner.spec
        self.requests = [r for r in step.requests if r.decode]
        rows = [row for r in self.requests for row in range(r.row_start, r.row_start + r.num_rows)]
        self.plan = step.rows.subset(rows)  # decode rows only, renumbered in step order
        self.row_ranges, positions, at = [], [], 0
        for r in self.requests:
            self.row_ranges.append((at, at + r.num_rows))
            positions.extend(range(r.start, r.seq_len))
            at += r.num_rows
        device = step.write_meta.positions.device
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        N, I, rank = step.dcp_size, step.interleave, step.rank
        self.local_meta = build_metadata(
            positions=[num_local(p + 1, rank, N, I) - 1 for p in positions], slot_mapping=[-1] * len(positions),
            query_lens=[r.num_rows for r in self.requests],
            seq_lens=[num_local(r.seq_len, rank, N, I) for r in self.requests],
            block_tables=[r.block_ids for r in self.requests], block_size=self.spec.block_size, device=device)
        self.rows_scored = 0  # instrumented: decode rows this rank scored against its key shard

    # ---- indexer -------------------------------------------------------------------------------
    def indexer_topk(self, cache, layer: int, q: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
        """Own decode rows' q [n, Hi, D], weights [n, Hi] -> global selection of every decode row
        [T_d, K] (K = min(topk, longest context)); the caller takes its own rows."""
        q_all = self.plan.gather(self.comm, q.float(), "dcp_q")
        w_all = self.plan.gather(self.comm, weights.float(), "dcp_q")
        width = min(topk, max(r.seq_len for r in self.requests))
        cols = torch.arange(width, device=q.device, dtype=torch.int64)
        sel = torch.where(cols[None, :] <= self.positions[:, None], cols[None, :], -1).to(torch.int32)
        scored = [i for i, r in enumerate(self.requests) if r.seq_len > topk]
        if scored:  # the same on every rank: the collective below is called by all or none
            merged = self._global_topk(cache, layer, q_all, w_all, topk, scored)
            for i in scored:
                lo, hi = self.row_ranges[i]
                sel[lo:hi] = merged[lo:hi, :width]
        return sel

    def _global_topk(self, cache, layer, q, w, topk: int, scored: list[int]) -> torch.Tensor:
        s = self.step
        if self.spec.indexer_precision == "fp8":
            q, q_scale = quantize_index_q_ref(q)
            w = w * q_scale
        cand_s = torch.full((q.shape[0], topk), float("-inf"), dtype=torch.float32, device=q.device)
        cand_p = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        keys, bs = cache.index_layer(layer), self.spec.block_size
        for i in scored:
            r, (lo, hi) = self.requests[i], self.row_ranges[i]
            j = torch.arange(num_local(r.seq_len, s.rank, s.dcp_size, s.interleave), device=q.device)
            table = torch.tensor(r.block_ids, dtype=torch.int64, device=q.device)
            k_vals, k_scale = gather_index_k_ref(keys, table[j // bs] * bs + j % bs, self.spec.index_head_dim)
            gpos = global_position(j, s.rank, s.dcp_size, s.interleave)
            step_rows = max(1, _MAX_TILE // max(q.shape[1] * j.numel(), 1))
            for c0 in range(lo, hi, step_rows):
                c1 = min(hi, c0 + step_rows)
                scores = index_scores_ref(q[c0:c1], w[c0:c1], k_vals, k_scale)
                scores = scores.masked_fill(gpos[None, :] > self.positions[c0:c1, None], float("-inf"))
                cand_s[c0:c1], cand_p[c0:c1] = local_topk_candidates(scores, gpos, topk)
            self.rows_scored += hi - lo
        packed = torch.stack([cand_s, cand_p.to(torch.int32).view(torch.float32)], dim=-1)
        got = self.comm.all_gather(packed, "dcp_cand").view(s.dcp_size, *packed.shape)
        return merge_topk_candidates(got[..., 0], got[..., 1].contiguous().view(torch.int32), topk)

    def gather_selection(self, own_sel: torch.Tensor) -> torch.Tensor:
        """Own decode rows' selection -> every decode row's (when it was not kept from the indexer)."""
        return self.plan.gather(self.comm, own_sel, "dcp_q")

    # ---- attention -----------------------------------------------------------------------------
    def sparse_mla(self, cache, layer: int, q: torch.Tensor, sel: torch.Tensor,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Own decode rows' q [n, H, R+P], every decode row's global selection [T_d, K]
        -> own rows' (out [n, H, R] fp32, lse [n, H]) merged over the ranks."""
        s = self.step
        q_all = self.plan.gather(self.comm, q, "dcp_q")
        sel = sel.long()
        mine = (sel >= 0) & (owner_rank(sel, s.dcp_size, s.interleave) == s.rank)
        local = torch.where(mine, local_index(sel, s.dcp_size, s.interleave), torch.full_like(sel, -1))
        out, lse = self.inner.sparse_mla(cache, layer, q_all, local.to(torch.int32), self.local_meta, sm_scale)
        world, max_rows = s.dcp_size, self.plan.max_rows
        pad_out = out.new_zeros((world * max_rows, *out.shape[1:]), dtype=torch.float32)
        pad_lse = torch.full((world * max_rows, lse.shape[1]), float("-inf"), dtype=torch.float32, device=lse.device)
        pad_out[self.plan.gather_index] = out.float()
        pad_lse[self.plan.gather_index] = lse.float()
        return self.merge(self.comm, pad_out, pad_lse, max_rows, self.plan.num_own)
