"""The one contract every attention backend implements (torch, Triton, HiSparse, context parallel).

    builder        `metadata_builder(max_rows, max_reqs, max_blocks)`: a StaticMetadataBuilder whose
                   buffers are allocated once and refilled per step (padded to a capture bucket in decode)
    graph_safe     whether a decode forward over static metadata can be captured as a CUDA graph
    begin_forward  called once per forward, before the first layer: a wrapping backend attaches its
                   per-forward state to the metadata under its own typed key (`ForwardSlot`: the
                   attention package names no backend) and passes the call on to the backend it wraps
    pads_decode    whether decode forwards may be padded to a capture size (a backend that routes from
                   the metadata's host lists per forward says no)
    store_kv / store_index_k / indexer_topk / sparse_mla
                   the per-layer operations (selections cross the boundary as request-local positions
                   [T, K], int32, -1 padded)

Wrapping backends (HiSparse, CP) hold the backend they wrap in `inner`; the runner builds the stack
once (ModelRunner.make_attention_backend) and never swaps it afterwards.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.attention.metadata import AttnMetadata
from engine.attention.static import StaticMetadataBuilder
from engine.kv.cache import KVCacheSpec


@runtime_checkable
class AttentionBackend(Protocol):
    name: str
    spec: KVCacheSpec
    graph_safe: bool  # no host sync and no launch shaped by host lists when meta.max_seq_len_bound is set
    pads_decode: bool  # decode forwards may be padded to a capture size (padding rows write nowhere)

    @property
    def indexer_rows_scored(self) -> int: ...

    def metadata_builder(self, max_rows: int, max_reqs: int, max_blocks: int,
                         device: torch.device | str) -> StaticMetadataBuilder: ...

    def begin_forward(self, meta: AttnMetadata) -> None: ...

    def store_kv(self, cache, layer: int, latent: torch.Tensor, k_rope: torch.Tensor, meta: AttnMetadata) -> None: ...

    def store_index_k(self, cache, layer: int, k: torch.Tensor, meta: AttnMetadata) -> None: ...

    def indexer_topk(self, cache, layer: int, q: torch.Tensor, weights: torch.Tensor, meta: AttnMetadata,
                     topk: int) -> torch.Tensor: ...

    def sparse_mla(self, cache, layer: int, q: torch.Tensor, topk_pos: torch.Tensor, meta: AttnMetadata,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...


class BaseAttentionBackend:
    """What the leaf backends (torch, Triton) share: the static builder and a no-op begin_forward."""

    name = "base"
    graph_safe = False
    pads_decode = True
    topk_rows_ascending = False  # indexer_topk's valid positions come ascending in every row (then -1)

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.indexer_rows_scored = 0  # instrumented: query rows whose request needed indexer scores

    def metadata_builder(self, max_rows: int, max_reqs: int, max_blocks: int,
                         device: torch.device | str) -> StaticMetadataBuilder:
        return StaticMetadataBuilder(max_rows, max_reqs, max_blocks, self.spec.block_size, device)

    def begin_forward(self, meta: AttnMetadata) -> None:
        return None


class WrappingAttentionBackend:
    """What the wrapping backends (HiSparse, CP) share: the inner backend's builder and counters."""

    graph_safe = False  # their per-forward planning reads host state (CP step plans; HiSparse sets its own)

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.spec = inner.spec
        self.pads_decode = inner.pads_decode
        self.topk_rows_ascending = getattr(inner, "topk_rows_ascending", False)  # a wrapped wrapper passes it on

    @property
    def indexer_rows_scored(self) -> int:
        return self.inner.indexer_rows_scored

    def metadata_builder(self, max_rows: int, max_reqs: int, max_blocks: int,
                         device: torch.device | str) -> StaticMetadataBuilder:
        return self.inner.metadata_builder(max_rows, max_reqs, max_blocks, device)

    def begin_forward(self, meta: AttnMetadata) -> None:
        self.inner.begin_forward(meta)
