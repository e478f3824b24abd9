"""Shared inputs for the kernel tests: seeded random tensors, shuffled block tables, poisoned caches.

Every kernel test has two entry points: `*_interp` runs small sizes through Triton's interpreter on the
CPU (CI), `*_gpu` runs the same check at real sizes (H = 64, K = 2048, 128K-token caches) on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton_support import interpreting

interp = pytest.mark.skipif(not interpreting(), reason="needs Triton's interpreter (CPU-only torch or "
                                                          "TRITON_INTERPRET=1 before triton is imported)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                                           reason="needs CUDA (compiled Triton)")]

POISON_BYTE = 0xFF  # NaN in fp8 e4m3, and makes every fp32 scale NaN


def poisoned_cache(num_blocks: int, block_size: int, row: int, dtype: torch.dtype, device,
                   num_layers: int = 3, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(block-major multi-layer cache, one layer's strided view [num_blocks, block_size, row]); every byte
    is NaN, so a read of an unwritten row shows up."""
    full = torch.empty((num_blocks, num_layers, block_size, row), dtype=dtype, device=device)
    if dtype == torch.uint8:
        full.fill_(POISON_BYTE)
    else:
        full.fill_(float("nan"))
    return full, full[:, layer]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def block_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator,
                 device) -> torch.Tensor:
    """Disjoint, shuffled blocks for each request: int32 [B, max_blocks] (unused entries 0)."""
    need = [-(-s // block_size) for s in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, cache has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((len(seq_lens), max(max(need), 1)), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at: at + n].int()
        at += n
    return table.to(device)


def slots_of(table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    p = positions.long()
    return table_row.long()[p // block_size] * block_size + p % block_size


def randn(gen: torch.Generator, *shape, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def assert_attention_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                           out_rel: float = 2 / 128) -> None:
    """out within out_rel of the reference's scale per element and cosine >= 0.99999 per (row, head);
    lse within 1e-5 relative; -inf exactly where the reference has -inf; no NaN anywhere."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the kernel's output"
    o, r = out.float().flatten(0, -2), ref_out.float().flatten(0, -2)
    scale = r.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    err = ((o - r).abs() / scale).max().item()
    assert err <= out_rel, f"out differs by {err:.3g} of the row's scale (allowed {out_rel:.3g})"
    live = r.norm(dim=-1) > 0
    if live.any():
        cos = torch.nn.functional.cosine_similarity(o[live], r[live], dim=-1).min().item()
        assert cos >= 0.99999, f"cosine {cos:.7f} < 0.99999"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse -inf pattern differs"
    fin = torch.isfinite(ref_lse)
    rel = ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)).max().item() if fin.any() else 0.0
    assert rel <= 1e-5, f"lse differs by {rel:.3g} relative"
    assert torch.all(out.float()[torch.isinf(lse)] == 0), "rows with nothing selected must be 0"


def as_sets(sel: torch.Tensor) -> list[list[int]]:
    """Each row's selected positions (padding -1 dropped), sorted: top-k selections compared as sets."""
    return [sorted(x for x in row.tolist() if x >= 0) for row in sel]
