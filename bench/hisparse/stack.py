"""The pieces `bench.hisparse` runs: a real-dimension decode layer stack with random weights, a synthetic
top-k stream with controlled temporal locality, and the three KV setups (resident, HiSparse, offload-only).

Context layout (host blocks, which are also the resident cache's device blocks): every request shares one
prefix of `context - 1` tokens and owns its last pages, like agentic sessions on a common prefix. Host
memory stays at one context while every request still moves its own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.metadata import AttnMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config.engine import CacheConfig, EngineConfig, HiSparseConfig, SchedulerConfig
from engine.config.model_config import ModelConfig
from engine.config.presets import preset
from engine.hisparse import HiSparseManager
from engine.kv.cache import KVCacheSpec, PagedKVCache
from kernels.formats import index_rows_to_blocks, quantize_index_rows_ref, quantize_mla_rows_ref
from kernels.sparse_mla import sparse_mla_ref


def stack_config(name: str, num_layers: int) -> ModelConfig:
    """`name` preset dims, `num_layers` layers with a full indexer every 4th (IndexShare), no MTP."""
    types = ["full" if i % 4 == 0 else "shared" for i in range(num_layers)]
    return preset(name, num_hidden_layers=num_layers, indexer_types=types, num_nextn_predict_layers=0,
                  max_position_embeddings=1 << 22)


class GatherTorchBackend(TorchAttentionBackend):
    """The torch reference reading only the selected rows (not whole contexts): runs on a GPU at 1M tokens
    when the Triton backend is not available."""

    name = "torch-gather"

    def sparse_mla(self, cache, layer, q, topk_pos, meta, sm_scale):
        p = topk_pos.long()
        bs = meta.block_size
        blocks = meta.block_table[meta.token_req_idx.long()[:, None], p.clamp(min=0) // bs].long()
        slots = torch.where(p >= 0, blocks * bs + p % bs, torch.full_like(p, -1)).to(torch.int32)
        return sparse_mla_ref(q, cache.mla_layer(layer), slots, sm_scale, self.spec.latent_dim, self.spec.rope_dim)


def inner_backend(spec: KVCacheSpec, device: torch.device):
    if device.type == "cuda":
        try:
            from engine.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(spec)
        except ImportError:
            pass
    return GatherTorchBackend(spec)


class DenseStack:
    """The attention projections (absorbed MLA) and a dense MLP of one layer; weights shared by every layer
    of the stack (their cost per layer is the same; memory stays small)."""

    def __init__(self, cfg: ModelConfig, mlp_width: int, device, dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        H, R, P = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim

        def w(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-2] if len(shape) > 1 else 1)).to(device, dtype)

        self.H, self.R, self.P, self.nope, self.v = H, R, P, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.q_a = w(cfg.hidden_size, cfg.q_lora_rank)
        self.q_b = w(cfg.q_lora_rank, H * (self.nope + P))
        self.kv_a = w(cfg.hidden_size, R + P)
        self.w_uk = w(H, self.nope, R)
        self.w_uv = w(H, R, self.v)
        self.o = w(H * self.v, cfg.hidden_size)
        self.mlp_width = mlp_width
        if mlp_width:
            self.w13 = w(cfg.hidden_size, 2 * mlp_width)
            self.w2 = w(mlp_width, cfg.hidden_size)

    def qkv(self, x: torch.Tensor):
        B = x.shape[0]
        q = ((x @ self.q_a) @ self.q_b).view(B, self.H, self.nope + self.P)
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., : self.nope], self.w_uk)
        kv = x @ self.kv_a
        return torch.cat([q_lat, q[..., self.nope:]], -1), kv[:, : self.R], kv[:, self.R:]

    def finish(self, x: torch.Tensor, out_lat: torch.Tensor) -> torch.Tensor:
        o = torch.einsum("bhr,hrv->bhv", out_lat.to(x.dtype), self.w_uv).flatten(1) @ self.o
        if self.mlp_width:
            gate, up = (x @ self.w13).chunk(2, dim=-1)
            o = o + (torch.nn.functional.silu(gate) * up) @ self.w2
        return o


class TopkStream:
    """Per request, `K` selected positions; each step a `churn` fraction is replaced by fresh uniform
    positions of the context and the newest position is always selected (as a real indexer does)."""

    def __init__(self, batch: int, K: int, churn: float, device, seed: int):
        self.B, self.K, self.churn = batch, K, churn
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.sel: torch.Tensor | None = None

    def next(self, seq_lens: torch.Tensor) -> torch.Tensor:
        S = seq_lens.long()[:, None]
        dev = seq_lens.device
        fresh = (torch.rand((self.B, self.K), generator=self.g, device=dev) * (S - 1)).long()
        if self.sel is None:
            self.sel = fresh
        else:
            swap = torch.rand((self.B, self.K), generator=self.g, device=dev) < self.churn
            self.sel = torch.where(swap, fresh, self.sel)
        self.sel[:, -1] = S[:, 0] - 1
        return self.sel.to(torch.int32)


@dataclass
class Contexts:
    """Block ids of B requests sharing a prefix of `context - 1` tokens, each with its own last pages."""

    context: int
    batch: int
    steps: int
    block_size: int = 64

    @property
    def shared_pages(self) -> int:
        return (self.context - 1) // self.block_size

    @property
    def own_pages(self) -> int:
        return -(-(self.context + self.steps) // self.block_size) - self.shared_pages

    @property
    def num_blocks(self) -> int:
        return self.shared_pages + self.batch * self.own_pages

    def block_ids(self, b: int) -> list[int]:
        """Request b's block list; the same list object every step (as the runner keeps one per request:
        rebuilding a 16K-entry list per request per step would be benchmark overhead, not HiSparse's)."""
        cache = self.__dict__.setdefault("_ids", {})
        if b not in cache:
            own = self.shared_pages + b * self.own_pages
            cache[b] = list(range(self.shared_pages)) + list(range(own, own + self.own_pages))
        return cache[b]

    def table(self, device) -> torch.Tensor:
        return torch.tensor([self.block_ids(b) for b in range(self.batch)], dtype=torch.int32).to(device)


