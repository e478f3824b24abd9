"""rms_norm (with and without the residual add, and with its output's FP8 quantization) and rope / rope_cat against
their eager references."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import rope_cos_sin, rope_inv_freq
from kernels.fp8_quant import quant_act
from kernels.norm import rms_norm, rms_norm_quant, rms_norm_ref
from kernels.rope import rope, rope_cat, rope_cat_ref, rope_fits, rope_ref
from tests.helpers.kernel_inputs import gpu, interp, randn


def norm_inputs(T: int, D: int, dtype, device, strided: bool, seed: int):
    """(x, weight, residual); x a row-strided view with `strided`, as kv_a's latent part."""
    gen = torch.Generator().manual_seed(seed)
    base = randn(gen, T, D + 64 if strided else D, dtype=dtype, device=device, scale=3.0)
    x = base[:, :D] if strided else base
    return x, randn(gen, D, dtype=dtype, device=device), randn(gen, T, D, dtype=dtype, device=device)


def check_norm(T: int, D: int, dtype, device, strided: bool = False):
    x, w, res = norm_inputs(T, D, dtype, device, strided, seed=T * 7 + D)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    y = rms_norm(x, w, 1e-6)
    want = rms_norm_ref(x, w, 1e-6)
    assert y.dtype == want.dtype and y.shape == want.shape
    torch.testing.assert_close(y.float(), want.float(), **tol)
    y2, s = rms_norm(x, w, 1e-6, residual=res)
    want2, want_s = rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(s, want_s), "the residual sum is the eager x + residual, bit for bit"
    torch.testing.assert_close(y2.float(), want2.float(), **tol)
    if dtype == torch.bfloat16:  # bf16 outputs may differ by one rounding of the sum of squares, no more
        assert (y.float() != want.float()).float().mean() < 0.01


@interp
@pytest.mark.parametrize("T,D,dtype,strided", [(5, 48, torch.float32, False), (3, 512, torch.bfloat16, True),
                                               (1, 96, torch.bfloat16, False), (0, 32, torch.float32, False)])
def test_rms_norm_interp(T, D, dtype, strided):
    check_norm(T, D, dtype, "cpu", strided)


@interp
def test_rms_norm_promotes_like_the_module_interp():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(16)  # fp32 weight times a bf16 row: fp32, as the eager module gives
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=torch.zeros(3, 16))


def check_norm_quant(T: int, D: int, dtype, device, strided: bool = False):
    """rms_norm_quant: the norm of rms_norm, bit for bit, and the codes and scales quant_act gives for it."""
    x, w, res = norm_inputs(T, D, dtype, device, strided, seed=T * 3 + D)
    if T > 1:
        w[:128] = 0.0  # a zero group: codes 0 with the all-zero block's scale
    y, (q, s) = rms_norm_quant(x, w, 1e-6)
    assert torch.equal(y, rms_norm(x, w, 1e-6))
    want_q, want_s = quant_act(y.reshape(-1, D))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (T, -(-D // 128))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    y2, sum2, (q2, s2) = rms_norm_quant(x, w, 1e-6, residual=res)
    want_y2, want_sum2 = rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(y2, want_y2) and torch.equal(sum2, want_sum2)
    want_q2, want_s2 = quant_act(y2.reshape(-1, D))
    assert torch.equal(q2.view(torch.uint8), want_q2.view(torch.uint8)) and torch.equal(s2, want_s2)


@interp
@pytest.mark.parametrize("T,D,dtype,strided", [(4, 256, torch.bfloat16, False), (3, 300, torch.bfloat16, True),
                                               (2, 48, torch.float32, False), (0, 256, torch.bfloat16, False)])
def test_rms_norm_quant_interp(T, D, dtype, strided):
    check_norm_quant(T, D, dtype, "cpu", strided)


@interp
def test_rms_norm_quant_feeds_the_fp8_gemm_as_its_own_quantization_interp():
    """The codes and scales written with the norm, given to the GEMM (`x_quant`), give the bits of the GEMM
    quantizing the norm's output itself, on the split-K path (quantizing in the kernel or with quant_act) and
    the tiled one; a malformed x_quant is refused."""
    from kernels.fp8_gemm import w8a8_block_fp8_matmul
    from kernels.fp8_quant import quantize_weight_ref
    from kernels.fp8_splitk import SplitKConfig

    gen = torch.Generator().manual_seed(11)
    x, w = randn(gen, 6, 384, dtype=torch.bfloat16, device="cpu", scale=3.0), randn(gen, 384, dtype=torch.bfloat16,
                                                                                     device="cpu")
    wq, ws = quantize_weight_ref(torch.randn(200, 384, generator=gen))
    y, quant = rms_norm_quant(x, w, 1e-6)
    for config in (SplitKConfig(16, 64, 2), SplitKConfig(16, 64, 2, fuse_quant=False), (16, 64, 1, 4, 2)):
        assert torch.equal(w8a8_block_fp8_matmul(y, wq, ws, torch.float32, config=config, x_quant=quant),
                           w8a8_block_fp8_matmul(y, wq, ws, torch.float32, config=config)), config
    q, s = quant
    for bad in ((q.view(torch.uint8), s), (q, s[:, :2]), (q[:4], s[:4]), (q, s.t().contiguous().t())):
        with pytest.raises(ValueError, match="x_quant"):
            w8a8_block_fp8_matmul(y, wq, ws, config=SplitKConfig(16, 64, 2), x_quant=bad)


def angles(T: int, d: int, device, gen):
    pos = torch.randint(0, 100_000, (T,), generator=gen)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 10_000.0))
    return cos.to(device), sin.to(device)


