"""The KV cache HiSparse hands the model: the host pool is the home of every block, the device keeps the
indexer keys of every token plus a pool of pages and hot buffers.

    mla        [num_host_blocks, num_mla_layers, 64, row]     host pool, pinned when CUDA is present
    index      [num_host_blocks, num_index_layers, 64, irow]  device: the indexer key cache of every token
    pool.mla   [num_device_blocks, num_mla_layers, 64, row]   device: pages of resident requests + hot buffers

Block ids in the scheduler's block tables are host block ids (admission is bounded by the host pool), so
`mla[b]` / `index[b]` are where block b lives, exactly as in a plain PagedKVCache: code that exports or
imports KV by block id (the disaggregation path, NIXL registration of `mla` and `index`) works unchanged
and lands directly in the host pool. A host slot = block * 64 + offset names a token's row in both. The
device pages are a cache of host pages, mapped by `engine.hisparse.residency`; only the HiSparse backend
reads `pool`.
"""

from __future__ import annotations

import torch

from engine.kv.cache import KVCacheSpec, PagedKVCache


def host_blocks_for(spec: KVCacheSpec, host_pool_gib: float, host_pool_blocks: int | None) -> int:
    if host_pool_blocks is not None:
        return host_pool_blocks
    n = int(host_pool_gib * (1 << 30)) // spec.mla_block_bytes
    if n < 1:
        raise ValueError(f"hisparse host_pool_gib {host_pool_gib} holds no block of {spec.mla_block_bytes} B")
    return n


class DevicePool:
    """Device pages and hot buffers, shaped like a cache's MLA tensor (what the inner backend reads)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"the device pool needs at least one block, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        # zeros: rows that no plan points at may still be read (and masked) by the reference backend
        self.mla = torch.zeros((num_blocks, spec.num_mla_layers, spec.block_size, spec.mla_row),
                               dtype=spec.mla_torch_dtype, device=device)

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self.mla[:, self.spec.mla_layer_of[layer]]


class HiSparseKVCache(PagedKVCache):
    def __init__(self, spec: KVCacheSpec, num_host_blocks: int, num_device_blocks: int, device: torch.device):
        self.spec = spec
        self.num_blocks = num_host_blocks
        self.device = torch.device(device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        # zeros: a restored page that was never fully written must still hold finite numbers
        self.mla = torch.zeros((num_host_blocks, spec.num_mla_layers, spec.block_size, spec.mla_row),
                               dtype=spec.mla_torch_dtype, pin_memory=pin)
        self.index = torch.zeros((num_host_blocks, max(spec.num_index_layers, 1), spec.block_size, spec.index_row),
                                 dtype=spec.index_torch_dtype, device=self.device)
        self.pool = DevicePool(spec, num_device_blocks, self.device)
