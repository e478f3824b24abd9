"""DCP prefill path: the whole context of the step's prefill requests in a temporary buffer, per layer.

Persistent KV is sharded over the ranks (dcp.py); a prefill query needs its full context. Per layer,
every rank all-gathers the raw cache rows of the prior context [0, start) of each prefill request
(MLA row and, on full layers, the indexer key, as bytes: one collective, no requantisation), scatters
them into a temporary paged buffer, adds the step's new rows (all-gathered by PCP), and the inner
attention backend runs on that buffer as on an ordinary cache. The buffer is dropped after the layer.

    temp blocks of request b:  [ off_b ........................ off_b + ceil(S_b / 64) )
    positions:                 | prior [0, start_b): from every rank | new [start_b, S_b) |

With prefetch on, layer l+1's gather is issued asynchronously on the prefetch group right after layer
l's new rows are written, so it overlaps with layer l's indexer, attention and MLP.
"""

from __future__ import annotations

import bisect

import torch

from engine.attention.metadata import AttnMetadata, build_metadata
from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.parallel.dcp import global_position, num_local
from kernels.formats import read_index_rows, write_index_rows


class LayerBuffer:
    """One layer's temporary context; quacks like a PagedKVCache for the inner backend."""

    def __init__(self, spec: KVCacheSpec, layer: int, mla: torch.Tensor, index: torch.Tensor | None):
        self.spec, self.layer, self.mla, self.index = spec, layer, mla, index

    def mla_layer(self, layer: int) -> torch.Tensor:
        assert layer == self.layer, f"buffer of layer {self.layer} used for layer {layer}"
        return self.mla

    def index_layer(self, layer: int) -> torch.Tensor:
        assert layer == self.layer and self.index is not None, f"layer {layer} has no indexer buffer"
        return self.index


