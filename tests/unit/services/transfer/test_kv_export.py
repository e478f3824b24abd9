"""The engine's KV export description (`engine.kv.export`) and the one token -> rank rule behind it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.kv.export import KVExport, kv_exports, kv_regions
from engine.parallel.dcp import dcp_slot_fn, local_index, owner_rank
from services.transfer.pull import token_home


def test_one_rank_exports_alone_and_dcp_ranks_share_the_virtual_block_ids():
    assert kv_exports([3, 7], 1, 1) == [KVExport(0, [3, 7])]
    got = kv_exports([3, 7], 4, 2)
    assert [e.rank for e in got] == [0, 1, 2, 3]
    assert all(e.block_ids == [3, 7] and (e.dcp_size, e.interleave) == (4, 2) for e in got)


def test_regions_are_the_cache_tensors_themselves():
    cache = SimpleNamespace(mla=torch.zeros(3, 2, 64, 8, dtype=torch.uint8), index=torch.zeros(3, 1, 64, 4))
    regions = kv_regions(cache)
    assert set(regions) == {"mla", "index"}
    assert regions["mla"] is cache.mla and regions["index"] is cache.index


def test_pull_and_the_engine_write_path_place_every_token_alike():
    dcp, inter, bs = 2, 16, 64
    blocks = [5, 9]
    for rank in range(dcp):
        slots = dcp_slot_fn(rank, dcp, inter)(blocks, range(200), bs)
        for p, slot in enumerate(slots):
            home = token_home(p, dcp, inter)
            assert home == (owner_rank(p, dcp, inter), local_index(p, dcp, inter))
            if home[0] != rank:
                assert slot == -1
            else:
                assert slot == blocks[home[1] // bs] * bs + home[1] % bs
