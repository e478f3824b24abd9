"""store_kv / gather_kv / store_index_k / quantize_index_q against their references: bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.formats import mla_row_bytes, quantize_index_q_ref
from kernels.indexer import quantize_index_q, store_index_k, store_index_k_ref
from kernels.store_kv import gather_kv, gather_kv_ref, store_kv, store_kv_ref
from tests.helpers.kernel_inputs import gpu, interp, poisoned_cache, randn, same_bytes

CACHE_DTYPES = {"fp8_ds_mla": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _inputs(T: int, R: int, P: int, num_slots: int, in_dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = randn(gen, T, R + 7, dtype=in_dtype, device=device, scale=3.0)
    latent = wide[:, 3: 3 + R]  # non-contiguous rows
    latent[1] *= 1e-7  # a tile that hits the 1e-4 scale floor
    k_rope = randn(gen, T, P, dtype=in_dtype, device=device)
    slots = torch.randperm(num_slots, generator=gen)[:T].to(device)
    slots[torch.randperm(T, generator=gen)[: T // 5]] = -1  # padding rows are skipped
    return latent, k_rope, slots


def check_store_gather(kind: str, in_dtype, T: int, R: int, P: int, num_blocks: int, block_size: int, device):
    dtype = CACHE_DTYPES[kind]
    row = mla_row_bytes(R, P) if kind == "fp8_ds_mla" else R + P
    full, view = poisoned_cache(num_blocks, block_size, row, dtype, device)
    full_ref, view_ref = poisoned_cache(num_blocks, block_size, row, dtype, device)
    latent, k_rope, slots = _inputs(T, R, P, num_blocks * block_size, in_dtype, device, seed=T + R)
    store_kv(latent, k_rope, view, slots)
    store_kv_ref(latent, k_rope, view_ref, slots)
    assert same_bytes(full, full_ref), f"{kind}: cache bytes differ from store_kv_ref (other layers included)"
    written = slots[slots >= 0]
    for out_dtype in (torch.float32, torch.bfloat16):
        got = gather_kv(view, written, R, P, out_dtype=out_dtype)
        ref = gather_kv_ref(view_ref, written, R, P)
        assert got.dtype == out_dtype and same_bytes(got, ref.to(out_dtype)), f"{kind}: gather_kv differs"
    holes = gather_kv(view, torch.tensor([-1, int(written[0])], device=device), R, P)
    assert torch.all(holes[0] == 0) and torch.equal(holes[1], gather_kv_ref(view_ref, written[:1], R, P)[0])


def check_index_store(kind: str, T: int, D: int, num_blocks: int, block_size: int, device):
    dtype = torch.uint8 if kind == "fp8" else torch.float32
    row = D + 4 if kind == "fp8" else D
    full, view = poisoned_cache(num_blocks, block_size, row, dtype, device)
    full_ref, view_ref = poisoned_cache(num_blocks, block_size, row, dtype, device)
    k, _, slots = _inputs(T, D, 1, num_blocks * block_size, torch.float32, device, seed=T + D)
    store_index_k(k, view, slots)
    store_index_k_ref(k, view_ref, slots)
    assert same_bytes(full, full_ref), f"{kind}: index cache bytes differ from store_index_k_ref"


@interp
@pytest.mark.parametrize("kind", list(CACHE_DTYPES))
@pytest.mark.parametrize("R,P,in_dtype", [(128, 16, torch.bfloat16), (64, 32, torch.float32), (512, 64, torch.float32)])
def test_store_gather_interp(kind, R, P, in_dtype):
    check_store_gather(kind, in_dtype, T=37, R=R, P=P, num_blocks=7, block_size=16, device="cpu")


@interp
@pytest.mark.parametrize("kind", ["fp8", "fp32"])
def test_index_store_interp(kind):
    check_index_store(kind, T=29, D=32, num_blocks=5, block_size=16, device="cpu")


@interp
def test_quantize_index_q_interp():
    gen = torch.Generator().manual_seed(3)
    q = randn(gen, 5, 3, 64, scale=4.0)[:, :, :32]  # non-contiguous
    q8, scale = quantize_index_q(q)
    q8_ref, scale_ref = quantize_index_q_ref(q)
    assert same_bytes(q8.contiguous(), q8_ref) and torch.equal(scale, scale_ref)


@interp
def test_bad_inputs_raise_interp():
    _, view = poisoned_cache(2, 16, mla_row_bytes(128, 16), torch.uint8, "cpu")
    latent, k_rope = torch.randn(3, 128), torch.randn(3, 16)
    with pytest.raises(ValueError, match="same number of rows"):
        store_kv(latent, k_rope, view, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="bytes, expected"):
        store_kv(torch.randn(3, 256), torch.randn(3, 16), view, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        store_kv(torch.randn(3, 96), torch.randn(3, 16), view, torch.zeros(3, dtype=torch.int64))
    store_kv(latent[:0], k_rope[:0], view, torch.zeros(0, dtype=torch.int64))  # no rows: a no-op


@pytest.mark.parametrize("kind", list(CACHE_DTYPES))
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_store_gather_gpu(kind, mark):
    # 128K-token cache, a prefill chunk of 8K rows
    check_store_gather(kind, torch.bfloat16, T=8192, R=512, P=64, num_blocks=2048, block_size=64, device="cuda")


@pytest.mark.parametrize("kind", ["fp8", "fp32"])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_index_store_gpu(kind, mark):
    check_index_store(kind, T=8192, D=128, num_blocks=2048, block_size=64, device="cuda")