class ContextGather:
    def __init__(self, step, cache: PagedKVCache, comm, prefetch: bool):
        self.step, self.cache, self.comm, self.prefetch = step, cache, comm, prefetch
        self.spec = cache.spec
        self.device = cache.device
        self.requests = [r for r in step.requests if not r.decode]
        self._init_layout()
        self._init_exchange()
        self._init_new_rows()
        self._init_own_meta()
        self.pending: dict[int, tuple] = {}
        self.built: dict[int, LayerBuffer] = {}
        if prefetch:
            self.issue(step.layer_ids[0])

    # ---- plan (same on every rank) ---------------------------------------------------------------
    def _init_layout(self) -> None:
        bs = self.spec.block_size
        self.offsets, self.tables = [], []
        num_blocks = 0
        for r in self.requests:
            n = -(-r.seq_len // bs)
            self.offsets.append(num_blocks)
            self.tables.append(list(range(num_blocks, num_blocks + n)))
            num_blocks += n
        self.num_blocks = max(num_blocks, 1)

    def _init_exchange(self) -> None:
        """Send list (this rank's prior rows, by request then local index) and where every rank's
        rows land in the buffer."""
        s, bs, dev = self.step, self.spec.block_size, self.device
        N, I = s.dcp_size, s.interleave
        counts = [sum(num_local(r.start, k, N, I) for r in self.requests) for k in range(N)]
        self.max_prior = max(counts)
        # index math on the device: contexts of 10^5..10^6 rows make host tensors the step's bottleneck
        send, slots = [], []
        for k in range(N):
            for r, off in zip(self.requests, self.offsets):
                j = torch.arange(num_local(r.start, k, N, I), dtype=torch.int64, device=dev)
                slots.append(off * bs + global_position(j, k, N, I))
                if k == s.rank and j.numel():
                    table = torch.tensor(r.block_ids, dtype=torch.int64).to(dev)
                    send.append(table[j // bs] * bs + j % bs)
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self.send_slots = torch.cat(send) if send else empty
        # rank k's rows land at [k * max_prior, k * max_prior + counts[k]) of the gathered buffer
        self.recv_rows = torch.cat([torch.arange(k * self.max_prior, k * self.max_prior + counts[k], device=dev)
                                    for k in range(N)])
        self.recv_slots = torch.cat(slots) if slots else empty

    def _init_new_rows(self) -> None:
        rows, slots, positions = [], [], []
        bs = self.spec.block_size
        for r, off in zip(self.requests, self.offsets):
            rows.extend(range(r.row_start, r.row_start + r.num_rows))
            positions.extend(range(r.start, r.seq_len))
            slots.extend(off * bs + p for p in range(r.start, r.seq_len))
        self.new_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.new_meta = _meta(positions, slots, [r.num_rows for r in self.requests], self.requests, self.tables,
                              bs, self.device)

    def _init_own_meta(self) -> None:
        """The rank's own rows of prefill requests, addressed through the buffer's block tables."""
        s = self.step
        ids = {r.req_idx: i for i, r in enumerate(self.requests)}
        starts = [r.row_start for r in s.requests]
        counts = [0] * len(self.requests)
        positions = []
        for row in s.rows.own_rows:
            r = s.requests[bisect.bisect_right(starts, row) - 1]
            if r.req_idx in ids:
                counts[ids[r.req_idx]] += 1
                positions.append(r.start + row - r.row_start)
        self.own_meta = _meta(positions, [-1] * len(positions), counts, self.requests, self.tables,
                              self.spec.block_size, self.device)

    # ---- per layer -------------------------------------------------------------------------------
    def _row_bytes(self, layer: int) -> torch.Tensor:
        """This rank's prior rows of `layer` as bytes [max_prior, mla bytes (+ index bytes)]."""
        bs, slots = self.spec.block_size, self.send_slots
        parts = [self.cache.mla_layer(layer)[slots // bs, slots % bs].contiguous().view(torch.uint8)]
        if self.spec.index_layer_of[layer] >= 0:
            keys = read_index_rows(self.cache.index_layer(layer), slots // bs, slots % bs)
            parts.append(keys.contiguous().view(torch.uint8))
        rows = torch.cat(parts, dim=1)
        out = rows.new_zeros((self.max_prior, rows.shape[1]))
        out[: rows.shape[0]] = rows
        return out

    def issue(self, layer: int | None) -> None:
        if layer is None or self.max_prior == 0 or layer in self.pending or layer in self.built:
            return
        self.pending[layer] = self.comm.all_gather(self._row_bytes(layer), "dcp_ctx", prefetch=True, async_op=True)

    def after_store(self, layer: int) -> None:
        """Layer `layer`'s new rows are written: start the next layer's gather (prefetch mode)."""
        if self.prefetch:
            self.issue(self.step.next_layer(layer))

    def buffer(self, layer: int) -> LayerBuffer:
        if layer in self.built:
            return self.built[layer]
        sp = self.spec
        mla = torch.empty((self.num_blocks, sp.block_size, sp.mla_row), dtype=sp.mla_torch_dtype, device=self.device)
        has_index = sp.index_layer_of[layer] >= 0
        index = (torch.empty((self.num_blocks, sp.block_size, sp.index_row), dtype=sp.index_torch_dtype,
                             device=self.device) if has_index else None)
        if self.max_prior:
            self.issue(layer)
            recv, work = self.pending.pop(layer)
            work.wait()
            recv, slots = recv.index_select(0, self.recv_rows), self.recv_slots
            mla_bytes = sp.mla_row * mla.element_size()
            mla.view(-1, sp.mla_row)[slots] = recv[:, :mla_bytes].contiguous().view(sp.mla_torch_dtype)
            if has_index:
                keys = recv[:, mla_bytes:].contiguous().view(sp.index_torch_dtype)
                write_index_rows(index, slots // sp.block_size, slots % sp.block_size, keys)
        self.built[layer] = LayerBuffer(sp, layer, mla, index)
        return self.built[layer]

    def store_kv(self, inner, layer: int, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        inner.store_kv(self.buffer(layer), layer, latent[self.new_rows], k_rope[self.new_rows], self.new_meta)

    def store_index_k(self, inner, layer: int, k: torch.Tensor) -> None:
        inner.store_index_k(self.buffer(layer), layer, k[self.new_rows], self.new_meta)

    def release(self, layer: int) -> None:
        self.built.pop(layer, None)
        if layer in self.pending:
            self.pending.pop(layer)[1].wait()


def _meta(positions: list[int], slots: list[int], counts: list[int], requests, tables, block_size: int,
          device) -> AttnMetadata:
    return build_metadata(positions=positions, slot_mapping=slots, query_lens=counts,
                          seq_lens=[r.seq_len for r in requests], block_tables=tables, block_size=block_size,
                          device=device)
