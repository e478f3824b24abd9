"""Which bytes a request's KV is: the engine's side of KV export and import.

The transfer layer (services/transfer/) moves KV; the engine only describes it:

    kv_regions(cache)          -> {name: tensor}: the block-major tensors of one rank's cache; the memory
                                  type of each is its tensor's device (HiSparse: MLA rows in host memory,
                                  indexer rows on the GPU). Fixed for the engine's lifetime: registered once.
    EngineCore.kv_exports(id)  -> [KVExport per rank that holds a share of a held request's KV]

With DCP = 1 (one rank, or PCP ranks holding full replicas) rank 0 alone exports. With DCP = N every rank
holds its share of each virtual block under the same block id; which rank holds token i is
`engine.parallel.dcp.owner_rank` / `local_index`, the one definition of that rule.
An import writes the same regions at the block ids the engine reserved (`add_import_request`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.cache import PagedKVCache


def kv_regions(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    """The tensors that are a rank's KV, by name, each indexed by block id in its leading dimension."""
    return {"mla": cache.mla, "index": cache.index}


@dataclass(frozen=True)
class KVExport:
    """One rank's share of a request's KV: blocks `block_ids` of that rank's `kv_regions`."""

    rank: int
    block_ids: list[int]
    dcp_size: int = 1
    interleave: int = 1


def kv_exports(block_ids: list[int], dcp_size: int, interleave: int) -> list[KVExport]:
    """The ranks holding a request with (virtual) `block_ids`, and their blocks."""
    if dcp_size == 1:
        return [KVExport(0, list(block_ids))]
    return [KVExport(r, list(block_ids), dcp_size, interleave) for r in range(dcp_size)]
