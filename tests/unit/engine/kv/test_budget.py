"""The GPU KV budget: this engine's share of its GPU less what this process holds (as in vLLM),
never less what other processes hold; an over-committed GPU is refused with a clear message."""

from __future__ import annotations

import pytest

from engine.kv.budget import gpu_kv_budget

GIB = 1 << 30
TOTAL = 140 * GIB


def test_budget_is_share_minus_own_memory_not_others():
    # alone on the GPU: 0.3 x 140 GiB less our 10 GiB of weights
    assert gpu_kv_budget(0.3, TOTAL, TOTAL - 10 * GIB, 10 * GIB) == int(0.3 * TOTAL) - 10 * GIB
    # a second engine already holds 0.3 of the GPU: our budget does not shrink by its memory
    free = TOTAL - int(0.3 * TOTAL) - 10 * GIB
    assert gpu_kv_budget(0.3, TOTAL, free, 10 * GIB) == int(0.3 * TOTAL) - 10 * GIB


def test_shares_summing_to_one_fit_up_to_the_cuda_contexts():
    free = TOTAL - int(0.5 * TOTAL) - 1 * GIB - GIB // 2  # the other engine's half, both contexts, our 1 GiB
    got = gpu_kv_budget(0.5, TOTAL, free, 1 * GIB)
    assert 0 < got < int(0.5 * TOTAL) - 1 * GIB and got == free - (256 << 20)


def test_over_committed_gpu_is_refused():
    free = TOTAL - int(0.7 * TOTAL)  # another process took 0.7 of the GPU
    with pytest.raises(RuntimeError, match="only .* GiB of the GPU is free.*add up to at most 1"):
        gpu_kv_budget(0.5, TOTAL, free, 2 * GIB, "cuda:0")
