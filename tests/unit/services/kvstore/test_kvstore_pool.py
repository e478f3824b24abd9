"""The kvstore's block bookkeeping: reserve/commit/load/release, LRU eviction, expiry."""

from __future__ import annotations

import pytest

from services.kvstore.pool import BlockPool
from services.rpc.grpc_server import FailedPrecondition, NotFound


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _store(pool: BlockPool, hashes, now=0.0):
    res, _, changes = pool.reserve(hashes, ttl_s=10, now=now)
    assert res is not None
    pool.commit(res.reservation_id, now=now)
    return res


def test_reserve_commit_lookup_load_release():
    pool = BlockPool(8)
    res, present, changes = pool.reserve([H(0), H(1), H(2)], ttl_s=5, now=0)
    assert present == 0 and res.block_hashes == [H(0), H(1), H(2)] and len(set(res.block_ids)) == 3
    assert pool.lookup([H(0)]) == 0  # not readable before commit
    # a second writer of an overlapping chain skips what is stored or being written
    res2, present2, _ = pool.reserve([H(0), H(1), H(2), H(3)], ttl_s=5, now=0)
    assert present2 == 3 and res2.block_hashes == [H(3)]
    assert pool.commit(res.reservation_id, now=1).stored == [H(0), H(1), H(2)]
    assert pool.lookup([H(0), H(1), H(2), H(3)]) == 3
    assert pool.lookup([H(1), H(2)]) == 2 and pool.lookup([H(9), H(0)]) == 0
    lease = pool.load([H(0), H(1), H(9), H(2)], ttl_s=5, now=1)
    assert lease.block_hashes == [H(0), H(1)] and lease.block_ids == res.block_ids[:2]
    assert pool.load([H(9)], ttl_s=5, now=1) is None
    assert pool.release(lease.lease_id, now=2) and not pool.release(lease.lease_id, now=2)
    assert pool.release(res2.reservation_id, now=2)  # dropped: H(3) is writable again
    assert pool.reserve([H(3)], ttl_s=5, now=2)[0].block_hashes == [H(3)]
    with pytest.raises(NotFound):
        pool.commit("r-unknown", now=2)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_lru_eviction_spares_pinned_and_the_chain_itself():
    pool = BlockPool(4)
    _store(pool, [H(0), H(1)], now=0)
    _store(pool, [H(2), H(3)], now=1)
    assert pool.num_free == 0 and pool.usage == 1.0
    lease = pool.load([H(0)], ttl_s=100, now=2)  # H(0) pinned; H(1) is now the oldest unpinned
    res, _, changes = pool.reserve([H(10)], ttl_s=5, now=3)
    assert changes.removed == [H(1)] and pool.lookup([H(1)]) == 0
    pool.commit(res.reservation_id, now=3)
    # LRU now H(2), H(3), H(10); touching H(2) makes it newest; H(3) is the oldest but the
    # reserving chain names it (it counts on it being stored), so H(10) goes instead
    pool.release(pool.load([H(2)], ttl_s=5, now=4).lease_id, now=4)
    res, present, changes = pool.reserve([H(3), H(11)], ttl_s=5, now=5)
    assert present == 1 and changes.removed == [H(10)] and res.block_hashes == [H(11)]
    assert [pool.lookup([h]) for h in (H(0), H(2), H(3))] == [1, 1, 1] and pool.num_evicted == 2
    # only pinned or protected blocks left: nothing can be reserved
    pool.commit(res.reservation_id, now=5)
    for h in (H(2), H(3), H(11)):
        pool.load([h], ttl_s=100, now=5)
    assert pool.reserve([H(20)], ttl_s=5, now=6)[0] is None
    assert pool.release(lease.lease_id, now=7)  # H(0) evictable again
    assert pool.reserve([H(20)], ttl_s=5, now=7)[2].removed == [H(0)]


def test_partial_reservation_when_pool_is_short():
    pool = BlockPool(3)
    res, _, _ = pool.reserve([H(i) for i in range(5)], ttl_s=5, now=0)
    assert res.block_hashes == [H(0), H(1), H(2)]  # the leading ones: a prefix is what is reusable


def test_reservation_timeout_frees_blocks_after_grace():
    pool = BlockPool(2, grace_s=1.0)
    res, _, _ = pool.reserve([H(0), H(1)], ttl_s=2, now=0)
    assert pool.num_free == 0
    with pytest.raises(FailedPrecondition):
        pool.commit(res.reservation_id, now=2.5)  # expired...
    pool.expire(now=2.5)
    assert pool.num_free == 0  # ...but a late WRITE may still land: quarantined
    assert pool.reserve([H(5)], ttl_s=2, now=2.9)[0] is None
    pool.expire(now=3.1)
    assert pool.num_free == 2 and pool.num_expired == 1
    res, _, _ = pool.reserve([H(0)], ttl_s=2, now=3.2)  # the hash is writable again
    assert res.block_hashes == [H(0)]


def test_lease_expiry_unpins():
    pool = BlockPool(1)
    _store(pool, [H(0)])
    pool.load([H(0)], ttl_s=1, now=0)
    assert pool.reserve([H(1)], ttl_s=1, now=0.5)[0] is None  # pinned: not evictable
    res, _, changes = pool.reserve([H(1)], ttl_s=1, now=1.5)
    assert changes.removed == [H(0)] and res.block_hashes == [H(1)]
