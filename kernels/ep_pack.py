"""The static expert-parallel dispatch's send rows, packed in one launch (engine/parallel/ep.py, `StaticDispatcher`).

Each of a rank's T rows (its real rows, then padding up to the group's T) goes out as one byte row of width

    W = H              e4m3 codes of x, quantized per 128 columns (kernels.fp8_quant's format and arithmetic)
      + 4 * ceil(H/128) their fp32 scales
      + 4 * k          the row's expert ids, int32; rows that are not real (`valid` false, or past the n rows
                       of x) carry `sentinel` (an id no rank holds), so no expert takes them
      + 4 * k          the row's routing weights, fp32 bits (0 past the n rows)

This is what `quant_act`, two `torch.where`s, the padding, the dtype casts and two concatenations made in six
to eight launches per MoE layer; inside a captured decode step each launch is a few microseconds of a pass that
has 75 such layers. Padding rows are zero codes with the all-zero block's scale, as `quant_act` of a zero row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import BLOCK, quant_act_ref
from kernels.triton_support import check_device, interpreting, jit, quant_e4m3_rows


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of a row's codes and scales: where its ids start in a packed row."""
    return hidden + 4 * triton.cdiv(hidden, BLOCK)


def payload_width(hidden: int, top_k: int) -> int:
    """Bytes of one packed row."""
    return fp8_row_bytes(hidden) + 8 * top_k


@jit(do_not_specialize=["n"])  # n: this pass's real rows, which follow the batch
def _pack_kernel(x_ptr, ids_ptr, w_ptr, valid_ptr, codes_ptr, words_ptr, n, T, H, sx, sid, sw, W4,
                 sentinel, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 HAS_VALID: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Rows [BLOCK_M] x one 128-column block: codes and scales; the first block's programs also the ids and
    weights. codes_ptr: the payload as bytes [T, 4 * W4]; words_ptr: the same bytes as 32-bit words [T, W4]."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    real = m < n
    c = kb * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * sx + c[None, :], mask=real[:, None] & (c[None, :] < H),
                other=0.0).to(tl.float32)
    q, s = quant_e4m3_rows(x, ROUND_FIRST)
    rows_b = m[:, None].to(tl.int64) * (4 * W4)
    tl.store(codes_ptr + rows_b + c[None, :], q, mask=(m[:, None] < T) & (c[None, :] < H))
    kbs = tl.cdiv(H, 128)
    rows_w = m.to(tl.int64) * W4
    first_word = H // 4  # H is a multiple of 4 (the launcher checks): the scales start on a word
    tl.store((words_ptr + rows_w + first_word + kb).to(tl.pointer_type(tl.float32)), s, mask=m < T)
    if kb == 0:
        j = tl.arange(0, K_PAD)
        j_ok = j[None, :] < K
        keep = real
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + m, mask=real, other=0) != 0)
        ids = tl.load(ids_ptr + m[:, None].to(tl.int64) * sid + j[None, :], mask=real[:, None] & j_ok, other=0)
        ids = tl.where(keep[:, None], ids.to(tl.int32), sentinel)
        wts = tl.load(w_ptr + m[:, None].to(tl.int64) * sw + j[None, :], mask=real[:, None] & j_ok,
                      other=0.0).to(tl.float32)
        meta = rows_w[:, None] + first_word + kbs + j[None, :]
        out_ok = (m[:, None] < T) & j_ok
        tl.store(words_ptr + meta, ids, mask=out_ok)
        tl.store((words_ptr + meta + K).to(tl.pointer_type(tl.float32)), wts, mask=out_ok)


def pack_fp8_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None,
                  rows: int, sentinel: int) -> torch.Tensor:
    """x [n, H] (bf16/fp16/fp32, rows contiguous), ids [n, k] (int32/int64), weights [n, k] (float), valid [n]
    bool or None -> uint8 [rows, payload_width(H, k)] (rows >= n: padding rows after x's)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"pack_fp8_rows takes float rows [n, H] with contiguous columns, got {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}")
    n, H = x.shape
    k = ids.shape[1] if ids.dim() == 2 else -1
    if ids.shape != (n, k) or weights.shape != (n, k) or ids.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError(f"ids and weights must be [n, k] = [{n}, k] with contiguous columns, got "
                         f"{tuple(ids.shape)} and {tuple(weights.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or not weights.is_floating_point():
        raise ValueError(f"ids must be int32/int64 and weights float, got {ids.dtype} and {weights.dtype}")
    if valid is not None and (valid.shape != (n,) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be bool [{n}], got {tuple(valid.shape)} {valid.dtype}")
    if rows < n or H % 4 or k < 1:
        raise ValueError(f"pack_fp8_rows needs rows >= n ({rows} < {n}?), H a multiple of 4 (H = {H}) and k >= 1")
    check_device(x, ids, weights, *([valid] if valid is not None else []))
    width = payload_width(H, k)
    out = torch.empty((rows, width), dtype=torch.uint8, device=x.device)
    if rows:
        block_m = 16 if interpreting() else 8
        v = valid.view(torch.uint8) if valid is not None else out  # unread without HAS_VALID
        _pack_kernel[(triton.cdiv(rows, block_m), triton.cdiv(H, BLOCK))](
            x, ids, weights, v, out, out.view(torch.int32), n, rows, H, x.stride(0), ids.stride(0),
            weights.stride(0), width // 4, sentinel, K=k, K_PAD=triton.next_power_of_2(k), BLOCK_M=block_m,
            HAS_VALID=valid is not None, ROUND_FIRST=interpreting())
    return out


def pack_fp8_rows_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None,
                      rows: int, sentinel: int) -> torch.Tensor:
    """The semantics of `pack_fp8_rows` in plain torch: pad, mask, quantize (fp32 reference), concatenate."""
    n, H = x.shape
    k = ids.shape[1]
    ids = ids.to(torch.int32)
    if valid is not None:
        ids = torch.where(valid[:, None], ids, torch.full_like(ids, sentinel))
    pad = rows - n
    x = torch.cat([x.float(), x.new_zeros((pad, H), dtype=torch.float32)])
    ids = torch.cat([ids, ids.new_full((pad, k), sentinel)])
    w = torch.cat([weights.float(), weights.new_zeros((pad, k), dtype=torch.float32)])
    q, s = quant_act_ref(x)
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8), ids.view(torch.uint8),
                      w.view(torch.uint8)], dim=1)
