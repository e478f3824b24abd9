"""The HiSparse row-copy kernel against its torch reference: bit for bit, strided layer views, skipped
slots, byte-sized rows, whole-page rows; host <-> device through pinned memory on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.hisparse_gather import copy_rows, copy_rows_ref

interp = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (CPU-only torch)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ON_EVERY_DEVICE = [pytest.param("cpu", False, marks=interp, id="interp"),
                   pytest.param("cuda", True, marks=[pytest.mark.gpu, needs_cuda], id="gpu-pinned-host")]


def _cache(num_blocks: int, row: int, dtype: torch.dtype, gen: torch.Generator, device="cpu", layers: int = 3,
           pin: bool = False) -> torch.Tensor:
    """Block-major [NB, layers, 64, row] of random bytes (NaN payloads included: bytes must move as they are)."""
    nbytes = row * torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_blocks, layers, 64, nbytes), generator=gen, dtype=torch.uint8)
    t = raw.view(dtype) if dtype != torch.uint8 else raw
    if pin:
        t = t.pin_memory()
    return t.to(device) if device != "cpu" else t


def _slots(n: int, hi: int, gen: torch.Generator, skip_every: int = 5) -> torch.Tensor:
    s = torch.randperm(hi, generator=gen)[:n].long()
    s[::skip_every] = -1
    return s


@pytest.mark.parametrize("device,pinned", ON_EVERY_DEVICE)
@pytest.mark.parametrize("dtype,row", [(torch.uint8, 40), (torch.uint8, 42), (torch.float32, 24),
                                       (torch.bfloat16, 36), (torch.uint8, 656), (torch.bfloat16, 17)])
def test_copy_rows_bitwise(device, pinned, dtype, row):
    """Rows of 4, 2 and 1 words' alignment (the kernel's VEC) and of bytes; on CUDA from pinned host memory."""
    gen = torch.Generator().manual_seed(row)
    src_full = _cache(5, row, dtype, gen, pin=pinned)
    dst_full = _cache(4, row, dtype, gen, device=device)
    before = dst_full.cpu().clone()
    ss = _slots(150, 5 * 64, gen)
    ds = _slots(150, 4 * 64, gen, skip_every=7)
    want = before.clone()
    copy_rows_ref(src_full[:, 1], ss, want[:, 2], ds)
    copy_rows(src_full[:, 1], ss.to(device), dst_full[:, 2], ds.to(device))
    dst_full = dst_full.cpu()
    assert torch.equal(dst_full.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(dst_full.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(dst_full[:, [0, 1]].view(torch.uint8), before[:, [0, 1]].view(torch.uint8)), \
        "other layers must stay untouched"


@interp
def test_copy_whole_pages_and_empty_lists():
    gen = torch.Generator().manual_seed(1)
    src_full, dst_full = _cache(6, 20, torch.uint8, gen), _cache(3, 20, torch.uint8, gen)
    pages = lambda v: v.view(v.shape[0], 1, v.shape[1] * v.shape[2])
    ss, ds = torch.tensor([4, -1, 0]), torch.tensor([0, 1, 2])
    want = dst_full.clone()
    copy_rows_ref(pages(src_full[:, 0]), ss, pages(want[:, 1]), ds)
    copy_rows(pages(src_full[:, 0]), ss, pages(dst_full[:, 1]), ds)
    assert torch.equal(dst_full, want) and torch.equal(dst_full[0, 1], src_full[4, 0])
    copy_rows(src_full[:, 0], torch.empty(0, dtype=torch.long), dst_full[:, 0], torch.empty(0, dtype=torch.long))


def test_copy_rows_rejects_bad_shapes():
    a = torch.zeros(2, 64, 8)
    with pytest.raises(ValueError, match="row sizes differ"):
        copy_rows_ref(a, torch.tensor([0]), torch.zeros(2, 64, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="equally long"):
        copy_rows_ref(a, torch.tensor([0, 1]), a, torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous rows"):
        copy_rows_ref(a.transpose(1, 2), torch.tensor([0]), a, torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_copy_rows_gpu_pinned_host(direction):
    gen = torch.Generator().manual_seed(7)
    host_src = direction == "h2d"
    src_full = _cache(64, 656, torch.uint8, gen, device="cpu" if host_src else "cuda", pin=host_src, layers=4)
    host_dst = direction == "d2h"
    dst_full = _cache(32, 656, torch.uint8, gen, device="cpu" if host_dst else "cuda", pin=host_dst, layers=4)
    ss = _slots(1500, 64 * 64, gen).cuda()
    ds = _slots(1500, 32 * 64, gen, skip_every=7).cuda()
    want = dst_full.cpu().clone()
    copy_rows_ref(src_full[:, 1].cpu(), ss.cpu(), want[:, 3], ds.cpu())
    copy_rows(src_full[:, 1], ss, dst_full[:, 3], ds)
    torch.cuda.synchronize()
    assert torch.equal(dst_full.cpu(), want)


@pytest.mark.parametrize("device,pinned", ON_EVERY_DEVICE)
def test_copy_rows_two_destinations(device, pinned):
    """One read, two writes (the write-through of new rows): each destination skips its own -1 slots."""
    gen = torch.Generator().manual_seed(3)
    src = _cache(4, 656, torch.uint8, gen, device=device, layers=2)
    d1 = _cache(6, 656, torch.uint8, gen, device=device, layers=2)
    d2 = _cache(8, 656, torch.uint8, gen, device="cpu" if pinned else device, pin=pinned, layers=2)
    ss = _slots(100, 4 * 64, gen, skip_every=9).to(device)
    s1 = _slots(100, 6 * 64, gen, skip_every=5).to(device)
    s2 = _slots(100, 8 * 64, gen, skip_every=3).to(device)
    w1, w2 = d1.cpu().clone(), d2.cpu().clone()
    copy_rows_ref(src[:, 0].cpu(), ss.cpu(), w1[:, 1], s1.cpu())
    copy_rows_ref(src[:, 0].cpu(), ss.cpu(), w2[:, 1], s2.cpu())
    copy_rows(src[:, 0], ss, d1[:, 1], s1, d2[:, 1], s2)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(d1.cpu(), w1) and torch.equal(d2.cpu(), w2)


@pytest.mark.parametrize("device,pinned", ON_EVERY_DEVICE)
@pytest.mark.parametrize("pinned_side", ["src", "dst"])
def test_copy_rows_layers(device, pinned, pinned_side):
    """Every layer of a group in one launch (equally spaced layer views), and the fallback for views that
    are not (one launch per layer): the same bytes as the reference, other layers untouched. On the GPU
    one side is pinned host memory: the miss copies (host -> device) and the write-through (device -> host)."""
    from kernels.hisparse_gather import copy_rows_layers

    gen = torch.Generator().manual_seed(5)
    host_src, host_dst = pinned and pinned_side == "src", pinned and pinned_side == "dst"
    src = _cache(5, 656, torch.uint8, gen, device="cpu" if host_src else device, pin=host_src, layers=5)
    dst = _cache(3, 656, torch.uint8, gen, device="cpu" if host_dst else device, pin=host_dst, layers=5)
    ss = _slots(120, 5 * 64, gen).to(device)
    ds = _slots(120, 3 * 64, gen, skip_every=7).to(device)
    for layers in ([1, 2, 3], [0, 2, 3]):  # equally spaced; not (fallback)
        want = dst.cpu().clone()
        for l in layers:
            copy_rows_ref(src[:, l].cpu(), ss.cpu(), want[:, l], ds.cpu())
        copy_rows_layers([src[:, l] for l in layers], ss, [dst[:, l] for l in layers], ds)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), want), layers


@pytest.mark.parametrize("device,pinned", ON_EVERY_DEVICE)
def test_layer_copy_launches_again_by_specialisation(device, pinned):
    """One LayerCopy launched many times (the per-step path: after a key's first launch, the compiled handle
    is launched directly): row counts of 1, multiples of 16 and others, int32 and int64 slot lists, slot lists
    that are not 16-byte aligned; each launch copies exactly the reference's rows."""
    from kernels.hisparse_gather import LayerCopy

    gen = torch.Generator().manual_seed(11)
    src = _cache(6, 656, torch.uint8, gen, device="cpu", pin=pinned, layers=3)
    dst = _cache(4, 656, torch.uint8, gen, device=device, layers=3)
    copy = LayerCopy([src[:, l] for l in range(3)], [dst[:, l] for l in range(3)])
    for i, (n, dtype, offset) in enumerate([(37, torch.int64, 0), (1, torch.int64, 0), (48, torch.int64, 0),
                                            (37, torch.int64, 0), (37, torch.int32, 1), (16, torch.int32, 3),
                                            (1, torch.int64, 0), (37, torch.int32, 1), (48, torch.int64, 1)]):
        ss = torch.cat([torch.zeros(offset, dtype=torch.long), _slots(n, 6 * 64, gen)]).to(dtype).to(device)[offset:]
        ds = torch.cat([torch.zeros(offset, dtype=torch.long), _slots(n, 4 * 64, gen, skip_every=3)])
        ds = ds.to(dtype).to(device)[offset:]
        want = dst.cpu().clone()
        for l in range(3):
            copy_rows_ref(src[:, l], ss.cpu(), want[:, l], ds.cpu())
        copy(ss, ds)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), want), (i, n, dtype, offset)


