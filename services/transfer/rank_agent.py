"""NIXL on the worker ranks of a multi-rank prefill engine (run there through `collective_rpc`).

Each worker rank registers its own cache regions (`engine.kv.export.kv_regions`) with its own NIXL
agent. Workers have no event loop (they block in the engine's collectives between steps), and decode
READs from them passively, which needs progress on this side: the agent lives on an `AgentThread`, whose
event loop polls it (NIXL's own progress thread would spin a core per worker rank, idle or not), every 2 ms
without backing off: no call on this rank announces a decode's READ of its share.
"""

from __future__ import annotations

import os
import secrets

from engine.kv.export import kv_regions
from services.transfer.nixl_agent import AgentThread

_AGENT: AgentThread | None = None
_TENSORS: list = []  # this rank's registered cache tensors (BlockTensors), remembered for later calls


def setup(runner, instance_id: str) -> dict | None:
    """On a worker rank: create the agent and register this rank's cache (idempotent). Rank 0 (the
    service process) answers None: its exporter owns an agent on the event loop already."""
    global _AGENT, _TENSORS
    if runner.comm.rank == 0:
        return None
    if _AGENT is None:
        regions = kv_regions(runner.kv_cache)
        worker = AgentThread(f"{instance_id}.r{runner.comm.rank}.{os.getpid()}.{secrets.token_hex(3)}",
                             thread_name="nixl-rank", device=regions["index"].device,
                             idle_poll_interval_s=0.002)  # never idle: nothing here sees a peer's READ coming
        _TENSORS = worker.call(lambda: worker.agent.register(regions))
        _AGENT = worker
    agent = _AGENT.agent
    return {"agent_name": agent.name, "agent_metadata": _AGENT.call(agent.metadata), "tensors": _TENSORS}
