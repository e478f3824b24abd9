"""The Triton attention backend: the same contract as `TorchAttentionBackend`, run by the kernels in
`kernels/` (CUDA; on CPU they run in Triton's interpreter, which the tests use).

Selections cross the backend boundary as request-local positions [T, K] (int32, -1 padded), like the
torch backend's; the sparse kernel maps them to global slots through the block table as it loads them
(what `torch_backend.rows_to_slots` computes, with no ops of its own). No method synchronises with the
host: everything host-side comes from the metadata's `*_cpu` lists.
"""

from __future__ import annotations

import torch

from engine.attention.base import BaseAttentionBackend
from engine.attention.metadata import AttnMetadata
from engine.kv.cache import KVCacheSpec, PagedKVCache
from kernels.indexer import indexer_topk, store_index_k
from kernels.sparse_mla import sparse_mla
from kernels.store_kv import store_kv


class TritonAttentionBackend(BaseAttentionBackend):
    name = "triton"
    graph_safe = True  # with meta.max_seq_len_bound every launch is shaped by device tensors and the bound
    indexer_impl: str | None = None  # kernels.indexer's path: None picks (fused on sm_90+); benchmarks compare
    topk_rows_ascending = True  # every path of kernels.indexer.indexer_topk: HiSparse's plan merges its rows

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
        return sparse_mla(q, cache.mla_layer(layer), topk_pos, sm_scale, self.spec.latent_dim,
                          block_table=meta.block_table, token_req_idx=meta.token_req_idx)

