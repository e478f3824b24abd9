"""Attention backends: `torch` (the reference, CPU) and `triton` (the kernels, CUDA); one switch picks."""

from __future__ import annotations

import torch

from engine.kv.cache import KVCacheSpec

BACKENDS = ("torch", "triton")


def get_attention_backend(spec: KVCacheSpec, device: torch.device | str, name: str | None = None):
    """The backend for `device`: Triton on CUDA, torch elsewhere; `name` forces one ("triton" on CPU runs
    the kernels in Triton's interpreter: slow, for tests)."""
    name = name or ("triton" if torch.device(device).type == "cuda" else "torch")
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(spec)
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(spec)
    raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
