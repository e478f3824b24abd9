"""Block pool: ref counts, an LRU free queue and the prefix-cache map. Ints only, no tensors.

Every block with ref_cnt == 0 sits in the free queue. A freed block keeps its hash (it stays a prefix
cache hit) until allocation pops it from the queue's head and evicts it; freeing appends to the tail,
so the least recently used cached blocks go first. An evicted cached block is handed to `on_evict`
(block id, hash, index keys) first: the KV offload tier keeps its bytes (engine/kv/offload.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list with O(1) popleft, append and remove-from-the-middle."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev
        last.next, b.prev, b.next, self._tail.prev = b, last, self._tail, b
        self.num_free += 1

    def remove(self, b: KVBlock) -> None:
        assert b.prev is not None and b.next is not None, f"{b} is not in the free queue"
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise RuntimeError("no free KV blocks: the scheduler must check num_free before allocating")
        b = self._head.next
        self.remove(b)
        return b


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.events: list[tuple[str, bytes]] = []  # ("stored" | "removed", hash), drained by services
        self.index_keys: dict[bytes, tuple[bytes, ...]] = {}  # cached hash -> the keys its events carry
        # called as (block id, hash, index keys) when allocation evicts a cached block (the offload tier)
        self.on_evict: Callable[[int, bytes, tuple[bytes, ...] | None], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b, offload=True)
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks: a prefix hit."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; callers pass a request's blocks in reverse so its tail evicts first."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    self._evict(b)
                self.free_queue.append(b)

    def cache(self, b: KVBlock, block_hash: bytes, index_keys: tuple[bytes, ...] | None = None) -> None:
        """Publish a full, computed block under its hash (first writer wins for duplicates). `index_keys`:
        the hashes its stored / removed events carry instead (a DCP virtual block announces each of its
        64-token sub-blocks, which is what the router's prefix index looks up)."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this copy stays private and is evicted on free
        b.block_hash = block_hash
        self.cached[block_hash] = b
        if index_keys:
            self.index_keys[block_hash] = index_keys
        self.events.extend(("stored", k) for k in index_keys or (block_hash,))

    def _evict(self, b: KVBlock, offload: bool = False) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
                own_keys = self.index_keys.pop(b.block_hash, None)
                if offload and self.on_evict is not None:
                    self.on_evict(b.block_id, b.block_hash, own_keys)
                # the events name the device pool: a block kept by the offload tier is no longer here
                self.events.extend(("removed", k) for k in own_keys or (b.block_hash,))
            b.block_hash = None

    def drain_events(self) -> list[tuple[str, bytes]]:
        ev, self.events = self.events, []
        return ev

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            self._evict(b)
        return True
