"""The host KV offload tier's bookkeeping (`--kv-offloading-size`): which prefix blocks it holds, LRU by hash,
and the copies the runner must make. Ints and hashes only; the bytes live in `engine/kv/offload_buffer.py`.

The tier extends the prefix cache past the device pool, as vLLM's native CPU offloading does:

    device pool evicts a cached block (full, hashed, ref count 0)  -> store: its bytes to a free tier slot
                                                                      (the LRU entry's when the tier is full)
    a prefix lookup misses the device but hits the tier            -> load: a device block is allocated, the
                                                                      bytes come back, the block is published
                                                                      again under its hash

Copies are queued in the order the KV manager decided them and run in that order by the runner, before
anything reads or writes the blocks they name: at the start of the next step (`SchedulerOutput.kv_copies`),
or at once when a caller is about to write reserved blocks from outside a step (`EngineCore.reserve_import`:
the NIXL writes into a block just evicted must come after its store).

    queued:  store(b7 -> s2)  load(s5 -> b7)  store(b3 -> s5)?  <- never: s5 is locked until the queue is taken

Invariants:
* an entry's slot is read by a queued load only while it is locked; a locked slot is never the LRU victim,
  so a store queued after the load cannot overwrite it before the load ran;
* the tier is inclusive: a loaded entry stays (most recently used), so evicting that block again costs no
  copy, and a block whose load is still queued (it was freed and evicted before the step ran) is never
  stored from unwritten device memory: its hash is already in the tier;
* nothing here is held by a request: an abort or a preemption frees device blocks as usual, and a queued
  load into a freed block still runs before any forward could read that block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

STORE, LOAD = "store", "load"


class KVCopy(NamedTuple):
    """One block copy between the device pool (block id) and the host tier (slot), in queue order."""

    op: str  # STORE: device -> host, LOAD: host -> device
    block_id: int
    slot: int


class TierHit(NamedTuple):
    """A prefix block found in the tier (returned by the manager's lookup beside device hits)."""

    block_hash: bytes
    slot: int
    index_keys: tuple[bytes, ...] | None


@dataclass
class KVOffloadStats:
    num_blocks: int  # tier capacity, blocks
    num_used_blocks: int
    block_bytes: int  # bytes one block occupies in the tier, over every rank of the engine
    queries: int  # tokens of prefix blocks the device missed, looked up in the tier
    hits: int  # tokens found there (they are also counted in EngineStats.prefix_hits)
    num_stored: int  # blocks copied device -> host
    num_loaded: int  # blocks copied host -> device
    num_evicted: int  # tier entries dropped (LRU) for newer ones
    num_dropped: int  # evicted device blocks not stored: every tier slot was locked by a queued load

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def store_bytes(self) -> int:
        return self.num_stored * self.block_bytes

    @property
    def load_bytes(self) -> int:
        return self.num_loaded * self.block_bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def sum_stats(stats: list[KVOffloadStats | None]) -> KVOffloadStats | None:
    """The figures of several tiers (a DP group's ranks) as one."""
    parts = [s for s in stats if s is not None]
    if not parts:
        return None
    total = KVOffloadStats(**vars(parts[0]))
    for s in parts[1:]:
        for name, value in vars(s).items():
            if name != "block_bytes":
                setattr(total, name, getattr(total, name) + value)
    return total


class OffloadTier:
    def __init__(self, num_blocks: int, block_bytes: int):
        if num_blocks < 1:
            raise ValueError(f"the KV offload tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.entries: OrderedDict[bytes, tuple[int, tuple[bytes, ...] | None]] = OrderedDict()  # LRU first
        self.free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out low slots first
        self.locked: set[int] = set()  # slots read by a load still in `copies`
        self.copies: list[KVCopy] = []
        self.queries = self.hits = 0
        self.num_stored = self.num_loaded = self.num_evicted = self.num_dropped = 0

    # ---- device evictions ------------------------------------------------------------------------
    def store(self, block_id: int, block_hash: bytes, index_keys: tuple[bytes, ...] | None) -> None:
        """The device pool evicts cached block `block_id`: keep its bytes (no copy if the tier has them)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self.entries[block_hash] = (slot, index_keys)
        self.copies.append(KVCopy(STORE, block_id, slot))
        self.num_stored += 1

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for h, (slot, _) in self.entries.items():  # least recently used first; locked ones are few
            if slot not in self.locked:
                del self.entries[h]
                self.num_evicted += 1
                return slot
        return None

    # ---- prefix lookups ------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, num_tokens: int) -> TierHit | None:
        """One device-missed block of `num_tokens` tokens looked up (counted as a query, and a hit if found)."""
        self.queries += num_tokens
        entry = self.entries.get(block_hash)
        if entry is None:
            return None
        self.hits += num_tokens
        return TierHit(block_hash, entry[0], entry[1])

    def lock(self, hit: TierHit) -> None:
        """Before the device blocks for `hit` are allocated: that allocation's stores must not take its slot."""
        self.locked.add(hit.slot)

    def load(self, hit: TierHit, block_id: int) -> None:
        """Queue the copy of a locked hit into the device block allocated for it."""
        assert hit.slot in self.locked, "lock a tier hit before allocating its device block"
        self.entries.move_to_end(hit.block_hash)
        self.copies.append(KVCopy(LOAD, block_id, hit.slot))
        self.num_loaded += 1

    def take_copies(self) -> list[KVCopy]:
        """The queued copies, in order, for the runner (which runs them before anything after them): the
        slots they read may be reused from now on."""
        copies, self.copies = self.copies, []
        self.locked.clear()
        return copies

    def stats(self) -> KVOffloadStats:
        return KVOffloadStats(num_blocks=self.num_blocks, num_used_blocks=len(self.entries),
                              block_bytes=self.block_bytes, queries=self.queries, hits=self.hits,
                              num_stored=self.num_stored, num_loaded=self.num_loaded, num_evicted=self.num_evicted,
                              num_dropped=self.num_dropped)
