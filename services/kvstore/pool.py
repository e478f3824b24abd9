"""Which pool block holds which prefix-block hash: the kvstore's bookkeeping, no tensors.

A block is in exactly one state:

    free ──reserve──▶ reserved ──commit──▶ stored (LRU) ◀──release/expire── pinned (loaded)
      ▲                  │ release / expire (after a grace period)      │ load
      └──────────────────┴──────────── evict (LRU, unpinned only) ◀─────┘

Reserved blocks are being WRITTEN by a client over NIXL; stored ones are readable and evictable;
pinned ones are being READ and never evicted. An expired reservation's blocks stay out of the free
list for `grace_s` more seconds, because a writer's cancelled NIXL WRITE may still land. All
methods take `now` (monotonic seconds) so tests control time; ids are unique strings.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.rpc.grpc_server import FailedPrecondition, NotFound


@dataclass
class Reservation:
    reservation_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    expires_at: float


@dataclass
class Lease:
    lease_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    expires_at: float


@dataclass
class PoolChanges:
    """What reserve (evictions) or commit did to the stored hashes (for the Redis index and events)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, *, grace_s: float = 2.0):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.grace_s = grace_s
        self._free: deque[int] = deque(range(num_blocks))
        self._stored: dict[bytes, int] = {}  # committed hash -> block
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # unpinned stored hashes, oldest first
        self._pins: dict[bytes, int] = {}  # stored hash -> number of leases reading it
        self._pending: dict[bytes, str] = {}  # hash being written -> reservation id
        self._reservations: dict[str, Reservation] = {}
        self._leases: dict[str, Lease] = {}
        self._quarantine: list[tuple[float, list[int]]] = []  # (free at, blocks) of expired reservations
        self._ids = itertools.count()
        self.num_evicted = 0
        self.num_expired = 0

    # ---- queries -------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading hashes stored."""
        n = 0
        for h in hashes:
            if h not in self._stored:
                break
            n += 1
        return n

    def stored_hashes(self) -> list[bytes]:
        return list(self._stored)

    @property
    def num_open(self) -> int:
        """Reservations and leases not yet committed/released: each is a NIXL transfer in flight."""
        return len(self._reservations) + len(self._leases)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    # ---- reserve / commit ----------------------------------------------------------------------
    def reserve(self, hashes: Sequence[bytes], ttl_s: float, now: float) -> tuple[Reservation | None, int, PoolChanges]:
        """Blocks for the hashes neither stored nor being written, in order, while blocks last
        (evicting LRU blocks, never ones this chain names). Returns (reservation or None if nothing
        was reserved, number of hashes already stored or pending, changes)."""
        self.expire(now)
        changes = PoolChanges()
        wanted: list[bytes] = []
        seen: set[bytes] = set()
        num_present = 0
        for h in hashes:
            if h in seen:
                continue
            seen.add(h)
            if h in self._stored or h in self._pending:
                num_present += 1
            else:
                wanted.append(h)
        block_ids = self._allocate(len(wanted), protect=seen, changes=changes)
        if not block_ids:
            return None, num_present, changes
        res = Reservation(self._new_id("r"), wanted[:len(block_ids)], block_ids, now + ttl_s)
        self._reservations[res.reservation_id] = res
        for h in res.block_hashes:
            self._pending[h] = res.reservation_id
        return res, num_present, changes

    def commit(self, reservation_id: str, now: float) -> PoolChanges:
        """Publish a reservation's blocks as stored (newest in LRU order)."""
        res = self._reservations.get(reservation_id)
        self.expire(now)
        if res is not None and now > res.expires_at:
            raise FailedPrecondition(f"reservation {reservation_id!r} expired before commit: its blocks "
                                     "may be reused; reserve again")
        if res is None:
            raise NotFound(f"unknown reservation {reservation_id!r} (released, committed or long expired)")
        changes = PoolChanges()
        del self._reservations[reservation_id]
        for h, b in zip(res.block_hashes, res.block_ids):
            del self._pending[h]
            self._stored[h] = b
            self._lru[h] = None
            changes.stored.append(h)
        return changes

    # ---- load / release ------------------------------------------------------------------------
    def load(self, hashes: Sequence[bytes], ttl_s: float, now: float) -> Lease | None:
        """Pin the leading stored hashes for reading; None when the first one is missing."""
        self.expire(now)
        n = self.lookup(hashes)
        if n == 0:
            return None
        lease = Lease(self._new_id("l"), list(hashes[:n]), [self._stored[h] for h in hashes[:n]], now + ttl_s)
        for h in lease.block_hashes:
            self._lru.pop(h, None)
            self._pins[h] = self._pins.get(h, 0) + 1
        self._leases[lease.lease_id] = lease
        return lease

    def release(self, some_id: str, now: float) -> bool:
        """Drop a lease (unpin) or a reservation (free its blocks now); False if unknown."""
        self.expire(now)
        if some_id in self._leases:
            self._unpin(self._leases.pop(some_id))
            return True
        if some_id in self._reservations:
            res = self._reservations.pop(some_id)
            for h in res.block_hashes:
                del self._pending[h]
            self._free.extend(res.block_ids)  # the writer says it is done with them
            return True
        return False

    def expire(self, now: float) -> None:
        """Unpin expired leases, quarantine expired reservations, free quarantined blocks."""
        for lease in [l for l in self._leases.values() if now > l.expires_at]:
            del self._leases[lease.lease_id]
            self._unpin(lease)
            self.num_expired += 1
        for res in [r for r in self._reservations.values() if now > r.expires_at]:
            del self._reservations[res.reservation_id]
            for h in res.block_hashes:
                del self._pending[h]
            self._quarantine.append((res.expires_at + self.grace_s, res.block_ids))
            self.num_expired += 1
        ready = [q for q in self._quarantine if now > q[0]]
        if ready:
            self._quarantine = [q for q in self._quarantine if now <= q[0]]
            for _, blocks in ready:
                self._free.extend(blocks)

    # ---- internals -----------------------------------------------------------------------------
    def _allocate(self, n: int, protect: set[bytes], changes: PoolChanges) -> list[int]:
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        if len(out) < n:
            victims = itertools.islice((h for h in self._lru if h not in protect), n - len(out))
            for h in list(victims):
                del self._lru[h]
                out.append(self._stored.pop(h))
                changes.removed.append(h)
                self.num_evicted += 1
        return out

    def _unpin(self, lease: Lease) -> None:
        for h in lease.block_hashes:
            left = self._pins[h] - 1
            if left:
                self._pins[h] = left
            else:
                del self._pins[h]
                self._lru[h] = None  # readable again and evictable; most recently used

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
