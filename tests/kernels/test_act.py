"""silu_mul (the gated MLP's activation in one launch) against the eager `F.silu(gate) * up`, and its FP8
quantization against quant_act of its output."""

from __future__ import annotations

import pytest
import torch

from kernels.act import silu_mul, silu_mul_ref
from kernels.fp8_quant import quant_act
from tests.helpers.kernel_inputs import gpu, interp, randn


def check_silu_mul(T: int, inter: int, dtype, device):
    gen = torch.Generator().manual_seed(T + inter)
    gu = randn(gen, T, 2 * inter, dtype=dtype, device=device, scale=4.0)  # the packed projection's output
    gate, up = gu[:, :inter], gu[:, inter:]
    want = silu_mul_ref(gate, up)
    h = silu_mul(gate, up)
    assert h.dtype == want.dtype and h.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(h, want, rtol=1e-6, atol=1e-6)
    else:  # an fp32 exp that rounds otherwise moves a bf16 rounding, rarely
        assert (h != want).sum() <= 0.01 * h.numel()
        torch.testing.assert_close(h.float(), want.float(), rtol=1e-2, atol=1e-2)
    h2, (q, s) = silu_mul(gate, up, quant=True)
    assert torch.equal(h2, h)
    want_q, want_s = quant_act(h)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


@interp
@pytest.mark.parametrize("T,inter,dtype", [(3, 256, torch.float32), (5, 640, torch.bfloat16), (2, 100, torch.bfloat16),
                                           (0, 256, torch.bfloat16)])
def test_silu_mul_interp(T, inter, dtype):
    check_silu_mul(T, inter, dtype, "cpu")


@interp
def test_silu_mul_refuses_mismatched_halves_interp():
    with pytest.raises(ValueError, match="gate"):
        silu_mul(torch.zeros(2, 8), torch.zeros(2, 9))
    with pytest.raises(ValueError, match="gate"):
        silu_mul(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_silu_mul_gpu(mark):
    for T in (1, 64, 256, 4099):
        check_silu_mul(T, 2048, torch.bfloat16, "cuda")  # the shared expert
        check_silu_mul(T, 12288, torch.bfloat16, "cuda")  # a dense layer
