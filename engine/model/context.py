"""Per-forward state handed to every layer: metadata, the cache, the attention backend and RoPE angles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.metadata import AttnMetadata
from engine.kv.cache import PagedKVCache


@dataclass
class ForwardContext:
    meta: AttnMetadata
    kv_cache: PagedKVCache
    backend: Any  # an attention backend (engine.attention)
    cos: torch.Tensor  # [T, rope_dim / 2] for meta.positions
    sin: torch.Tensor
