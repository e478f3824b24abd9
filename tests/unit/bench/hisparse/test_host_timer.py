"""bench.hisparse.host_timer: wrapped functions are timed and counted only while the timer is on; restore() puts the
originals back."""

from __future__ import annotations

import bench.hisparse.stack as stack
from bench.hisparse.host_timer import HostTimer


def test_times_only_while_on_and_restores():
    original_next, original_decode_meta = stack.TopkStream.next, stack.decode_meta
    timer = HostTimer()
    timer.wrap("bench.hisparse.stack:TopkStream.next")
    timer.wrap("bench.hisparse.stack:decode_meta")
    assert stack.TopkStream.next is not original_next
    import torch

    s = stack.TopkStream(2, 4, 0.5, torch.device("cpu"), seed=0)
    lens = torch.tensor([100, 100], dtype=torch.int32)
    s.next(lens)  # off: not counted
    timer.on = True
    for _ in range(3):
        s.next(lens)
    timer.on = False
    rows = timer.per_step(3)
    assert rows["TopkStream.next"]["calls"] == 1.0 and rows["TopkStream.next"]["us"] > 0
    assert "decode_meta" not in rows, "functions never called while on are left out"
    timer.restore()
    assert stack.TopkStream.next is original_next and stack.decode_meta is original_decode_meta
