"""merge_attn_states against merge_attn_states_ref: the exact DCP merge, -inf shards contribute nothing."""

from __future__ import annotations

import pytest
import torch

from kernels.merge import merge_attn_states, merge_attn_states_ref
from tests.helpers.kernel_inputs import gpu, interp, randn


def check_merge(N: int, lead: tuple, D: int, dtype, device):
    gen = torch.Generator().manual_seed(N * 100 + D)
    outs = randn(gen, N, *lead, D, dtype=dtype, device=device)
    lses = randn(gen, N, *lead, device=device, scale=4.0)
    flat = lses.view(N, -1)
    flat[0, ::3] = float("-inf")  # one empty shard for a third of the rows
    flat[:, 1] = float("-inf")  # a row empty on every shard
    out, lse = merge_attn_states(outs, lses)
    ref_out, ref_lse = merge_attn_states_ref(outs, lses)
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.all(out.view(-1, D)[1] == 0) and lse.view(-1)[1] == float("-inf")
    into, into_lse = torch.empty_like(out), torch.empty_like(lse)  # results written in place: the same
    got = merge_attn_states(outs, lses, out=into, lse=into_lse)
    assert got[0].data_ptr() == into.data_ptr() and torch.equal(into, out) and torch.equal(into_lse, lse)
    # an empty shard is never read: garbage (even NaN) there changes nothing
    outs.view(N, -1, D)[0, ::3] = float("nan")
    out2, lse2 = merge_attn_states(outs, lses)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@interp
@pytest.mark.parametrize("N,lead,D,dtype", [(2, (5,), 48, torch.float32), (3, (4, 3), 64, torch.bfloat16),
                                            (8, (7,), 512, torch.float32), (1, (6,), 16, torch.float32)])
def test_merge_interp(N, lead, D, dtype):
    check_merge(N, lead, D, dtype, "cpu")


@interp
def test_merge_shape_mismatch_raises_interp():
    with pytest.raises(ValueError, match="must be"):
        merge_attn_states(torch.zeros(2, 3, 4), torch.zeros(2, 4))


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_merge_gpu(mark):
    check_merge(8, (128, 64), 512, torch.bfloat16, "cuda")  # DCP8, decode batch 128, 64 heads
