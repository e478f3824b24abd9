"""MLA's absorbed matmuls with kv_b_proj's FP8 rows read in place (kernels.fp8_absorbed.absorbed_matmul) against
the bf16 copy and an fp32 einsum (`absorbed_matmul_ref`).

Both sides multiply the same bf16 values (the copy's) and add in fp32, so they differ only in the order of the
sums, then round to bf16: within one bf16 rounding (2^-8 relative) of the output's scale, in the interpreter and
on the GPU. Strided queries (the [T, H, nope] view of q the model passes), heads whose rows straddle 128-row scale
blocks and more rows than one row tile are covered; bad shapes are named."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_absorbed import absorbed_matmul, absorbed_matmul_ref
from kernels.fp8_quant import quantize_weight_ref
from tests.helpers.kernel_inputs import gpu, interp


def check_absorbed(T: int, H: int, nope: int, v: int, R: int, device: str, rope: int = 64) -> None:
    gen = torch.Generator().manual_seed(T * 7 + H)
    wq, ws = quantize_weight_ref(torch.randn(H * (nope + v), R, generator=gen) * 0.05)
    wq, ws = wq.to(device), ws.to(device)
    q = (torch.randn(T, H, nope + rope, generator=gen)).bfloat16().to(device)
    q_nope = q[..., :nope]  # strided, as the model's view of q
    lat = torch.randn(T, H, R, generator=gen).bfloat16().to(device)
    for which, x in (("uk", q_nope), ("uv", lat)):
        got = absorbed_matmul(x, wq, ws, H, nope, which)
        want = absorbed_matmul_ref(x, wq, ws, H, nope, which)
        assert got.shape == want.shape == (T, H, R if which == "uk" else v) and got.dtype == torch.bfloat16
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2 ** -7 * want.float().abs().max().item(), (which, T, err)


@interp
@pytest.mark.parametrize("T", [1, 5, 70])
def test_absorbed_matmul_interp(T):
    check_absorbed(T, H=3, nope=192, v=256, R=256, device="cpu")  # GLM-5.3's head rows (448: blocks straddled)
    check_absorbed(T, H=2, nope=64, v=128, R=128, device="cpu")
    check_absorbed(T, H=4, nope=32, v=32, R=64, device="cpu", rope=16)  # tiny-code's: a scale per element


def test_absorbed_matmul_names_bad_input():
    wq, ws = quantize_weight_ref(torch.randn(2 * 448, 256))
    x = torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="which must be"):
        absorbed_matmul(x, wq, ws, 2, 192, "qk")
    with pytest.raises(ValueError, match=r"x must be bf16 \[T, 2, 256\]"):
        absorbed_matmul(x, wq, ws, 2, 192, "uv")
    with pytest.raises(ValueError, match="does not split"):
        absorbed_matmul(x, wq, ws, 3, 192, "uk")
    with pytest.raises(ValueError, match="does not split"):
        absorbed_matmul(x, wq, ws, 2, 448, "uk")
    with pytest.raises(ValueError, match="scale must be fp32"):
        absorbed_matmul(x, wq, ws[:1], 2, 192, "uk")


@pytest.mark.parametrize("T", [pytest.param(T, marks=gpu) for T in (4, 16, 64, 256)])
def test_absorbed_matmul_gpu(T):
    check_absorbed(T, H=64, nope=192, v=256, R=512, device="cuda")  # GLM-5.3's kv_b_proj
