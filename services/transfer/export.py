"""Export: what a decode instance needs to READ a held request's KV (per rank: NIXL peer and block ids).

The engine says which bytes the KV is (`engine.kv.export`: its cache regions, and per rank the blocks
of a request); this module registers those regions with NIXL and builds the wire handle. Rank 0's
regions are registered on the event loop's agent; with DCP > 1 every other rank registers its own
(`services.transfer.rank_agent.setup`, once, at `start`).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from engine.frontend.async_engine import AsyncEngine
from engine.kv.export import kv_regions
from proto.pdserve.v1 import prefill_pb2
from services.rpc.convert import unix_ms
from services.transfer import rank_agent
from services.transfer.convert import kv_layout_to_proto, nixl_peer_to_proto
from services.transfer.nixl_agent import BlockTensor, NixlAgent


@dataclass
class RankExport:
    rank: int
    agent_name: str
    agent_metadata: bytes
    tensors: list[BlockTensor]
    block_ids: list[int]


class KVExporter:
    def __init__(self, instance_id: str, engine: AsyncEngine, metrics=None):
        self.instance_id, self.engine = instance_id, engine
        cfg = engine.config
        self.dcp_size = cfg.parallel.decode_context_parallel_size
        self.interleave = cfg.parallel.cp_kv_cache_interleave_size
        self.spec = engine.core.runner.spec
        self.agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}", metrics=metrics)
        self.tensors = self.agent.register(kv_regions(engine.core.runner.kv_cache))
        self.workers: list[dict | None] = []

    async def start(self) -> None:
        if self.dcp_size > 1:
            self.workers = await self.engine.call(
                lambda core: core.collective_rpc(rank_agent.setup, self.instance_id))

    def _peer(self, rank: int) -> dict:
        if rank == 0:
            return {"agent_name": self.agent.name, "agent_metadata": self.agent.metadata(), "tensors": self.tensors}
        return self.workers[rank]

    async def rank_pages(self, req_id: str, known: list | None = None) -> list[RankExport]:
        """Per rank holding a share of the held request's KV: its NIXL peer and blocks. `known`: the request's
        exports as its last output carried them (RequestOutput.kv_exports); else asked of the engine between
        two steps, which waits for the step it is in."""
        exports = known if known is not None else await self.engine.call(lambda c: c.kv_exports(req_id))
        return [RankExport(rank=e.rank, block_ids=e.block_ids, **self._peer(e.rank)) for e in exports]

    def kv_handle(self, lease, num_tokens: int, pages: list[RankExport], hashes: list[bytes],
                  num_cached: int) -> prefill_pb2.KVHandle:
        """The wire handle of an exported request's KV under `lease`."""
        return prefill_pb2.KVHandle(
            prefill_instance_id=self.instance_id, lease_id=lease.lease_id,
            lease_expires_unix_ms=unix_ms(lease.expires), num_tokens=num_tokens,
            layout=kv_layout_to_proto(self.spec), dcp_size=self.dcp_size, cp_kv_cache_interleave_size=self.interleave,
            ranks=[prefill_pb2.RankPages(rank=p.rank, block_ids=p.block_ids,
                                         peer=nixl_peer_to_proto(p.agent_name, p.agent_metadata, p.tensors))
                   for p in pages],
            block_hashes=hashes, num_cached_tokens=num_cached, block_generations=lease.generations)
