"""The host pool (every request's MLA rows) and the device cache that HiSparse hands the model.

    host pool     mla [num_host_blocks, num_mla_layers, 64, row]   pinned when CUDA is present
    device cache  mla [num_device_blocks, num_mla_layers, 64, row] pages of resident requests + hot buffers
                  index [num_host_blocks, num_index_layers, 64, index_row]   the indexer keys of every token

Block ids in the scheduler's block tables are *host* block ids (admission is bounded by the host pool),
so a host slot = host block id * 64 + offset names a token's row everywhere: in the host pool and in the
device index cache. The device MLA pages are a cache of host pages, mapped by `engine.hisparse.residency`.
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


class HostKVPool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, pin: bool):
        self.spec = spec
        self.num_blocks = num_blocks
        pin = pin and torch.cuda.is_available()
        # zeros: a restored page that was never fully written must still hold finite numbers
        self.mla = torch.zeros((num_blocks, spec.num_mla_layers, spec.block_size, spec.mla_row),
                               dtype=spec.mla_torch_dtype, pin_memory=pin)

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self.mla[:, self.spec.mla_layer_of[layer]]

    @property
    def nbytes(self) -> int:
        return self.mla.numel() * self.mla.element_size()


class HiSparseKVCache(PagedKVCache):
    """A PagedKVCache whose block ids are host blocks: `num_blocks` and `index` are addressed by them, while
    `mla` is the (smaller) device pool, addressed by device block ids that only HiSparse hands out."""

    def __init__(self, spec: KVCacheSpec, num_host_blocks: int, num_device_blocks: int, device: torch.device,
                 pin_host: bool = True):
        if num_device_blocks < 1:
            raise ValueError(f"the device pool needs at least one block, got {num_device_blocks}")
        self.spec = spec
        self.num_blocks = num_host_blocks
        self.num_device_blocks = num_device_blocks
        self.device = torch.device(device)
        # zeros: pool rows that no plan points at are still read (and masked) by the reference backend
        self.mla = torch.zeros((num_device_blocks, spec.num_mla_layers, spec.block_size, spec.mla_row),
                               dtype=spec.mla_torch_dtype, device=self.device)
        self.index = torch.zeros((num_host_blocks, max(spec.num_index_layers, 1), spec.block_size, spec.index_row),
                                 dtype=spec.index_torch_dtype, device=self.device)
        self.host = HostKVPool(spec, num_host_blocks, pin=pin_host and self.device.type == "cuda")

    @property
    def device_nbytes(self) -> int:
        return self.mla.numel() * self.mla.element_size() + self.index.numel() * self.index.element_size()
