"""Writing MLA rows into paged caches and reading them back (prefill workspaces, KV export).

`kv_cache` is one layer's view, [num_blocks, block_size, row] (strided views of the block-major cache
are fine): uint8 rows of fp8_ds_mla (see `kernels.formats`) or bf16/fp32 rows of latent+rope.

The store kernel also writes the indexer key cache (`kernels.indexer`): a key is an fp8_ds_mla row with one
tile of D values and no rope, placed block-major (`BLOCKED`: a block's values, then its scales;
`kernels.formats`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import dequantize_mla_rows_ref, quantize_mla_rows_ref, tile_size
from kernels.triton_support import check_device, interpreting, jit, to_bf16, to_e4m3

_ROWS_PER_PROGRAM = 16  # H200 sweep: 4 -> 62%, 8 -> 68%, 16 -> 69%, 32 -> 65% of copy bandwidth


# a row count per step, and slots that may start anywhere in a per-step buffer: one compiled variant for all
# (kernels/jit_variants.py)
@jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["slot_ptr"])
def _store_rows_kernel(lat_ptr, rope_ptr, slot_ptr, cache_ptr, scale_ptr, rope_out_ptr, num_rows,
                       stride_lat, stride_rope, stride_blk, stride_tok,
                       BLOCK_SIZE: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, P: tl.constexpr,
                       QUANT: tl.constexpr, BLOCK_T: tl.constexpr, ROUND_FIRST: tl.constexpr,
                       BLOCKED: tl.constexpr = False):
    """Rows t of `lat` [T, R] (+ `rope` [T, P]) -> cache slot slot_ptr[t]; slot -1 is skipped.

    QUANT: cache/scale/rope_out are uint8/fp32/bf16 views of one byte buffer and strides count bytes;
    else cache is the row dtype (bf16/fp32) and strides count elements. BLOCKED (QUANT, no rope): the block's
    values at token * R, its scales after all BLOCK_SIZE of them (the indexer key block).
    """
    NT: tl.constexpr = R // TILE
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    ok = slot >= 0
    if BLOCKED:
        blk = (slot // BLOCK_SIZE) * stride_blk
        base = blk + (slot % BLOCK_SIZE) * R  # [BLOCK_T]
        scale_at = blk + BLOCK_SIZE * R + (slot % BLOCK_SIZE) * (4 * NT)  # bytes
    else:
        base = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok  # [BLOCK_T]
        scale_at = base + R
    cols = tl.arange(0, NT)[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [NT, TILE]
    x = tl.load(lat_ptr + rows.to(tl.int64)[:, None, None] * stride_lat + cols[None], mask=ok[:, None, None])
    x = x.to(tl.float32)
    if QUANT:
        # scale = 2^ceil(log2(max(amax / 448, 1e-4))) from the exponent bits (bit-exact with formats.pow2_scale)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=2), 448.0), 1e-4)  # [BLOCK_T, NT]
        bits = s.to(tl.int32, bitcast=True)
        field = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (field << 23).to(tl.float32, bitcast=True)
        inv = ((254 - field) << 23).to(tl.float32, bitcast=True)  # exact 1/scale
        q = to_e4m3(tl.clamp(x * inv[:, :, None], -448.0, 448.0), ROUND_FIRST)
        tl.store(cache_ptr + base[:, None, None] + cols[None], q, mask=ok[:, None, None])
        tl.store(scale_ptr + scale_at[:, None] // 4 + tl.arange(0, NT)[None, :], scale, mask=ok[:, None])
        if P > 0:
            r = tl.load(rope_ptr + rows.to(tl.int64)[:, None] * stride_rope + tl.arange(0, P)[None, :],
                        mask=ok[:, None])
            tl.store(rope_out_ptr + (base[:, None] + R + 4 * NT) // 2 + tl.arange(0, P)[None, :],
                     to_bf16(r.to(tl.float32), ROUND_FIRST), mask=ok[:, None])
    else:
        dst = cache_ptr + base[:, None, None] + cols[None]
        if cache_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(dst, to_bf16(x, ROUND_FIRST), mask=ok[:, None, None])
        else:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=ok[:, None, None])
        if P > 0:
            r = tl.load(rope_ptr + rows.to(tl.int64)[:, None] * stride_rope + tl.arange(0, P)[None, :],
                        mask=ok[:, None])
            r = r.to(tl.float32)
            if cache_ptr.dtype.element_ty == tl.bfloat16:
                r = to_bf16(r, ROUND_FIRST)
            tl.store(cache_ptr + base[:, None] + R + tl.arange(0, P)[None, :],
                     r.to(cache_ptr.dtype.element_ty), mask=ok[:, None])


@jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["slot_ptr"])  # as the store's
def _gather_rows_kernel(cache_ptr, scale_ptr, rope_ptr, slot_ptr, out_ptr, num_rows, stride_out,
                        stride_blk, stride_tok,
                        BLOCK_SIZE: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, P: tl.constexpr,
                        QUANT: tl.constexpr, BLOCK_T: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """out[i] = dequantised row at slot_ptr[i] ([R + P] values in out's dtype); slot -1 gives zeros."""
    NT: tl.constexpr = R // TILE
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = rows < num_rows
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    ok = slot >= 0
    base = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok
    cols = tl.arange(0, NT)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    out_row = out_ptr + rows.to(tl.int64) * stride_out
    x = tl.load(cache_ptr + base[:, None, None] + cols[None], mask=ok[:, None, None], other=0)
    if QUANT:
        sc = tl.load(scale_ptr + (base[:, None] + R) // 4 + tl.arange(0, NT)[None, :], mask=ok[:, None], other=0.0)
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:  # exact for fp8 rows; rounds fp32 rows
        x = to_bf16(x.to(tl.float32), ROUND_FIRST)
    tl.store(out_row[:, None, None] + cols[None], x.to(out_ptr.dtype.element_ty), mask=in_range[:, None, None])
    if P > 0:
        if QUANT:
            r = tl.load(rope_ptr + (base[:, None] + R + 4 * NT) // 2 + tl.arange(0, P)[None, :],
                        mask=ok[:, None], other=0.0)
        else:
            r = tl.load(cache_ptr + base[:, None] + R + tl.arange(0, P)[None, :], mask=ok[:, None], other=0.0)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            r = to_bf16(r.to(tl.float32), ROUND_FIRST)
        tl.store(out_row[:, None] + R + tl.arange(0, P)[None, :], r.to(out_ptr.dtype.element_ty),
                 mask=in_range[:, None])


# ---- launchers --------------------------------------------------------------------------------------

def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, row], got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in (torch.uint8, torch.bfloat16, torch.float32):
        raise ValueError(f"kv_cache dtype must be uint8 (fp8_ds_mla), bfloat16 or float32, got {kv_cache.dtype}")


def _pow2(name: str, n: int) -> None:
    if n & (n - 1):
        raise ValueError(f"{name} = {n} must be a power of two for the Triton kernels (use the *_ref functions)")


def cache_views(cache: torch.Tensor, latent_dim: int, rope_dim: int, tile: int) -> tuple:
    """(element pointer views, block stride, token stride) of a paged cache layer view.

    fp8 rows are read through uint8, fp32 (scales) and bf16 (rope) views of the same bytes; their
    offsets are computed in bytes, so every row and block must start on a 4-byte boundary.
    """
    _check_cache(cache)
    if cache.stride(2) != 1:
        raise ValueError("the cache rows must be contiguous (stride 1 along the row)")
    sb, st = cache.stride(0), cache.stride(1)
    if cache.dtype != torch.uint8:
        if cache.shape[2] != latent_dim + rope_dim:
            raise ValueError(f"cache row {cache.shape[2]} != latent {latent_dim} + rope {rope_dim}")
        return (cache, cache, cache), sb, st
    row = latent_dim + 4 * (latent_dim // tile) + 2 * rope_dim
    if cache.shape[2] != row:
        raise ValueError(f"fp8 cache row is {cache.shape[2]} bytes, expected {row} for latent {latent_dim}, "
                         f"rope {rope_dim}")
    if sb % 4 or st % 4 or cache.data_ptr() % 16:
        raise ValueError("fp8 cache blocks and rows must start on 4-byte boundaries (row width a multiple of 4)")
    span = sb * (cache.shape[0] - 1) + st * (cache.shape[1] - 1) + row  # bytes from the first row to the end
    flat = cache.as_strided((span,), (1,))
    return (flat, flat.view(torch.float32), flat.view(torch.bfloat16)), sb, st


def store_rows(values: torch.Tensor, rope: torch.Tensor | None, cache: torch.Tensor, slot_mapping: torch.Tensor,
               tile: int, rows_per_program: int = _ROWS_PER_PROGRAM, blocked: bool = False) -> None:
    """values [T, R] (+ rope [T, P]) -> cache rows at slot_mapping [T] (fp8 with one scale per `tile` values
    when the cache is uint8; a plain cast otherwise). `blocked`: a uint8 cache without rope whose blocks are
    block-major (the indexer key block, `kernels.formats.index_key_parts`)."""
    T, R = values.shape
    P = 0 if rope is None else rope.shape[1]
    if slot_mapping.shape != (T,) or (rope is not None and rope.shape[0] != T):
        raise ValueError(f"values {tuple(values.shape)}, rope and slot_mapping {tuple(slot_mapping.shape)} "
                         "must have the same number of rows")
    if T == 0:
        return
    for name, n in (("latent width", R), ("tile", tile), ("rope width", max(P, 1))):
        _pow2(name, n)
    if values.stride(1) != 1 or (rope is not None and rope.stride(1) != 1):
        raise ValueError("latent/rope rows must be contiguous along the last dim (call .contiguous())")
    check_device(values, slot_mapping, cache, *(() if rope is None else (rope,)))
    (c8, c32, c16), sb, st = cache_views(cache, R, P, tile)
    if blocked and (cache.dtype != torch.uint8 or P or st != cache.shape[2]):
        raise ValueError(f"a block-major cache is uint8 with contiguous blocks and no rope, got {cache.dtype} "
                         f"strides {tuple(cache.stride())}, rope width {P}")
    rope_arg = values if rope is None else rope
    grid = (triton.cdiv(T, rows_per_program),)
    _store_rows_kernel[grid](
        values, rope_arg, slot_mapping, c8, c32, c16, T, values.stride(0), rope_arg.stride(0), sb, st,
        BLOCK_SIZE=cache.shape[1], R=R, TILE=tile if cache.dtype == torch.uint8 else R, P=P,
        QUANT=cache.dtype == torch.uint8, BLOCK_T=rows_per_program, ROUND_FIRST=interpreting(), BLOCKED=blocked)


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, rope_dim: int, tile: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = slots.shape[0]
    out = torch.empty((n, latent_dim + rope_dim), dtype=out_dtype, device=cache.device)
    if n == 0:
        return out
    for name, v in (("latent width", latent_dim), ("tile", tile), ("rope width", max(rope_dim, 1))):
        _pow2(name, v)
    check_device(cache, slots)
    (c8, c32, c16), sb, st = cache_views(cache, latent_dim, rope_dim, tile)
    quant = cache.dtype == torch.uint8
    _gather_rows_kernel[(triton.cdiv(n, _ROWS_PER_PROGRAM),)](
        c8, c32, c16, slots, out, n, out.stride(0), sb, st, BLOCK_SIZE=cache.shape[1],
        R=latent_dim, TILE=tile if quant else latent_dim, P=rope_dim, QUANT=quant, BLOCK_T=_ROWS_PER_PROGRAM,
        ROUND_FIRST=interpreting())
    return out


def store_kv(latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton `store_kv_ref`: latent [T, R], k_rope [T, P] -> rows at slot_mapping [T] int64 (-1 skipped).

    fp8_ds_mla caches get bit-identical bytes to the reference; bf16/fp32 caches a round-to-nearest cast.
    """
    _check_cache(kv_cache)
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    store_rows(latent, k_rope, kv_cache, slot_mapping, tile_size(latent.shape[1]))


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, rope_dim: int,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton `gather_kv_ref`: rows at `slots` [n] -> [n, R + P] dequantised (exact in fp32 and bf16:
    an fp8 value times a power of two fits both). A slot of -1 gives a zero row."""
    _check_cache(kv_cache)
    return gather_rows(kv_cache, slots, latent_dim, rope_dim, tile_size(latent_dim), out_dtype)


# ---- references -------------------------------------------------------------------------------------

def store_kv_ref(latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """latent [T, R], k_rope [T, P] -> rows at `slot_mapping` [T] int64 (slot -1: not written)."""
    _check_cache(kv_cache)
    if latent.shape[0] != k_rope.shape[0] or latent.shape[0] != slot_mapping.shape[0]:
        raise ValueError("latent, k_rope and slot_mapping must have the same number of rows")
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep]
    bs = kv_cache.shape[1]
    if kv_cache.dtype == torch.uint8:
        rows = quantize_mla_rows_ref(latent[keep], k_rope[keep])
    else:
        rows = torch.cat([latent[keep], k_rope[keep]], dim=1).to(kv_cache.dtype)
    if rows.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"row width {rows.shape[1]} does not match the cache row {kv_cache.shape[2]}")
    kv_cache[slots // bs, slots % bs] = rows


def gather_kv_ref(kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """Rows at `slots` [n] (all valid) -> [n, R + P] float32, dequantised."""
    _check_cache(kv_cache)
    bs = kv_cache.shape[1]
    slots = slots.long()
    rows = kv_cache[slots // bs, slots % bs]
    if kv_cache.dtype == torch.uint8:
        return dequantize_mla_rows_ref(rows, latent_dim, rope_dim)
    return rows.float()
