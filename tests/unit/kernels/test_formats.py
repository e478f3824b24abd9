"""fp8_ds_mla and indexer-key byte layouts: bit-level properties of quantize/dequantize."""

from __future__ import annotations

import torch

from kernels.formats import (
    dequantize_index_rows_ref,
    dequantize_mla_rows_ref,
    mla_row_bytes,
    quantize_index_rows_ref,
    quantize_mla_rows_ref,
)


def _rand(T, D, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 2, T)[:, None]  # rows of very different magnitude
    return torch.randn(T, D, generator=g) * scales


def test_row_is_656_bytes_for_glm():
    assert mla_row_bytes(512, 64) == 656
    rows = quantize_mla_rows_ref(_rand(5, 512, 0), _rand(5, 64, 1))
    assert rows.shape == (5, 656) and rows.dtype == torch.uint8


def test_scales_are_powers_of_two_and_bound_amax():
    lat = _rand(33, 512, 2)
    rows = quantize_mla_rows_ref(lat, _rand(33, 64, 3))
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    m, e = torch.frexp(scales)
    assert torch.all(m == 0.5), "every scale must be an exact power of two"
    amax = lat.reshape(33, 4, 128).abs().amax(-1)
    assert torch.all(amax / scales <= 448.0)
    assert torch.all(scales >= 1e-4 / 2)  # floor 1e-4 rounded up to a power of two


def test_rope_bytes_are_exact_bf16():
    rope = _rand(9, 64, 4)
    rows = quantize_mla_rows_ref(_rand(9, 512, 5), rope)
    assert torch.equal(rows[:, 528:656].contiguous().view(torch.bfloat16), rope.to(torch.bfloat16))


def test_latent_relative_error_per_tile():
    lat = _rand(40, 512, 6)
    back = dequantize_mla_rows_ref(quantize_mla_rows_ref(lat, _rand(40, 64, 7)), 512, 64)[:, :512]
    tiles, back_t = lat.reshape(40, 4, 128), back.reshape(40, 4, 128)
    err = (tiles - back_t).abs().amax(-1)
    amax = tiles.abs().amax(-1)
    # e4m3 keeps 3 mantissa bits: error <= half an ulp at the top binade, 2^-4 of the scaled amax,
    # and the power-of-two scale costs at most another factor 2
    assert torch.all(err <= amax * 2 ** -3 + 1e-6)


def test_small_latent_is_one_tile():
    assert mla_row_bytes(64, 16) == 64 + 4 + 32
    lat = _rand(3, 64, 8)
    back = dequantize_mla_rows_ref(quantize_mla_rows_ref(lat, _rand(3, 16, 9)), 64, 16)
    assert back.shape == (3, 80)
    assert torch.allclose(back[:, :64], lat, rtol=0.07, atol=1e-4)


def test_index_rows_roundtrip():
    k = _rand(17, 128, 10)
    rows = quantize_index_rows_ref(k)
    assert rows.shape == (17, 132)
    scale = rows[:, 128:].contiguous().view(torch.float32)[:, 0]
    assert torch.all(torch.frexp(scale).mantissa == 0.5)
    back = dequantize_index_rows_ref(rows, 128)
    assert torch.all((back - k).abs().amax(-1) <= k.abs().amax(-1) * 2 ** -3 + 1e-6)
