"""Hybrid residency: which pages of each request have a device copy. Ints only, no tensors.

Every MLA row is written through to the host pool, so a device page is only a cache of a host page:

    RESIDENT  every page has a device copy; attention reads them in place (no hot buffer)
    MIXED     some pages were dropped ("spilled"); a hot buffer of H device blocks serves selected rows
              of the spilled pages, the rest are read in place
    HOST      no page left on the device; the hot buffer only

Dropping a page costs nothing (its bytes are on the host already); bringing one back copies it.
Under pressure the longest request gives up pages one at a time (a RESIDENT one first turns H of its
pages into its hot buffer, which only pays with more than H pages); a request that cannot fit even if
all others gave up what they can goes straight to its hot buffer. When room frees, the non-resident
request closest to RESIDENT comes back whole and returns its hot buffer; spare blocks go to the tail
pages of non-resident requests (their newest rows are then read in place).

Admission (`DeviceFootprint`, checked by the scheduler's KV manager): the sum over requests of
min(pages, H) must fit the pool. Any set of requests that passes can be placed: short ones resident,
long ones down to a hot buffer, so `rebalance` never fails for a request the scheduler let in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class DeviceFootprint:
    """Scheduler-side admission by device room: sum of min(pages, hot_blocks) <= capacity."""

    def __init__(self, capacity_blocks: int, hot_blocks: int):
        self.capacity = capacity_blocks
        self.hot_blocks = hot_blocks
        self.used = 0

    def cost(self, num_pages: int) -> int:
        return min(num_pages, self.hot_blocks)

    def fits(self, old_pages: int, new_pages: int) -> bool:
        return self.used - self.cost(old_pages) + self.cost(new_pages) <= self.capacity

    def update(self, old_pages: int, new_pages: int) -> None:
        self.used += self.cost(new_pages) - self.cost(old_pages)
        assert 0 <= self.used <= self.capacity, f"device footprint {self.used} outside [0, {self.capacity}]"


@dataclass
class ReqPages:
    slot: int  # row of the device-side page table mirror
    host_blocks: list[int] = field(default_factory=list)
    dev: list[int] = field(default_factory=list)  # device block of each page, -1: host only
    hot_slot: int = -1  # >= 0: has a hot buffer (MIXED or HOST)
    hot_blocks: list[int] = field(default_factory=list)
    num_filled_pages: int = 0  # pages holding written rows (a restore copies only these)
    num_dev_pages: int = 0  # pages with a device copy (kept in step with `dev`)
    spill_from: int = 0  # every page below this one is host only (pages are spilled oldest first)

    @property
    def state(self) -> str:
        if self.hot_slot < 0:
            return "resident"
        return "mixed" if self.num_dev_pages else "host"


@dataclass
class StepActions:
    """What the runner must do to its tensors before the step (filled by sync / rebalance)."""

    reset_slots: list[int] = field(default_factory=list)  # page-table rows to clear (-1)
    page_updates: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, page, device block or -1)
    hot_assigned: list[tuple[int, list[int]]] = field(default_factory=list)  # (hot slot, blocks): fresh LRU
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block) copies


class Residency:
    def __init__(self, num_device_blocks: int, hot_blocks: int, max_reqs: int, offload_only: bool = False):
        self.num_device_blocks = num_device_blocks
        self.hot_blocks = hot_blocks
        self.offload_only = offload_only
        self.free: list[int] = list(range(num_device_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.free_slots = list(range(max_reqs - 1, -1, -1))
        self.max_hot = 0 if offload_only else num_device_blocks // hot_blocks
        self.free_hot = list(range(self.max_hot - 1, -1, -1))
        self.reqs: dict[str, ReqPages] = {}
        self.actions = StepActions()
        self.num_spilled_pages = 0  # pages dropped from the device, ever
        self.num_restored_pages = 0  # pages copied back, ever
        self.version = 0  # bumped by every change of placement (routing memos are keyed by it)
        # (version, margin) after the last full rebalance, None while something it reads has changed since
        # (pages, fill, requests): placement is a fixed point of rebalance, so a settled one is skipped
        self.settled: tuple[int, int] | None = None

    # ---- requests --------------------------------------------------------------------------------
    def sync(self, req_id: str, host_blocks: list[int], num_filled_tokens: int, block_size: int = 64) -> ReqPages:
        """Register a request or append its new pages (block lists only grow while it runs)."""
        r = self.reqs.get(req_id)
        if r is None:
            if not self.free_slots:
                raise RuntimeError("more running requests than hisparse page-table rows: raise max_num_seqs")
            r = self.reqs[req_id] = ReqPages(slot=self.free_slots.pop())
            self.actions.reset_slots.append(r.slot)
            self.settled = None
        n = len(r.host_blocks)  # block lists only grow (checked on the last known block: O(1) per step)
        assert len(host_blocks) >= n and (n == 0 or host_blocks[n - 1] == r.host_blocks[-1]), \
            f"{req_id}: host blocks may only be appended"
        if len(host_blocks) > n:
            self.version += 1
        for hb in host_blocks[len(r.host_blocks):]:
            r.host_blocks.append(hb)
            r.dev.append(-1)
        filled = max(r.num_filled_pages, -(-num_filled_tokens // block_size))
        if filled != r.num_filled_pages:
            r.num_filled_pages = filled
            self.settled = None
        if self.offload_only and r.hot_slot < 0:
            r.hot_slot = -2  # never resident, no hot buffer: every step stages the whole context
        return r

    def sync_all(self, synced: list[tuple[str, list[int], int]], block_size: int = 64) -> None:
        """`sync` each (req_id, host block ids, tokens written), skipping without a call the requests that bring
        no new page and fill none: what most decode steps bring."""
        reqs = self.reqs
        for rid, blocks, num_written in synced:
            r = reqs.get(rid)
            if (r is not None and len(blocks) == len(r.host_blocks)
                    and -(-num_written // block_size) <= r.num_filled_pages
                    and (not blocks or blocks[-1] == r.host_blocks[-1])):
                continue
            self.sync(rid, blocks, num_written, block_size)

    def drop(self, req_id: str) -> None:
        r = self.reqs.pop(req_id, None)
        if r is None:
            return
        self.version += 1
        self.free.extend(d for d in r.dev if d >= 0)
        self._release_hot(r)
        self.free_slots.append(r.slot)

    # ---- placement -------------------------------------------------------------------------------
    def rebalance(self, margin: int) -> StepActions:
        """Give every RESIDENT request all its pages (making room, or making it non-resident when it is
        the longest), then bring back whole requests while `margin` free blocks stay spare for next
        step's growth. Restores are emitted for the final placement only. Returns and clears the actions.
        Skipped while settled: nothing it reads changed since the last one (most decode steps)."""
        if not self.offload_only and self.settled != (self.version, margin):
            self._placed: list[tuple[ReqPages, int, int]] = []
            for r in sorted(self.reqs.values(), key=lambda r: r.slot):
                if r.hot_slot == -1:
                    self._fill(r)
            self._restore(margin)
            self._top_up(margin)
            self._emit_restores()
            for r in self.reqs.values():
                assert r.hot_slot >= 0 or r.num_dev_pages == len(r.dev), "a resident request lacks a device page"
            self.settled = (self.version, margin)
        actions, self.actions = self.actions, StepActions()
        return actions

    def _fill(self, r: ReqPages) -> None:
        if r.num_dev_pages == len(r.dev):
            return
        missing = [p for p, d in enumerate(r.dev) if d < 0]
        if len(missing) > len(self.free) + self._reclaimable(r):
            self._to_sparse(r)  # cannot fit even if everyone else gave up what they can: only its hot buffer
            return
        for p in missing:
            if not self.free and not self._make_room(1, requester=r):
                raise RuntimeError("hisparse residency: room promised by _reclaimable was not found")
            if r.hot_slot >= 0:  # r was the longest: it went non-resident instead
                return
            self._place(r, p, self.free.pop())

    def _reclaimable(self, r: ReqPages) -> int:
        """Blocks the others can give up: every page of a hot-buffer request, the pages beyond H of a
        resident one (which then keeps them as its hot buffer)."""
        return sum(o.num_dev_pages if o.hot_slot >= 0 else max(o.num_dev_pages - self.hot_blocks, 0)
                   for o in self.reqs.values() if o is not r)

    def _place(self, r: ReqPages, page: int, block: int) -> None:
        self.version += 1
        r.dev[page] = block
        r.num_dev_pages += 1
        r.spill_from = min(r.spill_from, page)
        self.actions.page_updates.append((r.slot, page, block))
        self._placed.append((r, page, block))

    def _emit_restores(self) -> None:
        """Copy back the written pages that were placed this step and kept their block to the end."""
        done = set()
        for r, p, b in self._placed:
            if r.dev[p] == b and p < r.num_filled_pages and (r.slot, p) not in done:
                done.add((r.slot, p))
                self.actions.restores.append((r.host_blocks[p], b))
                self.num_restored_pages += 1

    def _make_room(self, n: int, requester: ReqPages | None = None) -> bool:
        """Free device blocks until n are free. The longest request (pages in all) gives: one page at a
        time if it has a hot buffer; a resident one first turns H of its pages into its hot buffer (only
        worth it with more than H pages; the requester qualifies as it is about to hold them all)."""
        H = self.hot_blocks
        while len(self.free) < n:
            cands = [o for o in self.reqs.values()
                     if (o.hot_slot >= 0 and o.num_dev_pages > 0)
                     or (o.hot_slot == -1 and len(o.dev) > H and (o.num_dev_pages > H or o is requester))]
            if not cands:
                return False
            v = max(cands, key=lambda o: (len(o.dev), o.hot_slot >= 0, -o.slot))
            if v.hot_slot >= 0:
                self.free.append(self._spill(v, self._next_spill(v)))
            else:
                self._to_sparse(v)
                if v is requester:
                    return True
        return True

    def _to_sparse(self, r: ReqPages) -> None:
        """RESIDENT -> MIXED/HOST: H of its own pages (or free blocks) become its hot buffer."""
        assert self.free_hot, "no hot-buffer slot left: the device footprint admitted too many requests"
        blocks = [self._spill(r, self._next_spill(r)) for _ in range(min(self.hot_blocks, r.num_dev_pages))]
        r.hot_slot = self.free_hot.pop()
        self.version += 1
        while len(blocks) < self.hot_blocks:
            if not self.free and not self._make_room(1):
                raise RuntimeError("device pool cannot hold a hot buffer: the device footprint check was bypassed")
            blocks.append(self.free.pop())
        r.hot_blocks = blocks
        self.actions.hot_assigned.append((r.hot_slot, list(blocks)))

    def _next_spill(self, r: ReqPages) -> int:
        """The device page to drop next: the oldest, the page being written (and later ones) last.
        Amortised O(1): pages below `spill_from` are known to be spilled already."""
        tail = max(r.num_filled_pages - 1, 0)
        for p in range(r.spill_from, tail):
            if r.dev[p] >= 0:
                r.spill_from = p + 1
                return p
        r.spill_from = tail
        return next(p for p in range(tail, len(r.dev)) if r.dev[p] >= 0)

    def _spill(self, r: ReqPages, page: int) -> int:
        self.version += 1
        block = r.dev[page]
        r.dev[page] = -1
        r.num_dev_pages -= 1
        self.actions.page_updates.append((r.slot, page, -1))
        self.num_spilled_pages += 1
        return block

    def _restore(self, margin: int) -> None:
        sparse = sorted((r for r in self.reqs.values() if r.hot_slot >= 0),
                        key=lambda r: (len(r.dev) - r.num_dev_pages, r.slot))
        for r in sparse:
            if len(r.dev) - r.num_dev_pages + margin > len(self.free) + self.hot_blocks:
                break
            self._release_hot(r)
            for p in [p for p, d in enumerate(r.dev) if d < 0]:
                self._place(r, p, self.free.pop())

    def _top_up(self, margin: int) -> None:
        """Spare blocks go to the tail page (the one being written, and lookahead ones) of non-resident
        requests: their newest rows are then written and read in place. At most one page is copied each."""
        for r in sorted((r for r in self.reqs.values() if r.hot_slot >= 0), key=lambda r: r.slot):
            for p in range(max(r.num_filled_pages - 1, 0), len(r.dev)):
                if len(self.free) <= margin:
                    return
                if r.dev[p] < 0:
                    self._place(r, p, self.free.pop())

    def _release_hot(self, r: ReqPages) -> None:
        if r.hot_slot >= 0:
            self.version += 1
            self.free.extend(r.hot_blocks)
            self.free_hot.append(r.hot_slot)
        r.hot_slot, r.hot_blocks = -1, []

    # ---- counts ----------------------------------------------------------------------------------
    def count_states(self) -> dict[str, int]:
        out = {"resident": 0, "mixed": 0, "host": 0}
        for r in self.reqs.values():
            out["host" if self.offload_only else r.state] += 1
        return out

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)
