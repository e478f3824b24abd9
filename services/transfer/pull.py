"""Pull: a request's KV from the prefill ranks into this decode engine's blocks over NIXL (the import side).

Token i of the prompt lives on prefill rank (i // I) % N at local index (i // (I·N))·I + i % I
(DCP over N ranks, interleave I; N = 1 is the plain case; the rule is engine.parallel.dcp's, used here
as is). When I is a multiple of the block size,
whole blocks map to whole blocks and are READ straight into place. Otherwise each rank's blocks are
READ into a registered staging area, chunk by chunk, and their rows scattered into place.
Under HiSparse the MLA rows live in a host pool and the indexer rows on the GPU: the staging area
mirrors that (each staged tensor on its destination's device), and every READ is split by memory type
(services/transfer/nixl_agent.py). The READs carry no notification: the decode service confirms the
copy with ReleaseKV afterwards (page generations, services/prefill/leases.py), which also frees the
prefill's pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.kv.export import kv_regions
from engine.parallel.dcp import local_index, num_local, owner_rank
from kernels.formats import read_index_rows, write_index_rows
from services.transfer.convert import nixl_peer_from_proto
from services.transfer.nixl_agent import BlockDescList, NixlAgent, deadline_in


@dataclass
class PullPlan:
    """Per rank: (remote block ids, local block ids) READ directly; or rows to scatter after staging."""

    direct: dict[int, tuple[list[int], list[int]]]


def token_home(i: int, dcp: int, interleave: int) -> tuple[int, int]:
    """Global token -> (rank, rank-local token index): the engine's own DCP placement rule."""
    return owner_rank(i, dcp, interleave), local_index(i, dcp, interleave)


