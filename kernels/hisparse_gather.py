"""Row copies between paged caches for HiSparse: missed rows host -> hot buffer, the newest rows device ->
host, whole contexts host -> workspace.

A "cache" here is one layer's paged view `[num_blocks, block_size, row]` (a strided view of a block-major
tensor is fine; the row itself must be contiguous). Slot s names row `s % block_size` of block
`s // block_size`. Rows are copied as raw words, so every format (fp8_ds_mla bytes, bf16, fp32) moves bit
for bit. On CUDA either side may be pinned host memory: the kernel reads or writes it in place over PCIe
(unified virtual addressing), so a copy whose slots were computed on the GPU needs no host round trip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import CompiledKernel


@triton.jit(do_not_specialize=["num_rows"])
def _copy_rows_kernel(src_ptr, dst_ptr, src_slot_ptr, dst_slot_ptr, num_rows,
                      src_block_size, s_blk, s_tok, dst_block_size, d_blk, d_tok,
                      dst2_ptr, dst2_slot_ptr, dst2_block_size, d2_blk, d2_tok, s_layer, d_layer,
                      NUM_WORDS: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                      HAS_DST2: tl.constexpr):
    """Program (r, l) copies rows [r*BLOCK_R, +BLOCK_R) of the slot lists in layer l (layer l's views start
    l * s_layer / d_layer words after layer 0's); a slot < 0 skips the row (for that destination). With
    HAS_DST2 each row read goes to two destinations. Strides are in words; offsets are 64-bit (host pools
    exceed 2^31 words). Every row starts at a multiple of VEC words (the caller checks the strides), and the
    row length is a constant: together they let loads and stores move VEC words at once."""
    layer = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    src = tl.load(src_slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    dst = tl.load(dst_slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    ok = (src >= 0) & (dst >= 0)
    src_base = tl.multiple_of(layer * s_layer + (src // src_block_size) * s_blk + (src % src_block_size) * s_tok, VEC)
    dst_base = tl.multiple_of(layer * d_layer + (dst // dst_block_size) * d_blk + (dst % dst_block_size) * d_tok, VEC)
    if HAS_DST2:
        dst2 = tl.load(dst2_slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
        ok2 = (src >= 0) & (dst2 >= 0)
        dst2_base = tl.multiple_of((dst2 // dst2_block_size) * d2_blk + (dst2 % dst2_block_size) * d2_tok, VEC)
    for w0 in tl.static_range(0, NUM_WORDS, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        in_row = cols[None, :] < NUM_WORDS
        if HAS_DST2:
            vals = tl.load(src_ptr + src_base[:, None] + cols[None, :], mask=(ok | ok2)[:, None] & in_row, other=0)
            tl.store(dst2_ptr + dst2_base[:, None] + cols[None, :], vals, mask=ok2[:, None] & in_row)
        else:
            vals = tl.load(src_ptr + src_base[:, None] + cols[None, :], mask=ok[:, None] & in_row, other=0)
        tl.store(dst_ptr + dst_base[:, None] + cols[None, :], vals, mask=ok[:, None] & in_row)


_COPY = CompiledKernel(_copy_rows_kernel)  # LayerCopy's per-step launches skip the JIT's argument binding


def _as_words(view: torch.Tensor) -> torch.Tensor:
    """Reinterpret a [NB, bs, row] view as 32-bit words when the row and strides allow it, else bytes."""
    b = view.view(torch.uint8) if view.dtype != torch.uint8 else view
    if b.shape[-1] % 4 == 0 and all(s % 4 == 0 for s in b.stride()[:-1]) and b.data_ptr() % 4 == 0:
        return b.view(torch.int32)
    return b


def _check_views(src: torch.Tensor, dst: torch.Tensor) -> None:
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a paged view [num_blocks, block_size, row] with contiguous rows, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    if src.shape[-1] * src.element_size() != dst.shape[-1] * dst.element_size():
        raise ValueError(f"row sizes differ: src {src.shape[-1] * src.element_size()} B, "
                         f"dst {dst.shape[-1] * dst.element_size()} B")


def _check_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError(f"slot lists must be 1-D and equally long, got {tuple(src_slots.shape)} and "
                         f"{tuple(dst_slots.shape)}")
    if src_slots.dtype not in (torch.int32, torch.int64) or dst_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot lists must be int32 or int64")


def _check(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> None:
    _check_views(src, dst)
    _check_slots(src_slots, dst_slots)


def copy_rows(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
              dst2: torch.Tensor | None = None, dst2_slots: torch.Tensor | None = None) -> None:
    """dst[dst_slots[i]] = src[src_slots[i]] for every i with both slots >= 0 (the Triton kernel), and the
    same into dst2[dst2_slots[i]] when a second destination is given (one read, two writes).

    src / dst: paged views [NB, bs, row] of the same row size in bytes (dtypes may differ: bytes move).
    On CUDA the slot lists must be on the GPU; src or dst may be pinned host memory. Rows written twice
    in one call must carry the same bytes (the order between programs is undefined).
    """
    _check(src, src_slots, dst, dst_slots)
    if dst2 is not None:
        _check(src, src_slots, dst2, dst2_slots)
    n = src_slots.shape[0]
    if n == 0:
        return
    views = [_as_words(t) for t in (src, dst) + ((dst2,) if dst2 is not None else ())]
    if len({v.dtype for v in views}) > 1:  # one side could not be read as words: move bytes everywhere
        views = [t.view(torch.uint8) for t in (src, dst) + ((dst2,) if dst2 is not None else ())]
    sw, dw = views[0], views[1]
    d2w, d2_slots = (views[2], dst2_slots.contiguous()) if dst2 is not None else (dw, dst_slots)
    words = sw.shape[-1]
    block_r, block_w, warps = _tile(words)
    vec = _vec(words, sw.stride(0), sw.stride(1), dw.stride(0), dw.stride(1), d2w.stride(0), d2w.stride(1))
    _copy_rows_kernel[(triton.cdiv(n, block_r),)](
        sw, dw, src_slots.contiguous(), dst_slots.contiguous(), n,
        sw.shape[1], sw.stride(0), sw.stride(1), dw.shape[1], dw.stride(0), dw.stride(1),
        d2w, d2_slots, d2w.shape[1], d2w.stride(0), d2w.stride(1), 0, 0,
        NUM_WORDS=words, VEC=vec, BLOCK_R=block_r, BLOCK_W=block_w, HAS_DST2=dst2 is not None, num_warps=warps)


# Rows per program and warps of the row copy (its tile is [rows, next_power_of_2(words)] words); the defaults
# were measured on random 656-B rows read from pinned host memory (BENCHMARKS.md, HiSparse copy kernel).
COPY_TILE = {"rows": 16, "warps": 8, "max_vec": 4}


def _tile(words: int) -> tuple[int, int, int]:
    return COPY_TILE["rows"], min(256, triton.next_power_of_2(words)), COPY_TILE["warps"]


def _vec(*ints: int) -> int:
    """The most words (4, 2 or 1) every row start is a multiple of: it divides the row length, every stride
    and every layer step."""
    for v in (4, 2):
        if v <= COPY_TILE["max_vec"] and all(x % v == 0 for x in ints):
            return v
    return 1


def _layer_step(views: list[torch.Tensor]) -> int | None:
    """Bytes from each view to the next when they are equally spaced, equally shaped and strided views of
    one tensor (the layers of a block-major cache), else None."""
    v0 = views[0]
    if any(v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype
           or v.untyped_storage().data_ptr() != v0.untyped_storage().data_ptr() for v in views):
        return None
    if len(views) == 1:
        return 0
    step = views[1].data_ptr() - v0.data_ptr()
    if any(views[i].data_ptr() - v0.data_ptr() != i * step for i in range(len(views))):
        return None
    return step


class LayerCopy:
    """`copy_rows(srcs[i], src_slots, dsts[i], dst_slots)` for every layer i of a fixed list of layer views,
    checked and laid out once, so that a call is one launch: HiSparse copies the same layer groups every
    step. One launch covers every layer when the views are equally spaced views of one tensor on each side
    (a block-major cache), else there is one launch per layer."""

    def __init__(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor]):
        if len(srcs) != len(dsts) or not srcs:
            raise ValueError(f"need as many source as destination layers (got {len(srcs)} and {len(dsts)})")
        for s, d in zip(srcs, dsts):
            _check_views(s, d)
        self.srcs, self.dsts = list(srcs), list(dsts)
        s_step, d_step = _layer_step(srcs), _layer_step(dsts)
        sw, dw = _as_words(srcs[0]), _as_words(dsts[0])
        unit = sw.element_size()
        self.fused = not (s_step is None or d_step is None or sw.dtype != dw.dtype or s_step % unit
                          or d_step % unit or (len(srcs) > 1 and (s_step == 0 or d_step == 0)))
        if self.fused:
            words = sw.shape[-1]
            self.sw, self.dw = sw, dw
            self.layout = (words, sw.shape[1], sw.stride(0), sw.stride(1), dw.shape[1], dw.stride(0), dw.stride(1))
            self.steps = (s_step // unit, d_step // unit)
            self.vec = _vec(*self.layout[:1], *self.layout[2:4], *self.layout[5:], *self.steps)

    def __call__(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        _check_slots(src_slots, dst_slots)
        if not self.fused:
            for s, d in zip(self.srcs, self.dsts):
                copy_rows(s, src_slots, d, dst_slots)
            return
        n = src_slots.shape[0]
        if n == 0:
            return
        words, sbs, sb, st, dbs, db, dt = self.layout
        block_r, block_w, warps = _tile(words)
        dst_slots = dst_slots.contiguous()
        _COPY((triton.cdiv(n, block_r), len(self.srcs)),
              (self.sw, self.dw, src_slots.contiguous(), dst_slots, n, sbs, sb, st, dbs, db, dt,
               self.dw, dst_slots, dbs, db, dt, *self.steps),
              dict(NUM_WORDS=words, VEC=self.vec, BLOCK_R=block_r, BLOCK_W=block_w, HAS_DST2=False), warps)


def copy_rows_layers(srcs: list[torch.Tensor], src_slots: torch.Tensor, dsts: list[torch.Tensor],
                     dst_slots: torch.Tensor) -> None:
    """`copy_rows(srcs[i], src_slots, dsts[i], dst_slots)` for every layer i (see LayerCopy)."""
    LayerCopy(srcs, dsts)(src_slots, dst_slots)


def copy_rows_ref(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Plain-torch `copy_rows` (CPU tensors, or all on one device)."""
    _check(src, src_slots, dst, dst_slots)
    keep = (src_slots >= 0) & (dst_slots >= 0)
    s = src_slots[keep].long().to(src.device)
    d = dst_slots[keep].long().to(dst.device)
    if s.numel() == 0:
        return
    rows = src[s // src.shape[1], s % src.shape[1]]
    if rows.dtype != dst.dtype:
        rows = rows.contiguous().view(torch.uint8).view(dst.dtype)
    dst[d // dst.shape[1], d % dst.shape[1]] = rows.to(dst.device)
