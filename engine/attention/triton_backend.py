"""The Triton attention backend: the same contract as `TorchAttentionBackend`, run by the kernels in
`kernels/` (CUDA; on CPU they run in Triton's interpreter, which the tests use).

Selections cross the backend boundary as request-local positions [T, K] (int32, -1 padded), like the
torch backend's; the sparse kernel maps them to global slots through the block table as it loads them
(what `torch_backend.rows_to_slots` computes, with no ops of its own). No method synchronises with the
host: everything host-side comes from the metadata's `*_cpu` lists.
"""

from __future__ import annotations

import torch

from engine import envs
from engine.attention.base import BaseAttentionBackend
from engine.attention.metadata import AttnMetadata
from engine.kv.cache import KVCacheSpec, PagedKVCache
from kernels import sparse_mla_sm90 as sm90
from kernels.indexer import indexer_topk, store_index_k
from kernels.sparse_mla import sparse_mla
from kernels.store_kv import gather_kv, store_kv

WORKSPACE_MAX_BYTES = 2 << 30  # the bf16 copy of a forward's pages: above this the fp8 pages are read in place


class TritonAttentionBackend(BaseAttentionBackend):
    name = "triton"
    graph_safe = True  # with meta.max_seq_len_bound every launch is shaped by device tensors and the bound
    indexer_impl: str | None = None  # kernels.indexer's path: None picks (fused on sm_90+); benchmarks compare

    def __init__(self, spec: KVCacheSpec):
        super().__init__(spec)  # indexer_rows_scored instrumented like the torch backend's

    # ---- writes -------------------------------------------------------------------------------
    def store_kv(self, cache: PagedKVCache, layer: int, latent: torch.Tensor, k_rope: torch.Tensor,
                 meta: AttnMetadata) -> None:
        store_kv(latent, k_rope, cache.mla_layer(layer), meta.slot_mapping)

    def store_index_k(self, cache: PagedKVCache, layer: int, k: torch.Tensor, meta: AttnMetadata) -> None:
        store_index_k(k, cache.index_layer(layer), meta.slot_mapping)

    # ---- indexer -----------------------------------------------------------------------------
    def indexer_topk(self, cache: PagedKVCache, layer: int, q: torch.Tensor, weights: torch.Tensor,
                     meta: AttnMetadata, topk: int) -> torch.Tensor:
        """q [T, H, D] float, weights [T, H] fp32 (scales folded) -> positions int32 [T, min(topk, max S)].

        Valid positions come first in ascending order (the torch backend orders them by score)."""
        if meta.max_seq_len_bound is not None:  # graph-capturable: one row per tile, built on the device
            bound = max(meta.max_seq_len_bound, 1)
            return indexer_topk(q, weights, cache.index_layer(layer), meta.block_table, meta.token_req_idx,
                                meta.positions, topk, return_slots=False, max_seq_len=bound,
                                out_width=min(topk, bound), impl=self.indexer_impl)
        K = min(topk, max(meta.max_seq_len, 1))
        qsl = meta.query_start_loc_cpu
        self.indexer_rows_scored += sum(qsl[b + 1] - qsl[b] for b, S in enumerate(meta.seq_lens_cpu) if S > topk)
        return indexer_topk(q, weights, cache.index_layer(layer), meta.block_table, meta.token_req_idx,
                            meta.positions, topk, return_slots=False, max_seq_len=max(meta.max_seq_len, 1),
                            query_start_loc_cpu=qsl, seq_lens_cpu=meta.seq_lens_cpu, out_width=K,
                            impl=self.indexer_impl)

    # ---- attention ---------------------------------------------------------------------------
    def sparse_mla(self, cache: PagedKVCache, layer: int, q: torch.Tensor, topk_pos: torch.Tensor,
                   meta: AttnMetadata, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, R+P] -> (out [T, H, R] in q's dtype, lse [T, H] fp32)."""
        kv = cache.mla_layer(layer)
        ws = self.prefill_workspace(kv, q, topk_pos, meta)
        if ws is not None:
            pages, table, kernel = ws
            return sparse_mla(q, pages, topk_pos, sm_scale, self.spec.latent_dim, block_table=table,
                              token_req_idx=meta.token_req_idx, kernel=kernel)
        return sparse_mla(q, kv, topk_pos, sm_scale, self.spec.latent_dim,
                          block_table=meta.block_table, token_req_idx=meta.token_req_idx)

    def prefill_workspace(self, kv: torch.Tensor, q: torch.Tensor, topk_pos: torch.Tensor,
                          meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor, str | None] | None:
        """With PDSERVE_PREFILL_BF16_WORKSPACE = n > 0, an eager forward of at least n query rows over fp8 pages
        reads a bf16 copy of its requests' pages: every block of the block table [B, W] dequantised once (exact:
        the scales are powers of two) into pages [B * W, page, R + P], addressed by the table 0 .. B * W - 1.
        Returns (pages, table, kernel: "sm90" where that kernel runs them, else None), or None: read in place."""
        rows = envs.prefill_bf16_workspace()
        if not rows or q.shape[0] < rows or kv.dtype != torch.uint8 or meta.max_seq_len_bound is not None:
            return None
        B, W = meta.block_table.shape
        page, R, P = kv.shape[1], self.spec.latent_dim, self.spec.rope_dim
        if B * W * page * (R + P) * 2 > WORKSPACE_MAX_BYTES:
            return None
        offsets = torch.arange(page, device=kv.device)
        slots = (meta.block_table.clamp(min=0).long()[..., None] * page + offsets).view(-1)
        pages = gather_kv(kv, slots, R, P, torch.bfloat16).view(B * W, page, R + P)
        table = torch.arange(B * W, dtype=torch.int32, device=kv.device).view(B, W)
        on_sm90 = (q.shape[-2] > 32 and sm90.eligible(q, pages, topk_pos, R, True, table, meta.token_req_idx) is None
                   and sm90.use_sm90() and sm90.library() is not None)
        return pages, table, "sm90" if on_sm90 else None

