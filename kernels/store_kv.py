"""Writing MLA rows into paged caches and reading them back (prefill workspaces, KV export).

`kv_cache` is one layer's view, [num_blocks, block_size, row] (strided views of the block-major cache
are fine): uint8 rows of fp8_ds_mla (see `kernels.formats`) or bf16/fp32 rows of latent+rope.
"""

from __future__ import annotations

import torch

from kernels.formats import dequantize_mla_rows_ref, quantize_mla_rows_ref


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, row], got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in (torch.uint8, torch.bfloat16, torch.float32):
        raise ValueError(f"kv_cache dtype must be uint8 (fp8_ds_mla), bfloat16 or float32, got {kv_cache.dtype}")


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
