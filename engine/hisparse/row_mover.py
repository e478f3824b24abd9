"""Moving rows between the host pool, the device pool and workspaces.

CPU: plain indexing (`kernels.hisparse_gather.copy_rows_ref`). CUDA: the Triton copy kernel, which reads or
writes pinned host memory in place (unified addressing), so slot lists computed on the GPU need no host
round trip; a group's miss copies run on a side stream (the leader layer's alone, then the others' in one
launch), each part with an event that its layers' attention waits for. If this Triton cannot address pinned
host memory, copies fall back to a synchronous gather (`path` says which one ran; the benchmark reports it).

Under CUDA-graph capture the same fork and join are captured: the side stream first waits for an event
recorded on the capturing stream (which pulls it into the capture), and every part's event is waited for by
its layers, so the graph holds the copies as a branch that ends before their attention. The previous
forward's copies need no wait there (graph replays are ordered on their stream), and the events are fresh
ones, so no event recorded inside a capture is ever waited for outside it.
"""

from __future__ import annotations

import logging

import torch

from kernels.hisparse_gather import LayerCopy, copy_rows, copy_rows_ref

log = logging.getLogger(__name__)


class RowMover:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device) if self.cuda else None
        self.path = "triton" if self.cuda else "torch"
        self._parts: dict = {}  # (key, split) -> the parts a layer group is copied in (RowMover.parts)
        self._events: dict = {}  # key -> CUDA events of a group's side-stream copies: ready, then one per part
        self._held: dict = {}  # key -> the slot lists of its last side-stream copy (alive until the next one)

    def copy(self, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """dst[dst_slots] = src[src_slots] over paged views, skipping -1 on either side."""
        if not self.cuda:
            copy_rows_ref(src, src_slots, dst, dst_slots)
            return
        if self.path == "triton":
            try:
                copy_rows(src, src_slots, dst, dst_slots)
                return
            except (ValueError, RuntimeError) as e:  # e.g. "Pointer argument cannot be accessed from Triton"
                if src.is_cuda and dst.is_cuda:
                    raise
                log.warning("hisparse: Triton cannot reach pinned host memory (%s); copies now synchronise", e)
                self.path = "sync"
        copy_rows_ref(src, src_slots, dst, dst_slots)

    def copy2(self, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
              dst2: torch.Tensor, dst2_slots: torch.Tensor) -> None:
        """`copy` into two destinations: one kernel on CUDA (rows read once)."""
        if self.cuda and self.path == "triton":
            try:
                copy_rows(src, src_slots, dst, dst_slots, dst2, dst2_slots)
                return
            except (ValueError, RuntimeError) as e:
                if src.is_cuda and dst.is_cuda and dst2.is_cuda:
                    raise
                log.warning("hisparse: Triton cannot reach pinned host memory (%s); copies now synchronise", e)
                self.path = "sync"
        self.copy(src, src_slots, dst, dst_slots)
        self.copy(src, src_slots, dst2, dst2_slots)

    def parts(self, key, pairs, split: bool = False) -> list:
        """The parts a layer group under `key` is copied in, [(its (src view, dst view) pairs, prepared LayerCopy
        or None)]: one part, or with `split` the first layer alone and the others together. Built from `pairs()`
        on first use and kept: the caches never move."""
        got = self._parts.get((key, split))
        if got is None:
            ps = pairs()
            cut = [ps[:1], ps[1:]] if split and len(ps) > 1 else [ps]
            got = self._parts[key, split] = [(c, LayerCopy([s for s, _ in c], [d for _, d in c]) if self.cuda else None)
                                             for c in cut]
        return got

    def _copy_part(self, part, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        ps, fused = part
        if fused is not None and self.path == "triton":
            try:
                fused(src_slots, dst_slots)
                return
            except (ValueError, RuntimeError) as e:  # e.g. "Pointer argument cannot be accessed from Triton"
                if all(s.is_cuda and d.is_cuda for s, d in ps):
                    raise
                log.warning("hisparse: Triton cannot reach pinned host memory (%s); copies now synchronise", e)
                self.path = "sync"
        for s, d in ps:
            self.copy(s, src_slots, d, dst_slots)

    def copy_group(self, key, pairs, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """The same rows for several layers (`parts(key, pairs)`), in stream order (one launch on CUDA)."""
        for part in self.parts(key, pairs):
            self._copy_part(part, src_slots, dst_slots)

    def copy_layers(self, key, pairs, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                    layers: list[int] | tuple[int, ...]) -> dict:
        """The same rows for several layers (`parts(key, pairs)`, in the order of `layers`) on the side stream
        -> {layer: (stream, event)} to `wait` for (CUDA; in stream order elsewhere). The first layer is copied
        alone, so its attention waits for its own rows only; the others' copies (one launch: more rows in
        flight) run while it computes. The slot lists are kept until this key's next copy, after which the main
        stream waits for this one, so their memory is reused only once it is done (no record_stream)."""
        parts = self.parts(key, pairs, split=True)
        if not self.cuda:
            for part in parts:
                self._copy_part(part, src_slots, dst_slots)
            return {}
        main = torch.cuda.current_stream()
        if torch.cuda.is_current_stream_capturing():
            events = [torch.cuda.Event() for _ in range(len(parts) + 1)]
        else:
            events = self._events.get(key)
            if events is None:  # kept per group: a wait binds to the record before it, so re-recording is safe
                events = self._events[key] = [torch.cuda.Event() for _ in range(len(parts) + 1)]
            main.wait_event(events[-1])  # the last copy of this key is done (already, unless a forward broke off)...
        # ... before its slot lists can be freed (in a capture: not before it ends, so that no later allocation
        # of the capture reuses their memory while the branch may still read it)
        self._held[key] = (src_slots, dst_slots)
        events[0].record(main)
        out, at = {}, 0
        torch.cuda.set_stream(self.side)  # the launches below go to the side stream
        try:
            self.side.wait_event(events[0])
            for part, done in zip(parts, events[1:]):
                self._copy_part(part, src_slots, dst_slots)
                done.record(self.side)
                waiter = (main, done)  # one object per part: the backend waits once for its layers
                for layer in layers[at: at + len(part[0])]:
                    out[layer] = waiter
                at += len(part[0])
        finally:
            torch.cuda.set_stream(main)
        return out

    def wait(self, waiter) -> None:
        """Make the stream that asked for a copy (`copy_layers`) wait for it."""
        if waiter is not None:
            waiter[0].wait_event(waiter[1])
