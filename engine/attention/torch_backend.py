"""The reference attention backend: plain torch over the paged cache (CPU, and CUDA when asked).

It defines what every faster backend must compute. Per request it gathers the context rows once
(a dequantised workspace), scores all its query rows against it, and masks to each row's selection.
Selections are request-local positions [T, K] (int32, -1 padded): the representation that PCP, DCP and
HiSparse translate into their own row addresses.
"""

from __future__ import annotations

import torch

from engine.attention.base import BaseAttentionBackend
from engine.attention.metadata import AttnMetadata
from engine.kv.cache import KVCacheSpec, PagedKVCache
from kernels.formats import quantize_index_q_ref
from kernels.indexer import gather_index_k_ref, index_scores_ref, store_index_k_ref, topk_positions_ref
from kernels.sparse_mla import attend_rows_ref, sparse_mla_ref
from kernels.store_kv import gather_kv_ref, store_kv_ref

# Bound on Tq * H * S elements of one score tile (keeps CPU memory flat for long prompts).
_MAX_TILE = 1 << 24


class TorchAttentionBackend(BaseAttentionBackend):
    name = "torch"

    def __init__(self, spec: KVCacheSpec):
        super().__init__(spec)  # indexer_rows_scored: query rows this backend ran the indexer for

    # ---- writes -------------------------------------------------------------------------------
    def store_kv(self, cache: PagedKVCache, layer: int, latent: torch.Tensor, k_rope: torch.Tensor,
                 meta: AttnMetadata) -> None:
        store_kv_ref(latent, k_rope, cache.mla_layer(layer), meta.slot_mapping)

    def store_index_k(self, cache: PagedKVCache, layer: int, k: torch.Tensor, meta: AttnMetadata) -> None:
        store_index_k_ref(k, cache.index_layer(layer), meta.slot_mapping)

    # ---- indexer -----------------------------------------------------------------------------
    def indexer_topk(self, cache: PagedKVCache, layer: int, q: torch.Tensor, weights: torch.Tensor,
                     meta: AttnMetadata, topk: int) -> torch.Tensor:
        """q [T, H, D] float, weights [T, H] fp32 (scales folded) -> positions int32 [T, min(topk, max S)]."""
        K = min(topk, max(meta.max_seq_len, 1))
        if meta.max_seq_len <= topk:  # every request's whole causal context is selected
            return _causal_rows(meta.positions, K)
        out = torch.full((meta.num_tokens, K), -1, dtype=torch.int32, device=q.device)
        if self.spec.indexer_precision == "fp8":
            q, q_scale = quantize_index_q_ref(q)
            weights = weights * q_scale
        keys = cache.index_layer(layer)
        for b, (lo, hi) in enumerate(_row_ranges(meta)):
            if hi == lo:
                continue
            pos = meta.positions[lo:hi]
            S = meta.seq_lens_cpu[b]
            if S <= topk:  # every causal position is selected: no scores needed
                out[lo:hi] = _causal_rows(pos, K)
                continue
            self.indexer_rows_scored += hi - lo
            k_vals, k_scale = gather_index_k_ref(keys, meta.context_slots(b), self.spec.index_head_dim)
            for c0, c1 in _chunks(lo, hi, q.shape[1] * S):
                scores = index_scores_ref(q[c0:c1], weights[c0:c1], k_vals, k_scale)
                out[c0:c1] = topk_positions_ref(scores, meta.positions[c0:c1], topk)[:, :K]
        return out

    # ---- attention ---------------------------------------------------------------------------
    def sparse_mla(self, cache: PagedKVCache, layer: int, q: torch.Tensor, topk_pos: torch.Tensor,
                   meta: AttnMetadata, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, R+P] -> (out [T, H, R] in q's dtype, lse [T, H] fp32)."""
        T, H, D = q.shape
        kv = cache.mla_layer(layer)
        K = topk_pos.shape[1]
        if T * K * D <= _MAX_TILE:  # decode-like batches: all rows at once
            ws = _context_workspace(kv, topk_pos, meta, self.spec) if T * K > sum(meta.seq_lens_cpu) else None
            if ws is not None:
                # a short chunk over a long context: dequantise each request's context once and take the rows'
                # keys from it (the same values as dequantising them one by one, so the same bits, on any layout)
                return sparse_mla_ref(q, *ws, sm_scale, self.spec.latent_dim, self.spec.rope_dim)
            slots = rows_to_slots(meta, topk_pos)
            out, lse = sparse_mla_ref(q, kv, slots, sm_scale, self.spec.latent_dim, self.spec.rope_dim)
            return out, lse
        return self._sparse_mla_per_request(kv, q, topk_pos, meta, sm_scale)

    def _sparse_mla_per_request(self, kv: torch.Tensor, q: torch.Tensor, topk_pos: torch.Tensor,
                                meta: AttnMetadata, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Long prefills: one dequantised context workspace per request, masked to each row's selection."""
        T, H, _ = q.shape
        R = self.spec.latent_dim
        out = torch.zeros((T, H, R), dtype=torch.float32, device=q.device)
        lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
        for b, (lo, hi) in enumerate(_row_ranges(meta)):
            if hi == lo:
                continue
            S = meta.seq_lens_cpu[b]
            ctx = gather_kv_ref(kv, meta.context_slots(b), R, self.spec.rope_dim)
            for c0, c1 in _chunks(lo, hi, H * S):
                allowed = positions_mask(topk_pos[c0:c1], S)
                out[c0:c1], lse[c0:c1] = attend_rows_ref(q[c0:c1], ctx, allowed, sm_scale, R)
        return out.to(q.dtype), lse


def _context_workspace(kv: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                       spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every request's context dequantised once, in request order -> (workspace [Σ S, R+P] fp32, the rows'
    request-local positions [T, K] as workspace rows, -1 kept); None where a row selects a position past its
    request's context here (a context-parallel rank's shard: the rows' own slots are read instead)."""
    lens = torch.tensor(list(meta.seq_lens_cpu), dtype=torch.long, device=positions.device)
    req = meta.token_req_idx.long()
    if not int(lens.sum()) or not bool((positions < lens[req][:, None]).all()):
        return None
    ws = torch.cat([gather_kv_ref(kv, meta.context_slots(b), spec.latent_dim, spec.rope_dim)
                    for b in range(len(lens))])
    first = (torch.cumsum(lens, 0) - lens)[req][:, None]  # each row's request's first workspace row
    return ws, torch.where(positions >= 0, positions.long() + first, -1)


def rows_to_slots(meta: AttnMetadata, positions: torch.Tensor) -> torch.Tensor:
    """Request-local positions [T, K] (-1 padded) of each row's request -> global slots (-1 kept)."""
    valid = positions >= 0
    p = positions.clamp(min=0).long()
    blocks = meta.block_table.long()[meta.token_req_idx.long()[:, None], p // meta.block_size]
    slots = blocks * meta.block_size + p % meta.block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def positions_mask(sel: torch.Tensor, S: int) -> torch.Tensor:
    """Selections [Tq, K] (-1 padded) -> bool [Tq, S]."""
    idx = torch.where(sel >= 0, sel.long(), torch.full_like(sel, S, dtype=torch.long))
    mask = torch.zeros((sel.shape[0], S + 1), dtype=torch.bool, device=sel.device)
    mask.scatter_(1, idx, True)
    return mask[:, :S]


def _causal_rows(pos: torch.Tensor, K: int) -> torch.Tensor:
    cols = torch.arange(K, device=pos.device, dtype=torch.int64)
    return torch.where(cols[None, :] <= pos[:, None], cols[None, :], torch.full_like(cols, -1)[None, :]).to(torch.int32)


def _row_ranges(meta: AttnMetadata) -> list[tuple[int, int]]:
    q = meta.query_start_loc_cpu
    return [(q[i], q[i + 1]) for i in range(len(q) - 1)]


def _chunks(lo: int, hi: int, per_row: int):
    step = max(1, _MAX_TILE // max(per_row, 1))
    for c0 in range(lo, hi, step):
        yield c0, min(hi, c0 + step)
