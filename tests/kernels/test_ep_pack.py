"""The static dispatch's packed send rows (kernels/ep_pack.py) against the torch reference, byte for byte."""

from __future__ import annotations

import pytest
import torch

from kernels.ep_pack import pack_fp8_rows, pack_fp8_rows_ref, payload_width
from kernels.fp8_quant import quant_act
from tests.helpers.kernel_inputs import gpu, interp

SENTINEL = 256


def _inputs(n: int, H: int, k: int, device: str, ids_dtype=torch.int64, valid: str = "some", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)
    if n > 2:
        x[1, :128] = 0.0  # an all-zero block: the tiny scale
    ids = torch.randint(0, SENTINEL, (n, k), generator=g).to(ids_dtype)
    w = torch.rand(n, k, generator=g)
    v = None if valid == "none" else (torch.rand(n, generator=g) > 0.3)
    return [t.to(device) if t is not None else None for t in (x, ids, w, v)]


def _check(n, H, k, rows, device, **kw):
    x, ids, w, v = _inputs(n, H, k, device, **kw)
    got = pack_fp8_rows(x, ids, w, v, rows, SENTINEL)
    want = pack_fp8_rows_ref(x.cpu(), ids.cpu(), w.cpu(), None if v is None else v.cpu(), rows, SENTINEL)
    if device != "cpu":  # the codes and scales of quant_act on this device (its division is the GPU's)
        q, sc = quant_act(torch.cat([x, x.new_zeros((rows - n, H))]))
        want[:, :H] = q.view(torch.uint8).cpu()
        want[:, H:H + sc.shape[1] * 4] = sc.contiguous().view(torch.uint8).cpu()
    assert got.shape == (rows, payload_width(H, k)) and got.dtype == torch.uint8
    assert torch.equal(got.cpu(), want)
    return got


@interp
@pytest.mark.parametrize("n,H,k,rows,kw", [
    (5, 256, 8, 5, {}),                                   # no padding, some rows not real
    (5, 320, 6, 12, {"ids_dtype": torch.int32}),          # H not a multiple of 128, k not a power of two, padding
    (0, 256, 8, 4, {"valid": "none"}),                    # an idle rank: every row padding
    (17, 128, 2, 17, {"valid": "none"}),                  # every row real
])
def test_packed_rows_equal_the_reference_interp(n, H, k, rows, kw):
    out = _check(n, H, k, rows, "cpu", **kw)
    meta = out[:, -8 * k:].contiguous().view(torch.int32)
    assert (meta[n:, :k] == SENTINEL).all() and (meta[n:, k:] == 0).all()  # padding claims no expert


@interp
def test_the_codes_are_quant_acts():
    x, ids, w, v = _inputs(9, 384, 8, "cpu")
    out = pack_fp8_rows(x, ids, w, v, 9, SENTINEL)
    q, s = quant_act(x)
    assert torch.equal(out[:, :384], q.view(torch.uint8))
    assert torch.equal(out[:, 384:384 + 12].contiguous().view(torch.float32), s)


def test_bad_input_is_refused():
    x, ids, w, v = _inputs(4, 256, 8, "cpu")
    with pytest.raises(ValueError, match="rows >= n"):
        pack_fp8_rows(x, ids, w, v, 3, SENTINEL)
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        pack_fp8_rows(x, ids[:, :4], w, v, 4, SENTINEL)
    with pytest.raises(ValueError, match="bool"):
        pack_fp8_rows(x, ids, w, v.float(), 4, SENTINEL)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_fp8_rows(x[:, :250], ids, w, v, 4, SENTINEL)


@pytest.mark.parametrize("n,rows", [(256, 256), (37, 64), (0, 8)])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=gpu)])
def test_packed_rows_equal_the_reference_on_cuda(n, rows, mark):
    _check(n, 6144, 8, rows, "cuda")
