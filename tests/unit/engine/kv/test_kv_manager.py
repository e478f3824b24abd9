"""Block pool and KV manager: ref counts, LRU eviction, prefix hits, no leaks; hashing."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import ROOT, block_hashes, hash_block
from engine.kv.manager import KVCacheManager


def req(rid, n, start=0, salt=None):
    return Request(rid, list(range(start, start + n)), SamplingParams(), cache_salt=salt)


def test_hashes_chain_full_blocks_only_and_salt_changes_first_block():
    toks = list(range(200))
    h = block_hashes(toks)
    assert len(h) == 3 and all(len(x) == 16 for x in h)
    assert h[0] == hash_block(None, toks[:64]) and h[1] == hash_block(h[0], toks[64:128])
    assert block_hashes(toks[:128]) == h[:2]  # prefix property
    salted = block_hashes(toks, cache_salt="tenant-a")
    assert salted[0] != h[0] and salted[1] != h[1]  # the salt propagates through the chain
    assert block_hashes(toks, cache_salt="tenant-a") == salted
    assert hash_block(None, toks[:64]) == hash_block(ROOT, toks[:64])


def test_pool_lru_evicts_least_recently_freed_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A" * 16)
    pool.cache(b, b"B" * 16)
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.num_free_blocks == 3 and pool.lookup(b"A" * 16) is a
    (x,) = pool.allocate(1)  # uncached c went to the tail... but a was freed first: LRU order a, b, c
    assert x is a and pool.lookup(b"A" * 16) is None and pool.lookup(b"B" * 16) is b
    assert ("removed", b"A" * 16) in pool.drain_events()


def test_manager_prefix_hit_reuses_blocks_and_frees_everything():
    kv = KVCacheManager(num_blocks=10)
    r1 = req("r1", 200)
    assert kv.allocate_slots(r1, 200) is not None
    r1.num_computed_tokens = 200
    kv.cache_blocks(r1, 200)
    r2 = req("r2", 260)  # shares the first 192 tokens (3 full blocks)
    hits, n = kv.get_computed_blocks(r2)
    assert n == 192 and [b.block_id for b in hits] == kv.block_ids("r1")[:3]
    assert kv.allocate_slots(r2, 260 - 192, hits) is not None
    assert kv.block_ids("r2")[:3] == kv.block_ids("r1")[:3]
    kv.free("r1")
    kv.free("r2")
    assert kv.num_free_blocks == 10
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_manager_leaves_one_token_to_compute_and_refuses_when_full():
    kv = KVCacheManager(num_blocks=4)
    r1 = req("r1", 128)
    kv.allocate_slots(r1, 128)
    r1.num_computed_tokens = 128
    kv.cache_blocks(r1, 128)
    hits, n = kv.get_computed_blocks(req("same", 128))
    assert n == 64, "a full hit must still leave the last token (its logits) to compute"
    big = req("big", 64 * 3)
    assert kv.allocate_slots(big, 64 * 3) is None  # 2 free blocks only
    assert kv.num_free_blocks == 2 and "big" not in kv.req_blocks


def test_dcp_virtual_blocks_hash_their_last_sub_block():
    kv = KVCacheManager(num_blocks=4, dcp_size=2)
    r = req("r", 300)
    assert kv.tokens_per_block == 128
    kv.allocate_slots(r, 300)
    assert len(kv.block_ids("r")) == 3
    r.num_computed_tokens = 300
    kv.cache_blocks(r, 300)
    full = block_hashes(r.all_token_ids)
    assert kv.pool.lookup(full[1]) is not None and kv.pool.lookup(full[3]) is not None
    assert kv.pool.lookup(full[0]) is None
    # the prefix index (Redis) is keyed by 64-token hashes: a virtual block announces every sub-block
    assert kv.pool.drain_events() == [("stored", h) for h in full[:4]]
    kv.free("r")
    assert kv.pool.reset_prefix_cache()
    assert sorted(kv.pool.drain_events()) == sorted(("removed", h) for h in full[:4])
    assert not kv.pool.index_keys


def test_manager_refuses_prefix_hits_for_a_request_that_holds_blocks():
    """Hits are a block table's first blocks: appended after blocks a request already holds (an import
    that gave up) they would map its first positions to the wrong blocks, so they are refused unchanged."""
    kv = KVCacheManager(num_blocks=10)
    r1 = req("r1", 200)
    kv.allocate_slots(r1, 200)
    r1.num_computed_tokens = 200
    kv.cache_blocks(r1, 200)
    r2 = req("r2", 260)
    assert kv.allocate_slots(r2, 260) is not None  # reserved before r1's prefix was cached, say
    held = kv.block_ids("r2")
    hits, n = kv.get_computed_blocks(r2)
    assert n == 192
    try:
        kv.allocate_slots(r2, 260 - 192, hits)
    except ValueError as e:
        assert "already holds" in str(e)
    else:
        raise AssertionError("prefix hits after held blocks were accepted")
    assert kv.block_ids("r2") == held
