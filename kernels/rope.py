"""RoPE in one launch, and the absorbed MLA query [q_lat ; rope(q_pe)] written in the same launch.

    interleaved (MLA, what the cache stores):  (x[2i], x[2i+1]) -> (x0 c - x1 s, x1 c + x0 s)
    half-split (DeepSeek-V3.2's indexer):      (x[i], x[i + d/2]) -> the same, pair by pair
with c, s = cos, sin of the token's angle i (fp32 [T, d/2]), cast to x's dtype first; each product, then the
sum, rounded to x's dtype: the arithmetic of the eager `rope_ref` (what `engine.model.layers.apply_rope`
runs), so a bf16 result is bit for bit the eager one. The eager form is about ten kernels per call (slices,
four products, two sums, stack, flatten) plus a `torch.cat` to put the rotated part back beside the rest;
here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_device, jit, next_pow2, on_bf16_grid


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (fp32) rounded onto DTYPE's grid, kept as fp32 (what an eager op in DTYPE produces). bf16 rounds in
    integer ops (`on_bf16_grid`): compiled, a cast pair was dropped and x0 c contracted into the sum after it."""
    if DTYPE == tl.bfloat16:
        return on_bf16_grid(x)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate(x0, x1, c, s, DTYPE: tl.constexpr):
    c = _round(c, DTYPE)
    s = _round(s, DTYPE)
    y0 = _round(_round(x0 * c, DTYPE) - _round(x1 * s, DTYPE), DTYPE)
    y1 = _round(_round(x1 * c, DTYPE) + _round(x0 * s, DTYPE), DTYPE)
    return y0, y1


@jit
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, H, sx_t, sx_h, so_t, so_h, sc_t,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Program (token, head block): out[t, h, :2 HALF] = rope(x[t, h, :2 HALF]); the rest of the row is not
    touched (in place when out is x)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    m = (h < H)[:, None]
    if INTERLEAVE:
        i0, i1 = 2 * i, 2 * i + 1
    else:
        i0, i1 = i, i + HALF
    xrow = x_ptr + t * sx_t + h[:, None].to(tl.int64) * sx_h
    x0 = tl.load(xrow + i0[None, :], mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(xrow + i1[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * sc_t + i)[None, :]
    s = tl.load(sin_ptr + t * sc_t + i)[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    y0, y1 = _rotate(x0, x1, c, s, dtype)
    orow = out_ptr + t * so_t + h[:, None].to(tl.int64) * so_h
    tl.store(orow + i0[None, :], y0.to(dtype), mask=m)
    tl.store(orow + i1[None, :], y1.to(dtype), mask=m)


@jit
def _rope_cat_kernel(a_ptr, x_ptr, out_ptr, cos_ptr, sin_ptr, A, sa_t, sa_h, sx_t, sx_h, so_t, so_h, sc_t,
                     BLOCK_A: tl.constexpr, HALF: tl.constexpr):
    """Program (token, head): out[t, h] = [a[t, h] (A values) ; rope_interleaved(x[t, h]) (2 HALF values)]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    orow = out_ptr + t * so_t + h * so_h
    for a0 in range(0, A, BLOCK_A):
        j = a0 + tl.arange(0, BLOCK_A)
        v = tl.load(a_ptr + t * sa_t + h * sa_h + j, mask=j < A)
        tl.store(orow + j, v.to(dtype), mask=j < A)
    i = tl.arange(0, HALF)
    x0 = tl.load(x_ptr + t * sx_t + h * sx_h + 2 * i).to(tl.float32)
    x1 = tl.load(x_ptr + t * sx_t + h * sx_h + 2 * i + 1).to(tl.float32)
    y0, y1 = _rotate(x0, x1, tl.load(cos_ptr + t * sc_t + i), tl.load(sin_ptr + t * sc_t + i), dtype)
    tl.store(orow + A + 2 * i, y0.to(dtype))
    tl.store(orow + A + 2 * i + 1, y1.to(dtype))


def rope_fits(d: int) -> bool:
    """Whether the kernels take a rotated width of d: an even d whose half is a power of two (64 in every
    GLM-5.x / DeepSeek MLA config); other widths take the eager ops."""
    return d >= 2 and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0


def _check_angles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = x.shape[0]
    if not rope_fits(d):
        raise ValueError(f"the rotated width must be an even power of two here, got {d}")
    if cos.shape != (T, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [{T}, {d // 2}]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos / sin must be float32 angles, got {cos.dtype} / {sin.dtype}")
    check_device(x, cos, sin)
    return cos.contiguous(), sin.contiguous()


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[T, D] or [T, H, D] -> a [T, H, D] view with unit stride along D."""
    x3 = x[:, None] if x.dim() == 2 else x
    if x3.dim() != 3 or x3.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] or [T, H, D] with unit stride along D, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x3


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope_dim: int | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton `rope_ref`: rotate x[..., :rope_dim] of x [T, D] or [T, H, D] by per-token angles.

    out=None: a new tensor holding the rotated part only ([T, (H,) rope_dim]). out=x: in place, the rest of
    each row left as it is (the indexer's [rope | rest] heads)."""
    d = rope_dim or x.shape[-1]
    cos, sin = _check_angles(x, cos, sin, d)
    x3 = _heads(x)
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    elif out.shape[:-1] != x.shape[:-1] or out.shape[-1] < d or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} cannot hold the rotation of x {tuple(x.shape)} {x.dtype}")
    o3 = _heads(out)
    T, H = x3.shape[:2]
    if T and H:
        block_h = min(next_pow2(H), max(1, 2048 // d))
        _rope_kernel[(T, triton.cdiv(H, block_h))](
            x3, o3, cos, sin, H, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1), cos.stride(0),
            HALF=d // 2, BLOCK_H=block_h, INTERLEAVE=interleave)
    return out


def rope_cat(a: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton `rope_cat_ref`: [a ; rope_interleaved(x)] along the last dim, a [T, H, A] and x [T, H, P] (any
    strides with unit stride along the last dim) -> a new contiguous [T, H, A + P] in x's dtype."""
    if a.dim() != 3 or x.dim() != 3 or a.shape[:2] != x.shape[:2]:
        raise ValueError(f"a {tuple(a.shape)} and x {tuple(x.shape)} must be [T, H, A] and [T, H, P]")
    cos, sin = _check_angles(x, cos, sin, x.shape[-1])
    check_device(a, x)
    if a.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("a and x need unit stride along their last dim")
    T, H, A = a.shape
    out = torch.empty((T, H, A + x.shape[-1]), dtype=x.dtype, device=x.device)
    if T and H:
        _rope_cat_kernel[(T, H)](
            a, x, out, cos, sin, A, a.stride(0), a.stride(1), x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), cos.stride(0), BLOCK_A=min(1024, next_pow2(A)), HALF=x.shape[-1] // 2)
    return out


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The semantics, in eager ops: x [T, ..., d] rotated over its whole last dim."""
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
    c = cos.view(shape).to(x.dtype)
    s = sin.view(shape).to(x.dtype)
    if interleave:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)


def rope_cat_ref(a: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.to(x.dtype), rope_ref(x, cos, sin, True)], dim=-1)
