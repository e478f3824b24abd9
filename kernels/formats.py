"""Byte layouts of the cached rows, as plain torch (the definition every kernel is tested against).

fp8_ds_mla row (docs/kv-formats.md, "The MLA row"), for a latent of R values (R = 512 for GLM-5.x) and rope of P
values (64):

    bytes [0, R)                 latent, fp8 e4m3, one value per byte
    bytes [R, R + 4·R/128)       one fp32 scale per 128-value tile, scale = 2^ceil(log2(max(amax/448, 1e-4)))
    bytes [.., + 2·P)            rope values, bf16, stored as is (not quantised)

GLM-5.x: 512 + 16 + 128 = 656 bytes. A latent narrower than 128 (test models) is a single tile.

Indexer key: D fp8 e4m3 values and one fp32 scale (same power-of-two rule): 132 bytes for D = 128. The cache
keeps a block's keys block-major (docs/kv-formats.md, "The indexer block"): for a block of B tokens,

    bytes [0, B·D)               the B keys' values, token t at t·D (16-byte aligned rows for D = 128)
    bytes [B·D, B·(D + 4))       their B fp32 scales, token t at B·D + 4·t

still D + 4 bytes a token, in a [num_blocks, B, D + 4] tensor whose [b, t] entry is no longer token t's row.
`index_key_parts` gives (values, scales) views by token; `read_index_rows` / `write_index_rows` move a token's
logical row ([D values | scale], what `quantize_index_rows_ref` makes). An fp32 key cache (the exact mode) has
plain D-float rows and none of this.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
MIN_AMAX_SCALE = 1e-4
FP8 = torch.float8_e4m3fn


def tile_size(latent_dim: int) -> int:
    t = min(128, latent_dim)
    if latent_dim % t:
        raise ValueError(f"latent width {latent_dim} must be a multiple of 128 (or below 128) for fp8_ds_mla")
    return t


def mla_row_bytes(latent_dim: int, rope_dim: int) -> int:
    return latent_dim + 4 * (latent_dim // tile_size(latent_dim)) + 2 * rope_dim


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale so that amax/scale <= 448 (exact in fp32, no mantissa bits).

    ceil(log2(s)) is taken from the exponent bits (frexp), not from `log2`, whose fp32 rounding returns k
    for s just above 2^k; the kernels compute the same exponent with integer ops, so both agree bit for bit.
    """
    s = torch.clamp(amax.float() / FP8_MAX, min=MIN_AMAX_SCALE)
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(s), exp)


def quantize_mla_rows_ref(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """[T, R] latent + [T, P] rope (any float dtype) -> [T, row_bytes] uint8 fp8_ds_mla rows."""
    T, R = latent.shape
    t = tile_size(R)
    tiles = latent.float().reshape(T, R // t, t)
    scale = pow2_scale(tiles.abs().amax(dim=-1))  # [T, R/t]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(T, R)
    rope = k_rope.to(torch.bfloat16).contiguous()
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(T, -1),
                      rope.view(torch.uint8).reshape(T, -1)], dim=1)


def dequantize_mla_rows_ref(rows: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """[..., row_bytes] uint8 -> [..., R + P] float32 (latent dequantised, rope widened from bf16)."""
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    t = tile_size(latent_dim)
    n_tiles = latent_dim // t
    q = rows[:, :latent_dim].view(FP8).float().reshape(-1, n_tiles, t)
    scale = rows[:, latent_dim: latent_dim + 4 * n_tiles].contiguous().view(torch.float32)
    rope = rows[:, latent_dim + 4 * n_tiles: latent_dim + 4 * n_tiles + 2 * rope_dim].contiguous()
    latent = (q * scale[..., None]).reshape(-1, latent_dim)
    out = torch.cat([latent, rope.view(torch.bfloat16).float()], dim=1)
    return out.reshape(*lead, latent_dim + rope_dim)


def quantize_index_rows_ref(k: torch.Tensor) -> torch.Tensor:
    """[T, D] indexer keys -> [T, D + 4] uint8 rows (fp8 values, then the fp32 power-of-two scale)."""
    scale = pow2_scale(k.float().abs().amax(dim=-1))  # [T]
    q = (k.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8), scale[:, None].contiguous().view(torch.uint8)], dim=1)


def index_key_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a block-major uint8 key cache [..., B, D + 4] (a layer [num_blocks, B, D + 4], or the whole cache
    [num_blocks, layers, B, D + 4]): (values [..., B, D], scales [..., B, 4]) uint8, indexed by token like the
    cache. Each block's B·(D + 4) bytes must be contiguous (any block / layer strides)."""
    *lead, bs, row = cache.shape
    D = row - 4
    if cache.dtype != torch.uint8 or D <= 0 or cache.stride(-1) != 1 or cache.stride(-2) != row:
        raise ValueError(f"expected a uint8 key cache [..., block, D + 4] with contiguous blocks, got "
                         f"{cache.dtype} {tuple(cache.shape)} strides {tuple(cache.stride())}")
    outer = tuple(cache.stride()[:-2])
    off = cache.storage_offset()
    values = cache.as_strided((*lead, bs, D), (*outer, D, 1), off)
    scales = cache.as_strided((*lead, bs, 4), (*outer, 4, 1), off + bs * D)
    return values, scales


def read_index_rows(cache: torch.Tensor, blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logical rows [D values | scale] of tokens (blocks[i], tokens[i]) of a key cache -> [n, (layers,) D + 4]
    (the cache's dtype; fp32 caches are plain rows). Advanced indexing, as cache[blocks, ..., tokens, :]."""
    if cache.dtype != torch.uint8:
        return cache[blocks, ..., tokens, :]
    values, scales = index_key_parts(cache)
    return torch.cat([values[blocks, ..., tokens, :], scales[blocks, ..., tokens, :]], dim=-1)


def write_index_rows(cache: torch.Tensor, blocks: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of `read_index_rows`: rows [n, (layers,) D + 4] -> tokens (blocks[i], tokens[i])."""
    if cache.dtype != torch.uint8:
        cache[blocks, ..., tokens, :] = rows
        return
    values, scales = index_key_parts(cache)
    D = values.shape[-1]
    values[blocks, ..., tokens, :] = rows[..., :D]
    scales[blocks, ..., tokens, :] = rows[..., D:]


def index_rows_to_blocks(rows: torch.Tensor) -> torch.Tensor:
    """[num_blocks, B, D + 4] uint8 logical rows (token t's row at [b, t]) -> the same keys block-major."""
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    values, scales = index_key_parts(out)
    D = values.shape[-1]
    values.copy_(rows[..., :D])
    scales.copy_(rows[..., D:])
    return out


def dequantize_index_rows_ref(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., D + 4] uint8 -> [..., D] float32."""
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    q = rows[:, :head_dim].view(FP8).float()
    scale = rows[:, head_dim: head_dim + 4].contiguous().view(torch.float32)
    return (q * scale).reshape(*lead, head_dim)


def quantize_index_q_ref(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) fp8 queries: [T, H, D] -> (fp8 [T, H, D], fp32 scale [T, H])."""
    scale = pow2_scale(q.float().abs().amax(dim=-1))
    q8 = (q.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q8, scale
