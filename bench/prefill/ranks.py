"""What the prefill benchmarks (and the CP tests) ask of every rank of a multi-rank engine, through
`core.collective_rpc`: its counters, and the DCP context prefetch switched on or off.

    stats = rank_stats(llm.core)                       # [{rank, indexer_rows_scored, comm_bytes, ...}, ...]
    reset_comm_counters(llm.core); set_kv_prefetch(llm.core, False)

`RANKS` is the benchmarks' rank pool: an engine built with `LLM(..., rank_pool=RANKS)` hands its spawned
ranks back at `core.shutdown()`, and the next engine of the same world size starts without spawning.
"""

from __future__ import annotations

from engine.parallel.spawn import RankPool

RANKS = RankPool()


def _stats(runner) -> dict:
    return {"rank": runner.rank, "indexer_rows_scored": runner.backend.indexer_rows_scored,
            "dcp_rows_scored": runner.backend.dcp_rows_scored, "comm_bytes": dict(runner.comm.bytes),
            "comm_calls": dict(runner.comm.calls)}


def _reset(runner) -> None:
    runner.comm.reset_counters()


def _prefetch(runner, on: bool) -> None:
    runner.kv_prefetch = bool(on)


def rank_stats(core) -> list[dict]:
    """Per rank: rows the indexer and the DCP path scored, bytes and calls per collective tag."""
    return core.collective_rpc(_stats)


def reset_comm_counters(core) -> None:
    core.collective_rpc(_reset)


def set_kv_prefetch(core, on: bool) -> None:
    """Overlap layer l+1's DCP context all-gather with layer l (True, the default) or not."""
    core.collective_rpc(_prefetch, on)
