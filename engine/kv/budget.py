"""How many KV blocks an engine gets: explicit, or what its memory budget holds after the weights.

On a GPU, `gpu_memory_utilization` is this engine's share of its GPU, as in vLLM: the engine may use
share x total memory in all, so its KV budget is that minus what this process already holds (weights,
activations, the CUDA context's allocations); other processes' memory is theirs and does not count.
Engines sharing a GPU therefore fit when their shares add up to at most 1; a budget that exceeds the
GPU's free memory (others took more than 1 - share) is refused with a message saying so.
"""

from __future__ import annotations

import torch

from engine.config.engine import EngineConfig
from engine.kv.cache import KVCacheSpec, num_blocks_for_bytes

_GIB = 1 << 30
_HEADROOM = 256 << 20  # left free when the budget is cut to what is free
_TOLERANCE = 2 * _GIB  # a shortfall this small is CUDA contexts, not an over-committed GPU


def gpu_kv_budget(share: float, total: int, free: int, used_by_me: int, device: str = "cuda") -> int:
    """Bytes of KV an engine with `share` of a `total`-byte GPU may allocate, holding `used_by_me`
    already, with `free` bytes free on the GPU. A shortfall up to `_TOLERANCE` (the CUDA contexts of
    the processes on the GPU, which no allocator counts) shrinks the budget to what is free less
    `_HEADROOM`; a larger one is a GPU over-committed by other processes: RuntimeError."""
    budget = int(total * share) - used_by_me
    room = free - _HEADROOM
    if budget <= room:
        return budget
    if budget - room <= _TOLERANCE:
        return room
    raise RuntimeError(
        f"gpu_memory_utilization {share:g} of {device} ({total * share / _GIB:.1f} GiB) leaves "
        f"{budget / _GIB:.2f} GiB for KV after this engine's own {used_by_me / _GIB:.2f} GiB, but only "
        f"{free / _GIB:.2f} GiB of the GPU is free: other processes hold {(total - free - used_by_me) / _GIB:.2f} "
        "GiB. Engines sharing a GPU need shares that add up to at most 1: lower gpu_memory_utilization")


def num_kv_blocks(cfg: EngineConfig, spec: KVCacheSpec) -> int:
    """Runtime size of the KV pool: explicit, else what the memory budget holds."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    if torch.device(cfg.device).type == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = gpu_kv_budget(cfg.cache.gpu_memory_utilization, total, free, _used_by_this_process(),
                               str(torch.device(cfg.device)))
    else:
        budget = int(cfg.cache.cpu_kv_cache_gib * _GIB)
    n = num_blocks_for_bytes(spec, budget)
    if n < 1:
        raise RuntimeError(f"no room for a single KV block ({spec.block_bytes} B) in a budget of {budget} B; "
                           "raise gpu_memory_utilization / cpu_kv_cache_gib or lower max_model_len")
    return n


def _used_by_this_process() -> int:
    """What this process holds on its GPU: the caching allocator's reservations (weights, activations,
    workspaces). The CUDA context itself is left out, as the part of `free` it already took."""
    return torch.cuda.memory_reserved()
