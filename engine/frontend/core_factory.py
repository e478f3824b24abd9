"""The engine core a config asks for: one process (EngineCore over a ModelRunner), the rank 0 of a multi-rank
engine (PCP x DCP x EP), or the driver of a DP x EP decode group. The one place that knows all three, above
engine/core (which knows only a runner factory) and engine/parallel."""

from __future__ import annotations

from engine.config.engine import EngineConfig
from engine.core.core import EngineCore
from engine.parallel.dp import DPEngineCore
from engine.parallel.executor import MultiRankEngineCore
from engine.runner import ModelRunner


def make_engine_core(cfg: EngineConfig, rank_pool=None) -> EngineCore:
    """`rank_pool`: an engine.parallel.spawn.RankPool whose idle ranks a multi-rank core may reuse."""
    if cfg.parallel.data_parallel_size > 1:  # a DP x EP group (engine/parallel/dp.py)
        return DPEngineCore(cfg, rank_pool=rank_pool)
    if cfg.parallel.world_size > 1:
        return MultiRankEngineCore(cfg, rank_pool=rank_pool)
    return EngineCore(cfg, ModelRunner)
