"""route, align_by_expert_small, align_by_expert_many and moe_combine against route_ref, align_by_expert and
moe_combine_ref."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import (
    align_by_expert,
    align_by_expert_many,
    align_by_expert_small,
    moe_combine,
    moe_combine_ref,
    route,
    route_ref,
)
from tests.helpers.kernel_inputs import gpu, interp, randn


def check_route(T: int, E: int, k: int, device, bias: bool = True, normalize: bool = True):
    gen = torch.Generator().manual_seed(T * E + k)
    logits = randn(gen, T, E, device=device, scale=3.0)
    b = randn(gen, E, device=device, scale=0.5) if bias else None
    w, ids = route(logits, b, k, normalize=normalize, scaling=2.5)
    w_ref, ids_ref = route_ref(logits, b, k, normalize=normalize, scaling=2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    assert torch.equal(ids, ids_ref), "the same experts in the same (descending) order"
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@interp
@pytest.mark.parametrize("T,E,k,bias,normalize", [(5, 16, 4, True, True), (3, 24, 3, False, True),
                                                  (2, 8, 8, True, False), (0, 16, 2, True, True)])
def test_route_interp(T, E, k, bias, normalize):
    check_route(T, E, k, "cpu", bias, normalize)


@interp
def test_route_checks_its_arguments_interp():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 8), None, 9)
    with pytest.raises(ValueError, match="bias"):
        route(torch.zeros(2, 8), torch.zeros(4), 2)


def check_align(T: int, k: int, E_total: int, E: int, offset: int, block_m: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E_total, (T, k), generator=gen).to(device)
    rows, block_expert = align_by_expert_small(ids, E, offset, block_m)
    want_rows, want_blocks = align_by_expert(ids, E, offset, block_m)
    assert rows.dtype == want_rows.dtype and block_expert.dtype == want_blocks.dtype
    assert torch.equal(rows, want_rows) and torch.equal(block_expert, want_blocks)


@interp
@pytest.mark.parametrize("T,k,E_total,E,offset,block_m", [(13, 2, 8, 8, 0, 4), (29, 4, 16, 4, 4, 8),
                                                          (1, 8, 32, 32, 0, 16), (7, 3, 12, 3, 9, 2)])
def test_align_small_equals_align_interp(T, k, E_total, E, offset, block_m):
    check_align(T, k, E_total, E, offset, block_m, "cpu", seed=T)


@interp
def test_align_small_with_no_local_assignment_interp():
    ids = torch.tensor([[0, 1], [1, 0]])
    rows, blocks = align_by_expert_small(ids, 4, 10, 4)
    want_rows, want_blocks = align_by_expert(ids, 4, 10, 4)
    assert torch.equal(rows, want_rows) and torch.all(rows == -1) and torch.equal(blocks, want_blocks)
    with pytest.raises(ValueError, match="align_by_expert"):
        align_by_expert_small(torch.zeros(8193, 1, dtype=torch.long), 4, 0, 4)


def check_align_many(T: int, k: int, E_total: int, E: int, offset: int, block_m: int, device, seed: int = 0):
    """The counting sort: the same block table, each expert's rows the same set (arrival order within it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E_total, (T, k), generator=gen).to(device)
    rows, block_expert = align_by_expert_many(ids, E, offset, block_m)
    want_rows, want_blocks = align_by_expert(ids, E, offset, block_m)
    assert rows.dtype == want_rows.dtype and torch.equal(block_expert, want_blocks)
    assert rows.shape == want_rows.shape
    for b in range(0, rows.shape[0], block_m):  # block by block: within an expert's rows the order may differ
        e = int(want_blocks[b // block_m])
        if e >= E:
            assert (rows[b:] == -1).all() and (want_rows[b:] == -1).all()
            break
        ends = (want_blocks == e).nonzero().flatten()
        lo, hi = int(ends[0]) * block_m, (int(ends[-1]) + 1) * block_m
        assert sorted(rows[lo:hi].tolist()) == sorted(want_rows[lo:hi].tolist())


@interp
@pytest.mark.parametrize("T,k,E_total,E,offset,block_m", [(13, 2, 8, 8, 0, 4), (29, 4, 16, 4, 4, 8),
                                                          (300, 8, 32, 4, 8, 16), (0, 8, 32, 4, 0, 16)])
def test_align_many_equals_align_interp(T, k, E_total, E, offset, block_m):
    check_align_many(T, k, E_total, E, offset, block_m, "cpu", seed=T)


def check_combine(T: int, k: int, H: int, E: int, offset: int, dtype, device):
    gen = torch.Generator().manual_seed(T + H)
    ids = torch.randint(0, 3 * E, (T, k), generator=gen).to(device)
    y = randn(gen, T * k, H, device=device)
    local = ((ids - offset >= 0) & (ids - offset < E)).reshape(-1)
    y[~local] = float("nan")  # rows of other ranks' experts are never written, never read
    got = moe_combine(y, ids, E, offset, dtype)
    want = moe_combine_ref(y, ids, E, offset, dtype)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@interp
@pytest.mark.parametrize("T,k,H,E,offset,dtype", [(5, 3, 40, 4, 2, torch.float32), (3, 8, 64, 8, 0, torch.bfloat16)])
def test_combine_interp(T, k, H, E, offset, dtype):
    check_combine(T, k, H, E, offset, dtype, "cpu")


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_moe_routing_gpu(mark):
    for T in (1, 4, 256, 1024):
        check_route(T, 256, 8, "cuda")
        check_align(T, 8, 256, 32, 64, 32, "cuda", seed=T)  # one EP8 rank's 32 experts
        check_align(T, 8, 256, 256, 0, 16, "cuda", seed=T)
        check_align_many(T, 8, 256, 32, 64, 32, "cuda", seed=T)
    for T in (2048, 8192):  # the static EP dispatch's sizes: D x T rows, one in eight assignments local
        check_align_many(T, 8, 256, 32, 64, 64, "cuda", seed=T)
        check_combine(T, 8, 6144, 32, 64, torch.bfloat16, "cuda")
