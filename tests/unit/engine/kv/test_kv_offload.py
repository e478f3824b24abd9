"""The KV offload tier's bookkeeping (engine/kv/offload.py) inside the KV manager: evicted prefix blocks are
stored, device misses hit the tier and are loaded, LRU eviction, slot locks, copy order, events, nothing held
after aborts; and `--kv-offloading-size`'s checks."""

from __future__ import annotations

import argparse

import pytest

from engine.config.arg_utils import EngineArgs
from engine.config.engine import CacheConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_pool import KVBlock
from engine.kv.manager import KVCacheManager
from engine.kv.offload import LOAD, STORE, KVCopy, OffloadTier, TierHit, sum_stats
from engine.kv.offload_buffer import offload_blocks_for


def req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams())


def manager(num_blocks=4, tier_blocks=8, dcp_size=1):
    return KVCacheManager(num_blocks, dcp_size=dcp_size, offload=OffloadTier(tier_blocks, block_bytes=1000))


def run_prefix(kv, rid, n, start=0):
    """A request that computed `n` tokens, published its full blocks and finished."""
    r = req(rid, n, start)
    hits, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, n - n_hit, hits) is not None
    r.num_computed_tokens = n
    kv.cache_blocks(r, n)
    kv.free(rid)
    return r


def test_evicted_prefix_blocks_are_stored_and_come_back_as_loads():
    kv = manager(num_blocks=5)
    a = run_prefix(kv, "a", 4 * 64)  # 4 cached blocks, one block left free
    a_ids = [b.block_id for b in kv.pool.blocks if b.block_hash is not None]
    assert kv.take_copies() == []  # nothing evicted yet
    run_prefix(kv, "b", 5 * 64, start=1000)  # the free block, then all of a's blocks
    stores = kv.take_copies()
    assert [c.op for c in stores] == [STORE] * 4 and sorted(c.block_id for c in stores) == sorted(a_ids)
    hashes = a.block_hashes(64)
    assert all(kv.pool.lookup(h) is None for h in hashes) and all(h in kv.offload.entries for h in hashes)

    again = req("a2", 4 * 64 + 10)  # same prefix: 4 tier hits, none on the device
    hits, n_hit = kv.get_computed_blocks(again)
    assert n_hit == 256 and all(isinstance(h, TierHit) for h in hits)
    new_ids = kv.allocate_slots(again, 10, hits)
    assert new_ids is not None and len(new_ids) == 5
    copies = kv.take_copies()
    loads = [c for c in copies if c.op == LOAD]
    # each hit's slot loads into the request's block at the same position, after any store into that block
    assert [c.block_id for c in loads] == new_ids[:4]
    assert [c.slot for c in loads] == [kv.offload.entries[h][0] for h in hashes]
    for load in loads:
        later = copies[copies.index(load) + 1:]
        assert not any(c.op == STORE and c.slot == load.slot for c in later), "a load's slot is overwritten"
    assert all(kv.pool.lookup(h) is not None for h in hashes), "loaded blocks are published again"
    st = kv.offload_stats()
    assert st.hits == 256 and st.num_loaded == 4 and st.load_bytes == 4000 and st.num_stored >= 8
    assert kv.prefix_hits >= 256, "tier hits count as prefix hits"


def test_tier_is_lru_by_hash_and_a_reused_entry_survives():
    tier = OffloadTier(2, block_bytes=1)
    tier.store(0, b"A" * 16, None)
    tier.store(1, b"B" * 16, None)
    tier.store(2, b"A" * 16, None)  # already held: refreshed, no copy
    assert len(tier.copies) == 2
    tier.store(3, b"C" * 16, None)  # full: B is the least recently used
    assert set(tier.entries) == {b"A" * 16, b"C" * 16} and tier.num_evicted == 1
    hit = tier.lookup(b"A" * 16, 64)
    tier.lock(hit)
    tier.load(hit, 9)  # a load makes A the most recently used
    tier.store(4, b"D" * 16, None)
    assert set(tier.entries) == {b"A" * 16, b"D" * 16}
    assert tier.lookup(b"B" * 16, 64) is None and tier.queries == 128 and tier.hits == 64


def test_a_locked_slot_is_never_the_victim_and_stores_are_dropped_when_all_are_locked():
    tier = OffloadTier(1, block_bytes=1)
    tier.store(0, b"A" * 16, None)
    tier.take_copies()
    hit = tier.lookup(b"A" * 16, 64)
    tier.lock(hit)
    tier.store(5, b"B" * 16, None)  # the only slot is read by a queued load: B is not kept
    tier.load(hit, 7)
    assert tier.num_dropped == 1 and list(tier.entries) == [b"A" * 16]
    assert tier.take_copies() == [KVCopy(LOAD, 7, hit.slot)]
    tier.store(5, b"B" * 16, None)  # the load was handed to the runner: the slot may be reused
    assert list(tier.entries) == [b"B" * 16] and tier.copies == [KVCopy(STORE, 5, hit.slot)]