def assert_rope_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), "every product and sum rounded as the eager ops round them"


def check_rope(T: int, H: int, D: int, r: int, interleave: bool, dtype, device):
    gen = torch.Generator().manual_seed(T + H + D)
    x = randn(gen, T, H, D, dtype=dtype, device=device)
    cos, sin = angles(T, r, device, gen)
    want = rope_ref(x[..., :r], cos, sin, interleave)
    got = rope(x[..., :r], cos, sin, interleave)
    exact = dtype != torch.float32
    if exact:
        assert_rope_equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    rest = x[..., r:].clone()
    rope(x, cos, sin, interleave, rope_dim=r, out=x)  # in place: the rest of each head untouched
    assert torch.equal(x[..., r:], rest)
    assert_rope_equal(x[..., :r], want) if exact else torch.testing.assert_close(x[..., :r], want, rtol=1e-6, atol=1e-6)


@interp
@pytest.mark.parametrize("T,H,D,r,interleave,dtype", [(3, 4, 24, 8, True, torch.bfloat16),
                                                      (2, 3, 32, 16, False, torch.bfloat16),
                                                      (4, 1, 16, 16, True, torch.float32)])
def test_rope_interp(T, H, D, r, interleave, dtype):
    check_rope(T, H, D, r, interleave, dtype, "cpu")


@interp
def test_rope_on_a_2d_strided_row_interp():
    gen = torch.Generator().manual_seed(3)
    kv = randn(gen, 5, 40, dtype=torch.bfloat16)
    cos, sin = angles(5, 8, "cpu", gen)
    assert_rope_equal(rope(kv[:, 32:], cos, sin, True), rope_ref(kv[:, 32:], cos, sin, True))
    with pytest.raises(ValueError, match="cos"):
        rope(kv[:, 32:], cos[:4], sin[:4], True)
    assert rope_fits(64) and rope_fits(2) and not rope_fits(48) and not rope_fits(7)
    with pytest.raises(ValueError, match="power of two"):
        rope(kv[:, 16:], *angles(5, 24, "cpu", gen), True)  # 24 wide: the eager ops take it


def check_rope_cat(T: int, H: int, A: int, P: int, dtype, device):
    gen = torch.Generator().manual_seed(T * H)
    a = randn(gen, H, T, A, dtype=dtype, device=device).transpose(0, 1)  # an einsum's permuted output
    q = randn(gen, T, H, 16 + P, dtype=dtype, device=device)
    cos, sin = angles(T, P, device, gen)
    got = rope_cat(a, q[..., 16:], cos, sin)
    want = rope_cat_ref(a, q[..., 16:], cos, sin)
    assert got.is_contiguous() and got.shape == (T, H, A + P)
    if dtype != torch.float32:
        assert_rope_equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@interp
@pytest.mark.parametrize("T,H,A,P,dtype", [(3, 4, 40, 8, torch.bfloat16), (2, 2, 16, 16, torch.float32)])
def test_rope_cat_interp(T, H, A, P, dtype):
    check_rope_cat(T, H, A, P, dtype, "cpu")


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_norm_rope_gpu(mark):
    for T in (1, 256, 4099):  # decode rows, a verify batch, prefill rows
        check_norm(T, 6144, torch.bfloat16, "cuda")
        check_norm(T, 512, torch.bfloat16, "cuda", strided=True)
        check_rope(T, 64, 192 + 64, 64, True, torch.bfloat16, "cuda")
        check_rope(T, 32, 128, 64, False, torch.bfloat16, "cuda")
        check_rope_cat(T, 64, 512, 64, torch.bfloat16, "cuda")
        check_norm_quant(T, 6144, torch.bfloat16, "cuda")
    check_norm(7, 6144, torch.float32, "cuda")
