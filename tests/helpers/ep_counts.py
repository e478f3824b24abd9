"""What the EP dispatcher should move: (token, destination rank) pairs counted from a single-rank engine's
routing of the same tokens (a forward hook on every MoE gate); what every rank counted (through
`core.collective_rpc`)."""

from __future__ import annotations

from contextlib import contextmanager

from engine.model.moe import MoEGate


@contextmanager
def routed_pairs(llm, world_size: int):
    """Counts into the yielded list [pairs]: every gate call's distinct (token, ids // experts per rank)."""
    per_rank = llm.config.model.n_routed_experts // world_size
    count = [0]

    def hook(_module, _inputs, out):
        ids = out[1]
        count[0] += len({(t, int(e) // per_rank) for t, row in enumerate(ids.tolist()) for e in row})

    handles = [m.register_forward_hook(hook) for m in llm.core.runner.model.modules() if isinstance(m, MoEGate)]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()


def _stats(runner) -> dict:
    hs = getattr(runner, "hisparse", None)
    return {"rank": runner.rank, "comm_bytes": dict(runner.comm.bytes), "comm_calls": dict(runner.comm.calls),
            "dummy_passes": getattr(runner, "dummy_passes", 0), "hisparse": hs.stats() if hs is not None else None,
            "planned_steps": getattr(runner, "planned_steps", 0), "dynamic_steps": getattr(runner, "dynamic_steps", 0)}


def _reset(runner) -> None:
    runner.comm.reset_counters()


def rank_stats(core) -> list[dict]:
    """Per rank: bytes and calls per collective tag, dummy passes (DP ranks), HiSparse counters."""
    return core.collective_rpc(_stats)


def reset_counters(core) -> None:
    core.collective_rpc(_reset)


def dispatched_rows(core, hidden_size: int, elem_size: int = 4) -> int:
    """Rows every rank received in ep_dispatch since the last counter reset, summed over the ranks."""
    total = sum(s["comm_bytes"].get("ep_dispatch", 0) for s in rank_stats(core))
    assert total % (hidden_size * elem_size) == 0
    return total // (hidden_size * elem_size)
