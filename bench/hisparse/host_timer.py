"""Inclusive host time of chosen functions, without a profiler's overhead: each is replaced by a wrapper that
adds its wall-clock time (and a call) to a label while the timer is on. Used by `bench.hisparse
--host-breakdown` to tell where a host-bound step's issue time goes; nested functions overlap (inclusive)."""

from __future__ import annotations

import importlib
import time


class HostTimer:
    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, target: str) -> None:
        """`module:attr` or `module:Class.method` (the name as it is looked up by its callers)."""
        mod_name, path = target.split(":")
        owner = importlib.import_module(mod_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        clock, seconds, calls = time.perf_counter, self.seconds, self.calls
        seconds.setdefault(path, 0.0)
        calls.setdefault(path, 0)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[path] += clock() - t
                calls[path] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn))

    def restore(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()

    def per_step(self, steps: int) -> dict[str, dict]:
        """{label: {"us": microseconds per step, "calls": calls per step}}, largest first."""
        rows = {k: {"us": round(v / steps * 1e6, 1), "calls": round(self.calls[k] / steps, 2)}
                for k, v in self.seconds.items() if self.calls[k]}
        return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))


# what `bench.hisparse --host-breakdown` times (the step's own parts and HiSparse's)
STEP_PARTS = [
    "bench.hisparse.run:place", "bench.hisparse.run:decode_meta", "bench.hisparse.stack:TopkStream.next",
    "bench.hisparse.stack:DenseStack.qkv", "bench.hisparse.stack:DenseStack.finish",
    "engine.attention.triton_backend:TritonAttentionBackend.store_kv",
    "engine.attention.triton_backend:TritonAttentionBackend.sparse_mla",
    "engine.hisparse.backend:HiSparseBackend.store_kv", "engine.hisparse.backend:HiSparseBackend.sparse_mla",
    "engine.hisparse.backend:plan_forward", "engine.hisparse.backend:HiSparseBackend._resolve_virtual",
    "engine.hisparse.backend:plan_hot", "engine.hisparse.forward:_dev_slots", "engine.hisparse.forward:sub_batch",
    "engine.hisparse.row_mover:RowMover.copy_layers", "engine.hisparse.row_mover:RowMover.copy_group",
    "engine.hisparse.row_mover:RowMover.wait", "engine.hisparse.row_mover:RowMover._copy_part",
    "engine.hisparse.manager:HiSparseManager.place",
]
