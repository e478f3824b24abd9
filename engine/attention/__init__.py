"""Attention backends: one switch between the plain-torch reference and the Triton kernels."""

from __future__ import annotations

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kv.cache import KVCacheSpec

BACKENDS = ("torch", "triton")


def get_attention_backend(spec: KVCacheSpec, device: torch.device | str, name: str | None = None):
    """`name` None/"auto": Triton on CUDA, the torch reference elsewhere."""
    device = torch.device(device)
    if name in (None, "auto"):
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend(spec)
    if name == "triton":
        return TritonAttentionBackend(spec)
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