def test_small_tier_lock_protects_hits_from_their_own_allocation():
    """Loading a tier hit evicts device blocks into a full two-slot tier: the stores must not take the hit's
    slot before its load runs."""
    kv = manager(num_blocks=2, tier_blocks=2)
    a = run_prefix(kv, "a", 128)
    run_prefix(kv, "b", 128, start=500)  # a -> tier (2 slots, full)
    kv.take_copies()
    again = req("a2", 140)
    hits, n_hit = kv.get_computed_blocks(again)
    assert n_hit == 128
    assert kv.allocate_slots(again, 12, hits) is None  # 2 loads + 1 fresh block do not fit 2 blocks
    again = req("a3", 129)
    hits, n_hit = kv.get_computed_blocks(again)
    assert kv.allocate_slots(again, 1, hits[:1]) is not None  # 1 load + 1 fresh: evicts b's blocks
    copies = kv.take_copies()
    load = next(c for c in copies if c.op == LOAD)
    assert not any(c.op == STORE and c.slot == load.slot for c in copies)
    # the hit stays; the unlocked entries went (the second store evicted the first one's block)
    assert a.block_hashes(64)[0] in kv.offload.entries and kv.offload.num_evicted == 2


def test_abort_or_preemption_before_the_loads_ran_holds_nothing():
    kv = manager(num_blocks=5)
    run_prefix(kv, "a", 3 * 64)
    run_prefix(kv, "b", 5 * 64, start=1000)  # a's 3 blocks -> the tier
    kv.take_copies()
    r = req("r", 3 * 64 + 5)
    hits, _ = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, 5, hits)
    assert ids is not None and len(ids) == 4
    kv.free("r")  # aborted (or preempted) before the step that runs its loads
    assert kv.num_free_blocks == 5 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and kv._num_cached == {}
    s = req("s", 5 * 64, start=3000)  # takes every block: evicting a block whose load is queued copies nothing
    hits, _ = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, 5 * 64, hits) is not None
    copies = kv.take_copies()
    loads = [i for i, c in enumerate(copies) if c.op == LOAD]
    assert [copies[i].block_id for i in loads] == ids[:3]
    # b's blocks were stored before the loads overwrote them; nothing is stored from a block after its load
    # was queued (its bytes arrive with that load: the tier has them already)
    assert all(c.op == STORE for c in copies[:loads[0]])
    assert not any(c.op == STORE and c.block_id in ids[:3] for c in copies[loads[0]:]), "unwritten bytes stored"
    assert kv.offload.locked == set()
    kv.free("s")
    assert kv.num_free_blocks == 5


def test_events_name_the_device_pool_and_dcp_keys_survive_the_tier():
    kv = manager(num_blocks=3, dcp_size=2)  # virtual blocks of 128 tokens, events carry both 64-token keys
    a = run_prefix(kv, "a", 256)
    subs = a.block_hashes(64)
    assert {h for k, h in kv.pool.drain_events() if k == "stored"} == set(subs)
    run_prefix(kv, "b", 384, start=900)
    removed = {h for k, h in kv.pool.drain_events() if k == "removed"}
    assert set(subs) <= removed, "a block moved to the host tier is no longer on the device"
    r = req("a2", 260)
    hits, n_hit = kv.get_computed_blocks(r)
    assert n_hit == 256 and all(isinstance(h, TierHit) for h in hits)
    assert kv.allocate_slots(r, 4, hits) is not None
    assert set(subs) <= {h for k, h in kv.pool.drain_events() if k == "stored"}


def test_device_hits_win_and_mixed_hits_keep_their_positions():
    kv = manager(num_blocks=6)
    a = run_prefix(kv, "a", 3 * 64)
    hashes = a.block_hashes(64)
    victim = kv.pool.lookup(hashes[1])
    kv.pool.free_queue.remove(victim)  # evict the middle block as allocation would
    kv.pool.free_queue.append(victim)
    kv.pool._evict(victim, offload=True)
    r = req("r", 3 * 64 + 1)
    hits, n_hit = kv.get_computed_blocks(r)
    assert n_hit == 192 and [type(h) for h in hits] == [KVBlock, TierHit, KVBlock]
    ids = kv.allocate_slots(r, 1, hits)
    assert ids[0] == hits[0].block_id and ids[2] == hits[2].block_id
    assert [c for c in kv.take_copies() if c.op == LOAD] == [KVCopy(LOAD, ids[1], hits[1].slot)]


def test_stats_sum_over_ranks():
    a, b = OffloadTier(4, 10), OffloadTier(4, 10)
    a.store(0, b"A" * 16, None)
    b.store(0, b"B" * 16, None)
    total = sum_stats([a.stats(), None, b.stats()])
    assert total.num_blocks == 8 and total.num_used_blocks == 2 and total.store_bytes == 20 and total.usage == 0.25
    assert sum_stats([None]) is None


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "16", True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="kv_offloading_size is a size in GiB"):
        CacheConfig(kv_offloading_size=bad)


@pytest.mark.parametrize("text", ["-1", "abc", "nan", ""])
def test_bad_flag_values_are_refused_by_the_parser(text, capsys):
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--kv-offloading-size", text])
    assert "--kv-offloading-size: a size in GiB" in capsys.readouterr().err


def test_flag_parses_and_needs_prefix_caching():
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(p.parse_args(["--model", "m", "--kv-offloading-size", "16"]))
    assert args.kv_offloading_size == 16.0
    assert CacheConfig(kv_offloading_size=0).kv_offloading_size == 0  # 0: no tier
    with pytest.raises(ValueError, match="needs prefix caching"):
        CacheConfig(kv_offloading_size=1, enable_prefix_caching=False)


def test_sizing_splits_over_cp_ranks_and_refuses_a_tier_without_a_block():
    assert offload_blocks_for(1.0, 1 << 20) == 1024
    assert offload_blocks_for(1.0, 1 << 20, num_ranks=8) == 128
    with pytest.raises(ValueError, match="holds no KV block"):
        offload_blocks_for(1e-9, 1 << 20)
