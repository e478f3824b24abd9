"""RMSNorm in one launch, optionally with the residual add before it.

    y = w * cast(x / rms(x))           rms(x) = sqrt(mean(x^2) + eps), computed in fp32
    add: s = cast(x + residual);  y = norm(s), and s is returned as the new residual

`cast` is to x's dtype, in HF's order of operations (`rms_norm_ref`, what the eager `RMSNorm` module
runs): the normalised row is rounded to x's dtype before the weight multiplies it, and y takes the promoted
dtype of weight and x. The eager module is eight kernels (upcast, square, mean, add, rsqrt, multiply,
downcast, weight); on a decode step of a 78-layer model that is about 2,500 launches. This is one launch.
Against the reference it differs only in the order of the fp32 sum of squares.

`rms_norm_quant` also writes y's FP8 activation quantization (kernels.fp8_quant: e4m3 codes and one fp32 scale
per token per 128 channels, of y as stored), the bits `quant_act(y)` gives, in the same launch: the FP8 projection
after a norm then skips its own quantization launch (kernels.fp8_gemm's `x_quant`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit, next_pow2, on_bf16_grid, quant_e4m3_rows, to_bf16


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, q_ptr, qs_ptr, D, eps, sx, sr, sy, ss, sq, sqs,
                     BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, QUANT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One row per program: y[row] = w * cast(s / rms(s)), s = x[row] (+ res[row], stored to sum[row]); with
    QUANT, y's e4m3 codes and per-128-channel scales (of y as stored) to q[row] and qs[row]."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + row * sx + d, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * sr + d, mask=m, other=0.0).to(tl.float32)
        if sum_ptr.dtype.element_ty == tl.bfloat16:
            x = on_bf16_grid(x)  # integer rounding: a compiled cast pair could be dropped
        else:
            x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)
        tl.store(sum_ptr + row * ss + d, x.to(sum_ptr.dtype.element_ty), mask=m)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    xn = x * inv
    if x_ptr.dtype.element_ty == tl.bfloat16:
        xn = on_bf16_grid(xn)
    elif x_ptr.dtype.element_ty != tl.float32:
        xn = xn.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * xn
    if y_ptr.dtype.element_ty == tl.bfloat16:
        yo = to_bf16(y, ROUND_FIRST)
    else:
        yo = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + d, yo, mask=m)
    if QUANT:  # the stored values, read back as [groups, 128] (reshaping yo in registers would let the compiler
        # lay x out for it, and the sum of squares above would add in another order than rms_norm's)
        tl.debug_barrier()
        g = tl.arange(0, BLOCK_D // 128)
        c = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        yv = tl.load(y_ptr + row * sy + c, mask=c < D, other=0.0).to(tl.float32)
        q, scale = quant_e4m3_rows(yv, ROUND_FIRST)
        tl.store(q_ptr + row * sq + c, q, mask=c < D)
        tl.store(qs_ptr + row * sqs + g, scale, mask=g * 128 < D)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """[..., D] -> a [rows, D] view with unit stride along D (a copy only when no such view exists)."""
    t2 = t.reshape(-1, D) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm_ref`: x [..., D] (rows may be strided), weight [D].

    With `residual` (x's shape and dtype) returns (norm(x + residual), x + residual), the sum rounded to
    x's dtype as an eager `x + residual` would be; without it, norm(x)."""
    y, s, _ = _norm(x, weight, eps, residual, quant=False)
    return y if residual is None else (y, s)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """`rms_norm`, and in the same launch y's FP8 activation quantization: (y, (y_q, y_s)), or with `residual`
    (y, x + residual, (y_q, y_s)); y_q float8_e4m3fn [rows, D], y_s fp32 [rows, ceil(D/128)] (rows: x's
    leading dimensions flattened), bit for bit `quant_act(y.reshape(-1, D))`."""
    y, s, quant = _norm(x, weight, eps, residual, quant=True)
    return (y, quant) if residual is None else (y, s, quant)


def _norm(x, weight, eps: float, residual, quant: bool):
    """(y, the sum or None, the codes and scales or None), y and the sum in x's shape."""
    D = x.shape[-1]
    _check(x, weight, residual)
    x2 = _rows(x, D)
    rows = x2.shape[0]
    y = torch.empty((rows, D), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty((rows, D), dtype=x.dtype, device=x.device) if residual is not None else y
    codes = (torch.empty((rows, D), dtype=torch.uint8, device=x.device),
             torch.empty((rows, -(-D // 128)), dtype=torch.float32, device=x.device)) if quant else None
    _launch(x2, _rows(residual, D) if residual is not None else None, weight, y, s, codes, eps)
    shape = (*x.shape[:-1], D)
    return (y.view(shape), s.view(shape) if residual is not None else None,
            (codes[0].view(torch.float8_e4m3fn), codes[1]) if quant else None)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{D}] for x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    check_device(x, weight, *(() if residual is None else (residual,)))


def _launch(x2, r2, weight, y, s, quant, eps: float) -> None:
    """One program a row: y (and s = x + residual with `r2`, and y's codes and scales with `quant`)."""
    rows, D = x2.shape
    if not rows:
        return
    block = max(next_pow2(D), 128) if quant is not None else next_pow2(D)  # whole 128-channel groups
    q, qs = quant if quant is not None else (y, y)  # unread without QUANT
    res = r2 if r2 is not None else x2  # unread without HAS_RES
    _rms_norm_kernel[(rows,)](
        x2, res, weight, y, s, q, qs, D, float(eps), x2.stride(0), res.stride(0), y.stride(0), s.stride(0),
        q.stride(0), qs.stride(0), BLOCK_D=block, HAS_RES=r2 is not None, QUANT=quant is not None,
        ROUND_FIRST=interpreting(), num_warps=max(1, min(16, block // 512)))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The semantics (the eager RMSNorm module's arithmetic): see the module docstring."""
    s = x if residual is None else x + residual
    dtype = s.dtype
    xf = s.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return y if residual is None else (y, s)