@pytest.mark.parametrize("device,pinned", ON_EVERY_DEVICE)
def test_row_mover_group_copies(device, pinned):
    """RowMover's group copies: the parts a group is copied in are built once (the leader layer alone for
    miss copies), every layer gets the reference's bytes, and on CUDA each layer gets the event of its part."""
    from engine.hisparse.row_mover import RowMover

    gen = torch.Generator().manual_seed(9)
    host = _cache(5, 656, torch.uint8, gen, device="cpu", pin=pinned, layers=4)
    dev = _cache(3, 656, torch.uint8, gen, device=device, layers=4)
    ss, ds = _slots(100, 5 * 64, gen).to(device), _slots(100, 3 * 64, gen, skip_every=7).to(device)
    mover, built = RowMover(torch.device(device)), []

    def pairs():
        built.append(1)
        return [(host[:, l], dev[:, l]) for l in range(4)]

    want = dev.cpu().clone()
    for l in range(4):
        copy_rows_ref(host[:, l], ss.cpu(), want[:, l], ds.cpu())
    events = mover.copy_layers(("miss", 0), pairs, ss, ds, [4, 5, 6, 7])
    for layer in (4, 5, 6, 7):
        mover.wait(events.get(layer))
    if device == "cuda":
        torch.cuda.synchronize()
        assert events[4] is not events[5] and events[5] is events[6] is events[7]
    assert torch.equal(dev.cpu(), want)
    assert [len(ps) for ps, _ in mover.parts(("miss", 0), pairs, split=True)] == [1, 3] and built == [1]
    back = host.clone()
    for l in range(4):
        copy_rows_ref(dev[:, l].cpu(), ds.cpu(), back[:, l], ss.cpu())
    mover.copy_group(("back", 0), lambda: [(dev[:, l], host[:, l]) for l in range(4)], ds, ss)  # one part
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, back) and len(mover.parts(("back", 0), pairs)) == 1
