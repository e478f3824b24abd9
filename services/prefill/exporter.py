"""What a decode instance needs to READ a held request's KV: per rank, the NIXL peer and block ids.

Single-rank engines register their own cache tensors here. Multi-rank engines (PCP × DCP) report
each rank's agent and blocks through the engine's export hook (`rank_exports`)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from engine.frontend.async_engine import AsyncEngine
from services.transfer.nixl_agent import BlockTensor, NixlAgent


@dataclass
class RankExport:
    rank: int
    agent_name: str
    agent_metadata: bytes
    tensors: list[BlockTensor]
    block_ids: list[int]


class KVExporter:
    """Rank 0's cache is registered here (on the event loop's agent); with DCP > 1 every other rank
    registers its own (`rank_export.setup`, once, at `start`)."""

    def __init__(self, instance_id: str, engine: AsyncEngine, metrics=None):
        self.instance_id, self.engine = instance_id, engine
        cfg = engine.config
        self.dcp_size = cfg.parallel.decode_context_parallel_size
        self.interleave = cfg.parallel.cp_kv_cache_interleave_size
        self.spec = engine.core.runner.spec
        self.agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}", metrics=metrics)
        cache = engine.core.runner.kv_cache
        self.tensors = self.agent.register({"mla": cache.mla, "index": cache.index})
        self.workers: list[dict | None] = []

    async def start(self) -> None:
        if self.dcp_size > 1:
            self.workers = await self.engine.call(
                lambda core: core.collective_rpc("services.prefill.rank_export:setup", self.instance_id))

    async def rank_pages(self, req_id: str) -> list[RankExport]:
        block_ids = await self.engine.call(lambda c: c.held_block_ids(req_id))
        mine = RankExport(rank=0, agent_name=self.agent.name, agent_metadata=self.agent.metadata(),
                          tensors=self.tensors, block_ids=block_ids)
        if self.dcp_size == 1:  # one rank, or PCP ranks that each hold a full replica: rank 0 exports it
            return [mine]
        # DCP: block ids are virtual (the same local id on every rank, each with its share of the tokens)
        return [mine] + [RankExport(rank=r, block_ids=block_ids, **w) for r, w in enumerate(self.workers) if r > 0]