def decode_meta(table: torch.Tensor, seq_len: int, req_ids: list[str], block_size: int = 64) -> AttnMetadata:
    """One decode row per request at position seq_len - 1 (its slot from the block table)."""
    B, dev = table.shape[0], table.device
    pos = torch.full((B,), seq_len - 1, dtype=torch.int64, device=dev)
    slot = table[:, (seq_len - 1) // block_size].long() * block_size + (seq_len - 1) % block_size
    meta = AttnMetadata(positions=pos, slot_mapping=slot,
                        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
                        seq_lens=torch.full((B,), seq_len, dtype=torch.int32, device=dev), block_table=table,
                        token_req_idx=torch.arange(B, dtype=torch.int32, device=dev),
                        query_start_loc_cpu=list(range(B + 1)), seq_lens_cpu=[seq_len] * B, block_size=block_size)
    meta.req_ids = list(req_ids)
    return meta


def fill_pages(mla: torch.Tensor, index: torch.Tensor | None, spec: KVCacheSpec, seed: int = 0) -> None:
    """Valid fp8_ds_mla rows (and indexer keys) in every block: one random page broadcast (fast at 1M)."""
    g = torch.Generator().manual_seed(seed)
    L, bs = spec.num_mla_layers, spec.block_size
    lat = torch.randn(L * bs, spec.latent_dim, generator=g)
    rope = torch.randn(L * bs, spec.rope_dim, generator=g)
    page = quantize_mla_rows_ref(lat, rope).view(L, bs, -1) if spec.kv_cache_dtype == "fp8_ds_mla" \
        else torch.cat([lat, rope], -1).view(L, bs, -1).to(spec.mla_torch_dtype)
    mla.copy_(page.to(mla.device).expand_as(mla))
    if index is not None and spec.indexer_precision == "fp8":
        keys = quantize_index_rows_ref(torch.randn(index.shape[1] * bs, spec.index_head_dim, generator=g))
        block = index_rows_to_blocks(keys.view(index.shape[1], bs, -1))  # one block per index layer, block-major
        index.copy_(block.to(index.device).expand_as(index))


def hisparse_manager(cfg: ModelConfig, spec: KVCacheSpec, ctx: Contexts, device, offload_only: bool,
                     hot_pages_each: int = 0) -> HiSparseManager:
    """A HiSparse manager whose device pool holds only the hot buffers (+ `hot_pages_each` spare pages per
    request): every request decodes from the host pool."""
    hs = HiSparseConfig(host_pool_blocks=ctx.num_blocks, offload_only=offload_only)
    layout_blocks = -(-(2 * cfg.index_topk + 1) // spec.block_size)
    num_dev = 1 if offload_only else ctx.batch * (layout_blocks + hot_pages_each)
    ecfg = EngineConfig(model_path=Path("."), model=cfg,
                        cache=CacheConfig(num_blocks=num_dev, kv_cache_dtype=spec.kv_cache_dtype,
                                          indexer_precision=spec.indexer_precision),
                        scheduler=SchedulerConfig(max_model_len=ctx.context + ctx.steps + 64, max_num_seqs=ctx.batch,
                                                  max_num_batched_tokens=max(ctx.batch, 8192)),
                        hisparse=hs, device=str(device))
    return HiSparseManager(ecfg, spec, torch.device(device), num_dev, assemble=False)


def resident_cache(spec: KVCacheSpec, ctx: Contexts, device) -> PagedKVCache:
    return PagedKVCache(spec, ctx.num_blocks, device)


def place(mgr: HiSparseManager, ctx: Contexts, seq_len: int) -> None:
    """Register / advance the requests in the residency (what begin_step does from scheduler diffs)."""
    mgr.place([], [(f"r{b}", ctx.block_ids(b), seq_len - 1) for b in range(ctx.batch)])

