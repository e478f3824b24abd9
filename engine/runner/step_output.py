"""What `ModelRunner.execute_async` hands back, and what the next step's placeholder chunks read.

    StepHandle   get() -> the step's RunnerOutput. A step that read its tokens while it ran (the host path)
                 has it already; the device decode step (engine/runner/device_step.py) packs its tokens,
                 accepted counts and drafts into one int64 tensor that is copied to pinned host memory
                 (non_blocking) with a CUDA event recorded behind the copy, and get() waits for that event
                 only: with async scheduling, after the next step has been launched.
    LastStep     per request of the step: where its next chunk starts and its next row ids (the token it
                 sampled last, then its drafts); on the device for the device step, so the next step's
                 placeholders are filled in without a host read, and on the host through get().
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.core.scheduler_output import RunnerOutput, ScheduledChunk


class StepHandle:
    def __init__(self, out: RunnerOutput | None = None, packed: torch.Tensor | None = None,
                 finish: Callable[[list[list[int]]], RunnerOutput] | None = None):
        """Either the finished `out`, or `packed` [B, n] int64 (device) and `finish`(its rows as lists)."""
        self._out = out
        self._finish = finish
        self._rows: list[list[int]] | None = None
        self.event = None
        self.wait_seconds = 0.0  # how long wait() blocked on the device
        self.host = packed
        if packed is not None and packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event(blocking=True)  # a sleeping wait: the front end shares the CPU
            self.event.record()

    @property
    def ready(self) -> bool:
        """Whether get() would return without waiting for the device."""
        return self._out is not None or self.event is None or self.event.query()

    def wait(self) -> None:
        """Until the step has run on the device (everything it writes is written)."""
        if self.event is not None:
            t = time.perf_counter()
            self.event.synchronize()
            self.wait_seconds += time.perf_counter() - t

    def rows(self) -> list[list[int]]:
        if self._rows is None:
            self.wait()
            self._rows = self.host.tolist()
        return self._rows

    def get(self) -> RunnerOutput:
        if self._out is None:
            self._out = self._finish(self.rows())
        return self._out


class LastStep:
    """Where the requests that sampled in a step continue: row b of `next_start` [B] / `next_ids` [B, 1 + k]
    (device) is request `req_ids[b]`; `host(req_id)` gives the same (start, ids) on the host."""

    def __init__(self, req_ids: list[str], handle: StepHandle, host_fn: Callable[[int], tuple[int, list[int]]],
                 next_start: torch.Tensor | None = None, next_ids: torch.Tensor | None = None):
        self.row_of = {rid: b for b, rid in enumerate(req_ids)}
        self.handle = handle
        self._host_fn = host_fn
        self.next_start, self.next_ids = next_start, next_ids

    @property
    def on_device(self) -> bool:
        return self.next_start is not None

    def host(self, req_id: str) -> tuple[int, list[int]]:
        """(first position of the next chunk, its ids: the last sampled token then the drafts); may wait."""
        if req_id not in self.row_of:
            raise RuntimeError(f"request {req_id!r} has a placeholder chunk but did not sample in the last step: "
                               "only the step right after a request's sampling step may use placeholders")
        self.handle.get()  # the runner's per-request state follows its steps in order
        return self._host_fn(self.row_of[req_id])


def host_last_step(chunks: list[ScheduledChunk], out: RunnerOutput) -> LastStep:
    """The record of a step that sampled on the host (its chunks with exact starts)."""
    nxt: dict[str, tuple[int, list[int]]] = {}
    for c in chunks:
        s = out.sampled.get(c.req_id)
        if c.sample and s is not None and s.token_ids:
            n_known = len(c.token_ids) - c.num_draft_tokens
            nxt[c.req_id] = (c.start + n_known + s.num_accepted, [s.token_ids[-1]] + out.drafts.get(c.req_id, []))
    req_ids = list(nxt)
    return LastStep(req_ids, StepHandle(out), lambda b: nxt[req_ids[b]])
