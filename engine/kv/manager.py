"""Which blocks each request holds, prefix-cache hits and slot allocation. Ints only, no tensors.

With decode context parallelism over N ranks a block id names one *virtual* block of 64·N tokens:
the same local block id on every rank, each rank holding its 1/N of the tokens (docs/parallelism.md, "DCP: which
rank holds token i"). The
prefix hash of a virtual block is the 64-token chained hash of its last sub-block, and its index
events carry every sub-block's 64-token hash, so the router's 64-token prefix lookups find it.

With a host offload tier (`offload`, engine/kv/offload.py) the lookup continues into the tier where the
device misses; a tier hit gets a device block at allocation, loaded before the forward that reads it:

    prefix blocks:   [ dev | dev | tier | dev | tier | miss ...        hits = the first five
    request blocks:  [ dev | dev | new(load) | dev | new(load) | fresh ...
"""

from __future__ import annotations

from typing import Protocol

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.offload import KVCopy, KVOffloadStats, OffloadTier, TierHit


class Request(Protocol):
    """What the KV manager reads of a request (engine.core.request.Request has it): ids, counts and the
    prefix hashes of its full blocks."""

    req_id: str
    num_tokens: int
    num_computed_tokens: int
    return_prompt_logits: bool

    def block_hashes(self, block_size: int) -> list[bytes]: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 64, dcp_size: int = 1, enable_caching: bool = True,
                 offload: OffloadTier | None = None):
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.offload = offload if enable_caching else None  # the host tier extends the prefix cache
        if self.offload is not None:
            self.pool.on_evict = self.offload.store
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # how many leading blocks of a request are published
        self.prefix_queries = 0  # tokens looked up / hit, for the hit-rate metric
        self.prefix_hits = 0
        # HiSparse: block ids are host blocks; this bounds what the device pool must hold for them
        # (engine.hisparse.residency.DeviceFootprint: fits(old, new) / update(old, new) in blocks)
        self.device_footprint = None

    # ---- lookup --------------------------------------------------------------------------------
    def _virtual_hashes(self, req: Request) -> list[bytes]:
        h = req.block_hashes(self.block_size)
        n = self.dcp_size
        return h[n - 1::n] if n > 1 else h

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock | TierHit], int]:
        """Longest cached prefix (full blocks, on the device or in the offload tier), leaving at least one
        prompt token to compute. Pass the hits to `allocate_slots` unchanged."""
        if not self.pool.enable_caching or req.return_prompt_logits:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.tokens_per_block
        hits: list[KVBlock | TierHit] = []
        for h in self._virtual_hashes(req)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None and self.offload is not None:
                b = self.offload.lookup(h, self.tokens_per_block)
            if b is None:
                break
            hits.append(b)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.tokens_per_block
        return hits, len(hits) * self.tokens_per_block

    # ---- allocation ----------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock | TierHit] = (),
                       num_lookahead: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` (+ lookahead draft slots) after the computed ones.

        Returns the ids of blocks newly added to the request (hits first), or None if the pool is short
        (nothing changes then).
        """
        held = self.req_blocks.get(req.req_id, [])
        if computed and held:  # hits are the first blocks of a table: after held ones they would map wrong positions
            raise ValueError(f"request {req.req_id!r} already holds {len(held)} blocks: prefix hits are for a new one")
        if not computed and held and self.blocks_needed(req.num_computed_tokens + num_new_tokens + num_lookahead) \
                <= len(held):
            return []  # most decode steps: the blocks held have the slots already
        n_tokens = req.num_computed_tokens + len(computed) * self.tokens_per_block + num_new_tokens + num_lookahead
        n_new = max(self.blocks_needed(n_tokens) - len(held) - len(computed), 0)
        on_device = [b for b in computed if isinstance(b, KVBlock)]
        tier_hits = [b for b in computed if isinstance(b, TierHit)]
        # touching a hit that sits in the free queue takes it out of the allocatable pool; a tier hit takes one
        n_free_hits = sum(1 for b in on_device if b.ref_cnt == 0)
        if n_new + n_free_hits + len(tier_hits) > self.pool.num_free_blocks:
            return None
        fp, n_before, n_after = self.device_footprint, len(held), len(held) + len(computed) + n_new
        if fp is not None and not fp.fits(n_before, n_after):
            return None
        self.pool.touch(on_device)
        loaded = iter(self._load(tier_hits))
        hits = [b if isinstance(b, KVBlock) else next(loaded) for b in computed]
        fresh = self.pool.allocate(n_new)
        blocks = self.req_blocks.setdefault(req.req_id, [])
        blocks.extend(hits)
        blocks.extend(fresh)
        if hits:
            self._num_cached[req.req_id] = self._num_cached.get(req.req_id, 0) + len(hits)
        if fp is not None:
            fp.update(n_before, n_after)
        return [b.block_id for b in hits + fresh]

    def _load(self, tier_hits: list[TierHit]) -> list[KVBlock]:
        """Device blocks for tier hits, their loads queued and each published under its hash again. The hits'
        slots are locked first: the allocation may evict device blocks into the tier."""
        if not tier_hits:
            return []
        for hit in tier_hits:
            self.offload.lock(hit)
        blocks = self.pool.allocate(len(tier_hits))
        for b, hit in zip(blocks, tier_hits):
            self.offload.load(hit, b.block_id)
            self.pool.cache(b, hit.block_hash, hit.index_keys)
        return blocks

    def take_copies(self) -> list[KVCopy]:
        """The offload copies decided since the last call, in order (the runner runs them before anything
        that follows); empty without a tier."""
        return self.offload.take_copies() if self.offload is not None else []

    def offload_stats(self) -> KVOffloadStats | None:
        return self.offload.stats() if self.offload is not None else None

    def cache_blocks(self, req: Request, num_final_tokens: int) -> None:
        """Publish the full blocks among the first `num_final_tokens` (computed and not speculative)."""
        if not self.pool.enable_caching:
            return
        blocks = self.req_blocks.get(req.req_id, [])
        start = self._num_cached.get(req.req_id, 0)
        n_full = min(num_final_tokens // self.tokens_per_block, len(blocks))
        if n_full <= start:
            return
        hashes = self._virtual_hashes(req)
        subs = req.block_hashes(self.block_size) if self.dcp_size > 1 else None
        n = self.dcp_size
        for i in range(start, min(n_full, len(hashes))):
            self.pool.cache(blocks[i], hashes[i], tuple(subs[i * n:(i + 1) * n]) if subs is not None else None)
        self._num_cached[req.req_id] = min(n_full, len(hashes))

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self._num_cached.pop(req_id, None)
        if self.device_footprint is not None:
            self.device_footprint.update(len(blocks), 0)
        self.pool.free(reversed(blocks))

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks
