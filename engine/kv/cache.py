"""Paged KV storage: the MLA rows of every layer and the indexer keys of every full layer.

Layout is *block-major*: one block holds `block_size` tokens of **all** layers contiguously,

    mla   [num_blocks, num_mla_layers,   block_size, mla_row]     uint8 (fp8_ds_mla) or bf16/fp32 (576 wide)
    index [num_blocks, num_index_layers, block_size, index_row]   uint8 (fp8 + scale) or fp32

so exporting, importing, spilling or offloading a block is one contiguous copy per tensor (one NIXL
descriptor), while a layer's view `mla[:, l]` is an ordinary strided [num_blocks, block_size, row] tensor
for the kernels. The MTP layer's caches are the last layer of each tensor and share the block table.
Global slot of a token = block_id * block_size + offset in block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.engine import INDEXER_PRECISIONS, KV_CACHE_DTYPES
from engine.config.model_config import ModelConfig
from kernels.formats import mla_row_bytes as fp8_row_bytes

__all__ = ["INDEXER_PRECISIONS", "KV_CACHE_DTYPES", "KVCacheSpec", "PagedKVCache", "num_blocks_for_bytes"]


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything needed to size and interpret the cache tensors; derived from model + cache config."""

    block_size: int
    kv_cache_dtype: str
    indexer_precision: str
    latent_dim: int
    rope_dim: int
    index_head_dim: int
    num_mla_layers: int  # main layers (+1 when the MTP layer is served)
    num_index_layers: int  # full indexer layers (+1 for MTP)
    mla_layer_of: tuple[int, ...]  # model layer id (MTP = num_hidden_layers) -> MLA cache layer
    index_layer_of: tuple[int, ...]  # model layer id -> index cache layer, -1 for shared layers

    @classmethod
    def from_model(cls, cfg: ModelConfig, *, block_size: int = 64, kv_cache_dtype: str = "fp8_ds_mla",
                   indexer_precision: str = "fp8", with_mtp: bool = True) -> KVCacheSpec:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if indexer_precision not in INDEXER_PRECISIONS:
            raise ValueError(f"indexer_precision must be one of {INDEXER_PRECISIONS}, got {indexer_precision!r}")
        mtp = with_mtp and cfg.has_mtp
        layers = list(range(cfg.num_hidden_layers)) + ([cfg.mtp_layer_index] if mtp else [])
        full = [l for l in layers if l == cfg.mtp_layer_index or cfg.indexer_types[l] == "full"]
        index_of = [-1] * (cfg.num_hidden_layers + 1)
        for i, l in enumerate(full):
            index_of[l] = i
        return cls(block_size=block_size, kv_cache_dtype=kv_cache_dtype, indexer_precision=indexer_precision,
                   latent_dim=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, index_head_dim=cfg.index_head_dim,
                   num_mla_layers=len(layers), num_index_layers=len(full),
                   mla_layer_of=tuple(range(cfg.num_hidden_layers + 1)) if mtp else tuple(range(cfg.num_hidden_layers)),
                   index_layer_of=tuple(index_of))

    @property
    def mla_torch_dtype(self) -> torch.dtype:
        return {"fp8_ds_mla": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}[self.kv_cache_dtype]

    @property
    def mla_row(self) -> int:
        """Row width in elements of `mla_torch_dtype` (bytes for fp8_ds_mla)."""
        if self.kv_cache_dtype == "fp8_ds_mla":
            return _mla_bytes(self)
        return self.latent_dim + self.rope_dim

    @property
    def index_torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.indexer_precision == "fp8" else torch.float32

    @property
    def index_row(self) -> int:
        return self.index_head_dim + 4 if self.indexer_precision == "fp8" else self.index_head_dim

    @property
    def index_key_layout(self) -> str:
        """How keys sit in an index block: fp8 keys block-major (a block's values, then its scales;
        kernels.formats), fp32 keys as rows. Peers of a KV transfer compare it (an engine that stored 132-byte
        rows has the same sizes and would read keys wrongly)."""
        return "block-major" if self.indexer_precision == "fp8" else "rows"

    @property
    def mla_block_bytes(self) -> int:
        return self.num_mla_layers * self.block_size * self.mla_row * self.mla_torch_dtype.itemsize

    @property
    def index_block_bytes(self) -> int:
        return self.num_index_layers * self.block_size * self.index_row * self.index_torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.mla_block_bytes + self.index_block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size


def _mla_bytes(spec: KVCacheSpec) -> int:
    return fp8_row_bytes(spec.latent_dim, spec.rope_dim)


class PagedKVCache:
    """Owns the two cache tensors of one engine (one rank). Blocks are handed out by the KV manager."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str, *,
                 pin_memory: bool = False, fill: float | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self.mla = torch.empty((num_blocks, spec.num_mla_layers, spec.block_size, spec.mla_row),
                               dtype=spec.mla_torch_dtype, device=self.device, pin_memory=pin)
        self.index = torch.empty((num_blocks, max(spec.num_index_layers, 1), spec.block_size, spec.index_row),
                                 dtype=spec.index_torch_dtype, device=self.device, pin_memory=pin)
        if fill is not None:  # tests poison unused pages so a read of an unwritten row shows up
            _poison(self.mla, fill)
            _poison(self.index, fill)

    def mla_layer(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, mla_row] strided view of one model layer's MLA rows."""
        return self.mla[:, self.spec.mla_layer_of[layer]]

    def index_layer(self, layer: int) -> torch.Tensor:
        i = self.spec.index_layer_of[layer]
        if i < 0:
            raise ValueError(f"layer {layer} shares its indexer and has no key cache of its own")
        return self.index[:, i]

    @property
    def nbytes(self) -> int:
        return self.mla.numel() * self.mla.element_size() + self.index.numel() * self.index.element_size()


def _poison(t: torch.Tensor, fill: float) -> None:
    if t.dtype == torch.uint8:
        t.fill_(0xFF)  # 0xFF is NaN in fp8 e4m3 and makes every fp32 scale NaN
    else:
        t.fill_(fill)


def num_blocks_for_bytes(spec: KVCacheSpec, budget_bytes: int) -> int:
    return max(int(budget_bytes // spec.block_bytes), 0)

