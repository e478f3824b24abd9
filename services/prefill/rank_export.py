"""NIXL on the worker ranks of a multi-rank prefill engine (run there through `collective_rpc`).

Each worker rank registers its own cache tensors with its own NIXL agent. Workers have no event loop
(they block in the engine's collectives between steps), so their agents use NIXL's progress thread:
decode READs from them passively and needs the target side to make progress.
"""

from __future__ import annotations

import os
import secrets

from services.transfer.nixl_agent import NixlAgent

_AGENT: NixlAgent | None = None
_TENSORS: list = []  # this rank's registered cache tensors (BlockTensors), remembered for later calls


def setup(runner, instance_id: str) -> dict | None:
    """On a worker rank: create the agent and register this rank's cache (idempotent). Rank 0 (the
    service process) answers None: its exporter owns an agent on the event loop already."""
    global _AGENT, _TENSORS
    if runner.comm.rank == 0:
        return None
    if _AGENT is None:
        _AGENT = NixlAgent(f"{instance_id}.r{runner.comm.rank}.{os.getpid()}.{secrets.token_hex(3)}",
                           progress_thread=True)
        _TENSORS = _AGENT.register({"mla": runner.kv_cache.mla, "index": runner.kv_cache.index})
    return {"agent_name": _AGENT.name, "agent_metadata": _AGENT.metadata(), "tensors": _TENSORS}


def ping(runner) -> int:
    """A no-op collective: it fails at once on rank 0 when a worker rank's process is gone."""
    return runner.comm.rank
