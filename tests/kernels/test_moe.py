"""fused_moe (Triton grouped GEMM) against fused_moe_ref; the expert alignment; no host syncs on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import fused_moe, fused_moe_ref, moe_impl_for
from kernels.moe_routing import align_by_expert, route_ref
from tests.helpers.kernel_inputs import gpu, interp, randn


def make_moe(T: int, H: int, inner: int, E: int, k: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, T, H, dtype=dtype, device=device)
    w13 = randn(gen, E, 2 * inner, H, dtype=dtype, device=device, scale=H ** -0.5)
    w2 = randn(gen, E, H, inner, dtype=dtype, device=device, scale=inner ** -0.5)
    logits = randn(gen, T, E, device=device)
    bias = randn(gen, E, device=device, scale=0.1)
    weights, ids = route_ref(logits, bias, k, scaling=2.5)
    return x, w13, w2, weights, ids


def check_moe(T, H, inner, E, k, dtype, device, offset: int = 0, num_local: int | None = None, tol=1e-5):
    x, w13, w2, weights, ids = make_moe(T, H, inner, E, k, dtype, device)
    lo, n = offset, num_local or E
    got = fused_moe(x, w13[lo: lo + n], w2[lo: lo + n], weights, ids, offset)
    want = fused_moe_ref(x.float(), w13[lo: lo + n].float(), w2[lo: lo + n].float(), weights, ids, offset)
    assert got.dtype == dtype and got.shape == (T, H)
    scale = want.abs().max().clamp(min=1e-6)
    err = ((got.float() - want).abs().max() / scale).item()
    assert err <= tol, f"fused_moe differs by {err:.3g} of the output scale"


@interp
@pytest.mark.parametrize("T,offset,num_local", [(13, 0, None), (29, 2, 4), (1, 0, None)])
def test_fused_moe_interp(T, offset, num_local):
    check_moe(T, H=64, inner=32, E=8, k=2, dtype=torch.float32, device="cpu", offset=offset, num_local=num_local)


@interp
def test_fused_moe_no_local_expert_interp():
    x, w13, w2, weights, ids = make_moe(5, 32, 16, 8, 2, torch.float32, "cpu")
    assert torch.all(fused_moe(x, w13[:2], w2[:2], weights, ids, expert_offset=100) == 0)


@interp
def test_align_by_expert_interp():
    ids = torch.tensor([[3, 1], [1, 5], [3, 3], [0, 7]])  # global ids; local experts 1..4 (offset 1, 4 local)
    rows, block_expert = align_by_expert(ids, num_experts=4, expert_offset=1, block_m=4)
    flat = ids.reshape(-1) - 1
    for blk, e in enumerate(block_expert.tolist()):
        members = rows[blk * 4: blk * 4 + 4]
        members = members[members >= 0]
        if e >= 4:
            assert members.numel() == 0, "blocks past the last expert hold nothing"
        assert torch.all(flat[members.long()] == e), "a block mixes experts"
    local = ((flat >= 0) & (flat < 4)).nonzero().flatten()
    assert sorted(rows[rows >= 0].tolist()) == local.tolist(), "every local assignment exactly once"


def test_moe_impl_for_picks_by_device():
    assert moe_impl_for("cpu") is fused_moe_ref and moe_impl_for("cuda") is fused_moe


@pytest.mark.parametrize("T", [7, 300])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_fused_moe_gpu(T, mark):
    check_moe(T, H=1024, inner=256, E=32, k=8, dtype=torch.bfloat16, device="cuda", tol=2e-2)
    check_moe(T, H=256, inner=128, E=16, k=4, dtype=torch.float32, device="cuda", offset=4, num_local=8)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_routing_and_moe_do_not_sync_gpu(mark):
    x, w13, w2, _, _ = make_moe(64, 512, 128, 16, 4, torch.bfloat16, "cuda")
    logits = torch.randn(64, 16, device="cuda")
    bias = torch.randn(16, device="cuda")
    fused_moe(x, w13, w2, *route_ref(logits, bias, 4))  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, ids = route_ref(logits, bias, 4, n_group=4, topk_group=2)
        fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
