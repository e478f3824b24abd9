"""Hybrid HiSparse (docs/hisparse.md): every request's MLA rows in a host pool, device pages while they fit, and a
small per-request hot buffer of selected rows once they do not.

    layout.py     sizes of the hot buffer, layer groups (a full indexer layer + the layers sharing its top-k)
    host_pool.py  the cache: host pool as `mla` (by block id), device index cache, device pool of pages + hot rows
    residency.py  which pages have a device copy; spill / restore page by page; device admission (ints only)
    hot_buffer.py per-request LRU of hot rows: one plan per step and full layer (hits, misses, victims)
    forward.py    per-forward routing of each request: resident, hot (decode rows) or staged (prefill rows); on the
                  padded static decode path from fixed device tensors (StaticRouting, plan_static: CUDA graphs)
    builder.py    the static metadata builder of padded decode forwards: routing ints in the batch's one copy
    backend.py    the attention-backend wrapper the model calls (its state on the metadata: FORWARD_STATE)
    row_mover.py  row copies (torch on CPU; the Triton kernel with pinned host memory and a side stream on CUDA)
    manager.py    what the ModelRunner owns: all of the above, the per-step hook and the counters (on the device,
                  read from a pinned snapshot while a step runs)
"""

from engine.hisparse.manager import HiSparseManager, HiSparseStats

__all__ = ["HiSparseManager", "HiSparseStats"]
