"""What a decode instance needs to READ a held request's KV: per rank, the NIXL peer and block ids.

Single-rank engines register their own cache tensors here. Multi-rank engines (PCP × DCP) report
each rank's agent and blocks through the engine's export hook (`rank_exports`)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from services.common.nixl_agent import BlockTensor, NixlAgent


@dataclass
class RankExport:
    rank: int
    agent_name: str
    agent_metadata: bytes
    tensors: list[BlockTensor]
    block_ids: list[int]


class KVExporter:
    def __init__(self, instance_id: str, engine: AsyncEngine, metrics=None):
        self.engine = engine
        cfg = engine.config
        self.dcp_size = cfg.parallel.decode_context_parallel_size
        self.interleave = cfg.parallel.cp_kv_cache_interleave_size
        self.spec = engine.core.runner.spec if hasattr(engine.core, "runner") else engine.core.spec
        self.agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}", metrics=metrics)
        if hasattr(engine.core, "runner"):
            cache = engine.core.runner.kv_cache
            self.tensors = self.agent.register({"mla": cache.mla, "index": cache.index})
        else:  # multi-rank: every rank registers its own cache with its own agent
            self.tensors = []

    async def rank_pages(self, req_id: str) -> list[RankExport]:
        core = self.engine.core
        if hasattr(core, "rank_exports"):
            return [RankExport(**e) for e in await self.engine.call(lambda c: c.rank_exports(req_id))]
        block_ids = await self.engine.call(lambda c: c.held_block_ids(req_id))
        return [RankExport(rank=0, agent_name=self.agent.name, agent_metadata=self.agent.metadata(),
                           tensors=self.tensors, block_ids=block_ids)]
