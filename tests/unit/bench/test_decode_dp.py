"""bench/decode_dp.py's per-step communication figures: what one rank of a planned DP8×EP8 step sends with the
static dispatch, what the dynamic dispatcher would, and the modelled wire time."""

from __future__ import annotations

import pytest

from bench.decode_dp import WORLD, step_comm
from engine.parallel.ep import static_dispatch_bytes


def test_step_comm_counts_every_planned_pass():
    H, k, layers = 6144, 8, (75, 1)
    c = step_comm(5, [1, 8, 16], 3, H, k, layers, alpha_us=10.0, nvlink_gbs=400.0)
    assert c["bucket"] == 8
    # passes: target and catch-up at 8 x 4 rows, two drafts at 8 rows; dispatch + combine per MoE layer
    assert c["collectives"] == 2 * (75 + 1 + 1 + 1)
    rows = [(32, 75), (32, 1), (8, 1), (8, 1)]
    want = sum(sum(static_dispatch_bytes(r, H, k, WORLD).values()) * n for r, n in rows)
    assert c["static_bytes_sent"] == want
    assert c["wire_ms"] == pytest.approx(1e3 * (c["collectives"] * 10e-6 + want / 400e9))
    # the dynamic dispatcher moves one copy per (real token, remote rank): fewer bytes at any batch
    assert 0 < c["dynamic_bytes_sent"] < c["static_bytes_sent"]
    full = step_comm(8, [1, 8, 16], 3, H, k, layers, 10.0, 400.0)  # no padding: the static layout's own overhead
    assert full["static_bytes_sent"] / full["dynamic_bytes_sent"] == pytest.approx(1.5, abs=0.05)


def test_fp8_rows_halve_the_dispatch_but_not_the_combine():
    bf16 = static_dispatch_bytes(32, 6144, 8, WORLD)
    fp8 = static_dispatch_bytes(32, 6144, 8, WORLD, fp8=True)
    assert fp8["dispatch"] == 7 * 32 * (6144 + 4 * 48 + 64) and fp8["combine"] == bf16["combine"]
    assert step_comm(8, [8], 3, 6144, 8, (75, 1), 10.0, 400.0, fp8=True)["wire_ms"] < \
        step_comm(8, [8], 3, 6144, 8, (75, 1), 10.0, 400.0)["wire_ms"]