def direct_plan(num_tokens: int, first_block: int, dcp: int, interleave: int, block_size: int,
                rank_blocks: dict[int, list[int]], local_blocks: list[int]) -> PullPlan:
    """Whole-block mapping (interleave a multiple of the block size, or a single rank)."""
    plan: dict[int, tuple[list[int], list[int]]] = {r: ([], []) for r in rank_blocks}
    for g in range(first_block, -(-num_tokens // block_size)):
        rank, local_tok = token_home(g * block_size, dcp, interleave)
        plan[rank][0].append(rank_blocks[rank][local_tok // block_size])
        plan[rank][1].append(local_blocks[g])
    return PullPlan(direct=plan)


rank_num_tokens = num_local  # tokens of a prompt that one rank holds (engine.parallel.dcp)


def check_rank_blocks(kv, dcp: int, interleave: int, block_size: int) -> None:
    """ValueError unless every rank of the handle lists a block for each of its tokens (a short list
    would leave rows of our blocks unwritten, or index past the list)."""
    for rp in kv.ranks:
        if not 0 <= rp.rank < dcp:
            raise ValueError(f"KV handle rank {rp.rank} is outside dcp_size {dcp}")
        need = -(-rank_num_tokens(kv.num_tokens, rp.rank, dcp, interleave) // block_size)
        if len(rp.block_ids) < need:
            raise ValueError(f"KV handle rank {rp.rank} lists {len(rp.block_ids)} blocks; its "
                             f"{kv.num_tokens}-token share needs {need}")


class KVPuller:
    def __init__(self, agent: NixlAgent, cache: PagedKVCache, spec: KVCacheSpec, *, staging_blocks: int = 64,
                 timeout_s: float = 30.0):
        self.agent, self.cache, self.spec = agent, cache, spec
        self.block_size = spec.block_size
        self.local = agent.prep_local(agent.register(kv_regions(cache)))
        self.staging = StagingArea(cache, staging_blocks)
        self.staging_local = agent.prep_local(agent.register(kv_regions(self.staging)))
        self.timeout_s = timeout_s
        self._remote: dict[tuple[str, tuple], BlockDescList] = {}

    def _remote_descs(self, peer_proto) -> BlockDescList:
        name, metadata, tensors = nixl_peer_from_proto(peer_proto)
        if metadata and not self.agent.has_peer(name):
            name = self.agent.add_peer(metadata)
        key = (name, tuple(tensors))
        if key not in self._remote:
            self._remote[key] = self.agent.prep_remote(name, tensors)
        return self._remote[key]

    async def pull(self, kv, local_blocks: list[int], num_cached: int) -> int:
        """READ blocks [num_cached // block_size, ...) of the handle into `local_blocks`; returns bytes."""
        first = num_cached // self.block_size
        ranks = {rp.rank: rp for rp in kv.ranks}
        dcp, inter = max(kv.dcp_size, 1), max(kv.cp_kv_cache_interleave_size, 1)
        if len(ranks) != dcp:
            raise ValueError(f"KV handle lists {len(ranks)} ranks for dcp_size {dcp}")
        check_rank_blocks(kv, dcp, inter, self.block_size)
        deadline = deadline_in(self.timeout_s)
        if dcp == 1 or inter % self.block_size == 0:
            plan = direct_plan(kv.num_tokens, first, dcp, inter, self.block_size,
                               {r: list(rp.block_ids) for r, rp in ranks.items()}, local_blocks)
            moved = 0
            for r, (remote_ids, local_ids) in plan.direct.items():
                xfer = self.agent.read(self.local, local_ids, self._remote_descs(ranks[r].peer), remote_ids)
                await self.agent.wait(xfer, deadline)
                moved += xfer.num_bytes
            return moved
        return await self._pull_staged(kv, ranks, local_blocks, first, dcp, inter, deadline)

    async def _pull_staged(self, kv, ranks, local_blocks, first, dcp, inter, deadline) -> int:
        bs = self.block_size
        moved = 0
        for r, rp in ranks.items():
            remote = self._remote_descs(rp.peer)
            rank_ids = list(rp.block_ids)
            for c0 in range(0, len(rank_ids), self.staging.num_blocks):
                chunk = rank_ids[c0:c0 + self.staging.num_blocks]
                xfer = self.agent.read(self.staging_local, list(range(len(chunk))), remote, chunk)
                await self.agent.wait(xfer, deadline)
                moved += xfer.num_bytes
                self._scatter(r, c0, len(chunk), kv.num_tokens, first * bs, dcp, inter, local_blocks)
        return moved

    def _scatter(self, rank: int, c0: int, n: int, num_tokens: int, skip: int, dcp: int, inter: int,
                 local_blocks: list[int]) -> None:
        """Rows of staged rank-local blocks [c0, c0 + n) -> their global positions in our blocks."""
        bs = self.block_size
        src_slot, dst_slot = [], []
        for i in range(skip, num_tokens):
            rr, li = token_home(i, dcp, inter)
            if rr == rank and c0 * bs <= li < (c0 + n) * bs:
                src_slot.append(li - c0 * bs)
                dst_slot.append(local_blocks[i // bs] * bs + i % bs)
        if not src_slot:
            return
        for name in ("mla", "index"):
            src, dst = getattr(self.staging, name), getattr(self.cache, name)
            s = torch.tensor(src_slot, device=dst.device)  # index each tensor on its own device
            d = torch.tensor(dst_slot, device=dst.device)
            if name == "index":  # keys are block-major: a token's key is not the [block, :, token] entry
                write_index_rows(dst, d // bs, d % bs, read_index_rows(src, s // bs, s % bs))
            else:
                dst[d // bs, :, d % bs] = src[s // bs, :, s % bs]


class StagingArea:
    """`num_blocks` blocks shaped like the cache's, each tensor on the device of its counterpart (a
    HiSparse cache: MLA rows in pinned host memory, indexer rows on the GPU)."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"staging_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.mla, self.index = (_like(getattr(cache, name), num_blocks) for name in ("mla", "index"))


def _like(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    pin = t.device.type == "cpu" and t.is_pinned()
    return torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, device=t.device, pin_memory=pin)
