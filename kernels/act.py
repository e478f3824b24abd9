"""The gated MLP's activation in one launch, optionally with the FP8 quantization of its output.

    h = cast(cast(silu(gate)) * up)          silu(g) = g / (1 + exp(-g)), in fp32

`cast` is to the inputs' dtype, in eager torch's order (`silu_mul_ref`: `F.silu(gate) * up`, two kernels, each
rounding its output). gate and up are [rows, I] views with unit column stride (the two halves of the packed
gate + up projection's output, engine.model.layers.GatedMLP). With `quant`, h's FP8 activation quantization too
(kernels.fp8_quant: e4m3 codes and one fp32 scale per row per 128 channels, of h as stored): the down projection
then skips its own quantization launch (kernels.fp8_gemm's `x_quant`). Against the reference it differs only
where Triton's exp and torch's round differently in fp32 (then, rarely, one bf16 rounding of h).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_support import check_device, interpreting, jit, on_bf16_grid, quant_e4m3_rows, to_bf16

BLOCK_I = 512  # channels a program (four quantization groups)


@jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, q_ptr, qs_ptr, inter, sg, su, sh, sq, sqs,
                     BLOCK: tl.constexpr, QUANT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Program (row, block): h[row, block] = cast(cast(silu(g)) * u); with QUANT its codes and group scales."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if h_ptr.dtype.element_ty == tl.bfloat16:
        s = on_bf16_grid(s)  # F.silu's own rounding, before the product
    elif h_ptr.dtype.element_ty != tl.float32:
        s = s.to(h_ptr.dtype.element_ty).to(tl.float32)
    if h_ptr.dtype.element_ty == tl.bfloat16:
        h = to_bf16(s * u, ROUND_FIRST)
    else:
        h = (s * u).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * sh + c, h, mask=m)
    if QUANT:  # the stored values, 128 channels a group (lanes past `inter` are 0: their loads are)
        q, scale = quant_e4m3_rows(tl.reshape(h.to(tl.float32), (BLOCK // 128, 128)), ROUND_FIRST)
        tl.store(q_ptr + row * sq + c, tl.reshape(q, (BLOCK,)), mask=m)
        grp = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
        tl.store(qs_ptr + row * sqs + grp, scale, mask=grp * 128 < inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quant: bool = False):
    """Triton `silu_mul_ref`: gate, up [rows, I] of one dtype (unit column stride, any row stride) -> h [rows, I];
    with `quant`, (h, (h_q float8_e4m3fn [rows, I], h_s fp32 [rows, ceil(I/128)])), the bits `quant_act(h)`
    gives."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must be "
                         "[rows, I] of one dtype")
    check_device(gate, up)
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    rows, inter = gate.shape
    h = torch.empty((rows, inter), dtype=gate.dtype, device=gate.device)
    q = torch.empty((rows, inter), dtype=torch.uint8, device=gate.device) if quant else h
    qs = torch.empty((rows, triton.cdiv(inter, 128)), dtype=torch.float32, device=gate.device) if quant else h
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, BLOCK_I))](
            gate, up, h, q, qs, inter, gate.stride(0), up.stride(0), h.stride(0), q.stride(0), qs.stride(0),
            BLOCK=BLOCK_I, QUANT=quant, ROUND_FIRST=interpreting(), num_warps=4)
    return (h, (q.view(torch.float8_e4m3fn), qs)) if quant else h


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The semantics: the eager gated MLP's activation."""
    return F.silu(gate) * up
