"""CUDA graphs of the padded decode forwards: one capture per (kind, padded requests, rows per request).

    start-up             every key is captured (`StaticDecode.capture_all`; a key first met later, which
                         start-up covers, would be captured then)
    capture of a key     one eager warm-up on a side stream (Triton compiles and picks its configs
                         outside the capture), then torch.cuda.graph captures the same forward on the
                         static buffers; every graph shares one memory pool
    every use            the caller has refilled the static buffers (one H2D copy); the MTP input hidden
                         rows are copied into a static buffer; replay; the static output is returned

A capture that fails (an operation that cannot be captured) is logged once and the engine decodes
eagerly from then on (`failed` says why; the GPU tests assert it stays None).

A request joining or leaving changes only the buffers' contents and, across a capture size, the key:
nothing is captured twice. Under HiSparse the graph holds the routing, the plans, the miss copies (a branch
on HiSparse's side stream, forked from and joined back into the captured stream) and the new rows' backup to
the host pool; placement and page restores run before the replay (docs/hisparse.md, "Under CUDA graphs").

The captured forwards are the model's target pass and the MTP layer's catch-up and draft passes; sampling
and rejection run between them, on the device for a batch of greedy decode requests
(engine/runner/device_step.py), on the host for any other (per-request generators, grammars and penalties
are host-side state).
"""

from __future__ import annotations

import logging

import torch

from engine.runner.padded_batch import PaddedBatch, eager_forward

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prev_buf: torch.Tensor | None = None  # [max rows, hidden]: the MTP passes' input hidden rows
        self.num_captures = 0
        self.num_replays = 0
        self.failed: str | None = None  # why a capture failed: every forward runs eagerly from then on

    def run(self, kind: str, batch: PaddedBatch, prev: torch.Tensor | None) -> torch.Tensor:
        key = (kind, *batch.key)
        if prev is not None:
            prev = self.static_prev(prev)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.capture(kind, batch, prev)
        if entry is None:
            return eager_forward(self.runner, kind, batch.input_ids, batch.meta, prev)
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out

    def capture(self, kind: str, batch: PaddedBatch, prev: torch.Tensor | None):
        """Capture (kind, batch's key) once -> (graph, static output), or None after a failed capture.
        `prev`: the MTP passes' input hidden rows, already in the static buffer (`static_prev`)."""
        key = (kind, *batch.key)
        if key in self.graphs or self.failed is not None:
            return self.graphs.get(key)
        try:
            self.graphs[key] = self._capture(kind, batch, prev)
        except Exception as e:  # noqa: BLE001 - any capture error: serve eagerly, say why once
            self.failed = f"{key}: {type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed, decoding eagerly: %s", self.failed)
            torch.cuda.synchronize()
        return self.graphs.get(key)

    def static_prev(self, prev: torch.Tensor) -> torch.Tensor:
        rows = self.runner.static.builder.max_rows
        if self.prev_buf is None or self.prev_buf.dtype != prev.dtype or self.prev_buf.shape[1] != prev.shape[1]:
            self.prev_buf = torch.zeros((rows, prev.shape[1]), dtype=prev.dtype, device=prev.device)
        buf = self.prev_buf[: prev.shape[0]]
        buf.copy_(prev)
        return buf

    def _capture(self, kind: str, batch: PaddedBatch, prev: torch.Tensor | None):
        def fn():
            return eager_forward(self.runner, kind, batch.input_ids, batch.meta, prev)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up (rewrites this step's KV rows with the same values the replay writes)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the services' I/O) do not invalidate the capture
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        self.num_captures += 1
        return graph, out
