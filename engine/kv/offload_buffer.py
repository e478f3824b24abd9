"""The host KV offload tier's bytes (`--kv-offloading-size`): one host tensor per KV region, slot-major like
the cache, and the copies the KV manager queued (engine/kv/offload.py says which and why in that order).

    region (kv_regions)     buffer                                   memory
    mla    [blocks, ...]    mla   [slots, num_mla_layers, 64, row]   host, pinned when CUDA is present
    index  [blocks, ...]    index [slots, num_index_layers, 64, row] host, pinned when CUDA is present

A block is one contiguous row of each region, so a store or load is one copy per region, whatever memory the
region lives in: the device pool's pages on a GPU, or with HiSparse the host pool's MLA rows and the
device's indexer keys (kv_regions gives each tensor where it lives). Copies to and from the GPU run on the
current stream, ordered with the forwards; host-to-host copies (HiSparse's MLA rows) run on the CPU, after
the GPU has finished what it queued (it writes and reads those host rows).
"""

from __future__ import annotations

import torch

from engine.kv.export import kv_regions
from engine.kv.offload import STORE, KVCopy, OffloadTier

_GIB = 1 << 30


def offload_blocks_for(size_gib: float, block_bytes: int, num_ranks: int = 1) -> int:
    """Blocks a tier of `size_gib` GiB holds on each of `num_ranks` ranks that split it (ValueError if none)."""
    n = int(size_gib * _GIB / num_ranks) // block_bytes
    if n < 1:
        per_rank = f" per rank over {num_ranks} ranks" if num_ranks > 1 else ""
        raise ValueError(f"kv_offloading_size {size_gib:g} GiB{per_rank} holds no KV block ({block_bytes} B): "
                         "raise it")
    return n


class OffloadBuffer:
    def __init__(self, regions: dict[str, torch.Tensor], num_blocks: int, device: torch.device | str):
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.pairs = [(t, torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin))
                      for t in regions.values()]
        self.block_bytes = sum(host[0].numel() * host.element_size() for _, host in self.pairs)
        # host regions (HiSparse's MLA pool) are copied by the CPU: the GPU's queued work on them comes first
        self.host_copies = self.device.type == "cuda" and any(t.device.type == "cpu" for t in regions.values())

    @classmethod
    def for_cache(cls, cfg, cache) -> OffloadBuffer | None:
        """The buffer `cfg.cache.kv_offloading_size` asks for beside `cache` (None without one). The ranks of a
        CP engine split the size; every rank holds the same number of slots."""
        size = cfg.cache.kv_offloading_size
        if not size:
            return None
        regions = kv_regions(cache)
        block_bytes = sum(t[0].numel() * t.element_size() for t in regions.values())
        n = offload_blocks_for(size, block_bytes, cfg.parallel.prefill_context_parallel_size)
        return cls(regions, n, cfg.device)

    def tier(self, num_ranks: int = 1) -> OffloadTier:
        """The KV manager's bookkeeping of this buffer (of `num_ranks` ranks' alike buffers)."""
        return OffloadTier(self.num_blocks, self.block_bytes * num_ranks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def apply(self, copies: list[KVCopy], wait: bool = False) -> None:
        """Run `copies` in order. `wait`: return only once they are done (the caller writes blocks next from
        outside the stream, e.g. NIXL into blocks just stored)."""
        if not copies:
            return
        if self.host_copies:
            torch.cuda.synchronize(self.device)
        for op, block_id, slot in copies:
            for cache, buf in self.pairs:
                if op == STORE:
                    buf[slot].copy_(cache[block_id], non_blocking=True)
                else:
                    cache[block_id].copy_(buf[slot], non_blocking=True)
        if wait and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
