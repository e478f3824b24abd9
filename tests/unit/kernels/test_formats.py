"""fp8_ds_mla and indexer-key byte layouts: bit-level properties of quantize/dequantize."""

from __future__ import annotations

import pytest
import torch

from kernels.formats import (
    dequantize_index_rows_ref,
    dequantize_mla_rows_ref,
    index_key_parts,
    index_rows_to_blocks,
    mla_row_bytes,
    quantize_index_rows_ref,
    quantize_mla_rows_ref,
    read_index_rows,
    write_index_rows,
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


def test_index_block_is_values_then_scales():
    """Block b of a key cache: its B keys' D-byte values token after token, then their B fp32 scales; the same
    bytes read back as logical rows, through a layer view of a cache with several index layers too."""
    D, B, nb, L = 32, 8, 3, 2
    rows = quantize_index_rows_ref(_rand(nb * B, D, 11)).view(nb, B, D + 4)
    blocks = index_rows_to_blocks(rows)
    assert blocks.shape == rows.shape and blocks.is_contiguous()
    for b in range(nb):
        flat = blocks[b].reshape(-1)
        assert torch.equal(flat[: B * D], rows[b, :, :D].reshape(-1))
        assert torch.equal(flat[B * D:], rows[b, :, D:].reshape(-1))
        for t in range(B):  # explicit offsets: values at t·D, scale at B·D + 4·t
            assert torch.equal(flat[t * D: t * D + D], rows[b, t, :D])
            assert torch.equal(flat[B * D + 4 * t: B * D + 4 * t + 4], rows[b, t, D:])

    cache = torch.full((nb, L, B, D + 4), 0xAB, dtype=torch.uint8)  # [blocks, layers, B, row], like PagedKVCache
    layer = cache[:, 1]
    blk, tok = torch.tensor([2, 0, 1, 2]), torch.tensor([7, 0, 3, 1])
    want = rows[blk, tok]
    write_index_rows(layer, blk, tok, want)
    assert torch.equal(read_index_rows(layer, blk, tok), want)
    assert torch.equal(read_index_rows(cache, blk, tok)[:, 1], want)  # the whole cache: [n, layers, row]
    assert bool((cache[:, 0] == 0xAB).all()), "a write to layer 1 touched layer 0"
    values, scales = index_key_parts(layer)
    assert torch.equal(values[2, 7], want[0, :D]) and torch.equal(scales[2, 7], want[0, D:])
    assert torch.equal(layer[2].reshape(-1)[7 * D: 8 * D], want[0, :D])
    untouched = torch.ones(nb, B, dtype=torch.bool)
    untouched[blk, tok] = False
    assert bool((values[untouched] == 0xAB).all()) and bool((scales[untouched] == 0xAB).all())


def test_index_key_parts_rejects_other_layouts():
    with pytest.raises(ValueError, match="contiguous blocks"):
        index_key_parts(torch.zeros(2, 4, 36, dtype=torch.uint8)[:, :, :20])
    with pytest.raises(ValueError, match="uint8 key cache"):
        index_key_parts(torch.zeros(2, 4, 36, dtype=torch.float32))
    fp32 = torch.randn(2, 4, 8)  # the exact mode: plain rows
    blk, tok = torch.tensor([1, 0]), torch.tensor([3, 2])
    assert torch.equal(read_index_rows(fp32, blk, tok), fp32[blk, tok])
