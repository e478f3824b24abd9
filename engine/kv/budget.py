"""How many KV blocks an engine gets: explicit, or what its memory budget holds after the weights."""

from __future__ import annotations

import torch

from engine.config.engine import EngineConfig
from engine.kv.cache import KVCacheSpec, num_blocks_for_bytes


def num_kv_blocks(cfg: EngineConfig, spec: KVCacheSpec) -> int:
    """Runtime size of the KV pool: explicit, else what the memory budget holds."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    if torch.device(cfg.device).type == "cuda":
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free
        budget = int(total * cfg.cache.gpu_memory_utilization) - used_by_others
    else:
        budget = int(cfg.cache.cpu_kv_cache_gib * (1 << 30))
    n = num_blocks_for_bytes(spec, budget)
    if n < 1:
        raise RuntimeError(f"no room for a single KV block ({spec.block_bytes} B) in a budget of {budget} B; "
                           "raise gpu_memory_utilization / cpu_kv_cache_gib or lower max_model_len")
    return n
