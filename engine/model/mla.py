"""MLA with the DSA lightning indexer, in the absorbed ("MQA") form over the paged cache.

Per token the cache holds c = [latent (R) ; k_rope (P)], one KV head shared by all H query heads:

    q_lat_h = W_UK_h^T q_nope_h                 (W_UK_h: the first qk_nope rows of head h in kv_b_proj)
    z_h,t   = scale * ([q_lat_h ; q_rope_h] . c_t)   over the indexer's selection of t <= s
    o_h     = W_UV_h (sum_t softmax(z_h)_t latent_t)  then o_proj
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model_config import ModelConfig
from engine.model.context import ForwardContext
from engine.model.fp8 import Fp8Linear
from engine.model.layers import RMSNorm, apply_rope
from engine.model.projections import project
from kernels.fp8_absorbed import ABSORBED_MAX_ROWS, absorbed_matmul, absorbed_weights
from kernels.rope import rope, rope_cat, rope_fits


class Indexer(nn.Module):
    """Scores past tokens per query: I[s, t] = sum_h w_h * ReLU(q_h . k_t / sqrt(D)); keeps the top-k."""

    fused = False  # RoPE as one launch, in place (kernels.rope; set by engine.loading.loader.use_kernels)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, layer: int, ctx: ForwardContext,
                q: torch.Tensor | None = None, k: torch.Tensor | None = None) -> torch.Tensor:
        """q / k: wq_b(q_resid) and wk(x) when the caller computed them (with its own projections of the same
        inputs: engine.model.projections)."""
        T = x.shape[0]
        q = (self.wq_b(q_resid) if q is None else q).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x) if k is None else k)
        r = self.rope_dim  # layout per head: [rope | rest]
        if self.fused and rope_fits(r):  # q and k are this forward's own tensors: rotated where they lie
            rope(q, ctx.cos, ctx.sin, self.interleave, rope_dim=r, out=q)
            rope(k, ctx.cos, ctx.sin, self.interleave, rope_dim=r, out=k)
        else:
            q = torch.cat([apply_rope(q[..., :r], ctx.cos, ctx.sin, self.interleave), q[..., r:]], dim=-1)
            k = torch.cat([apply_rope(k[..., :r], ctx.cos, ctx.sin, self.interleave), k[..., r:]], dim=-1)
        ctx.backend.store_index_k(ctx.kv_cache, layer, k, ctx.meta)
        # weights carry 1/sqrt(H) (the model's) and 1/sqrt(D) (the score scale): both positive, so they
        # fold through the ReLU and the kernels need not know them.
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        w = w * (self.n_heads ** -0.5) * (self.head_dim ** -0.5)
        return ctx.backend.indexer_topk(ctx.kv_cache, layer, q.float(), w, ctx.meta, self.topk)


class MLAttention(nn.Module):
    fused = False  # RoPE, and RoPE with the query's concatenation, as one launch each (kernels.rope)
    # a class switch (on): with the fused kernels, at decode sizes, the absorbed matmuls read an FP8 kv_b_proj's
    # rows in place (kernels.fp8_absorbed.absorbed_matmul) instead of a dequantized copy
    absorbed_in_place = True

    def __init__(self, cfg: ModelConfig, layer_id: int, has_indexer: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        H = self.num_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.q_lora_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.latent + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.kv_lora_norm_eps)
        self.kv_b_proj = nn.Linear(self.latent, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg) if has_indexer else None

    def projection_groups(self) -> list[list[nn.Module | None]]:
        """The projections of one input each, which `project` runs as one GEMM once packed
        (engine.model.projections.pack_projections): x's (q_a_proj, the indexer's wk, kv_a_proj_with_mqa) and the
        query residual's (q_b_proj, the indexer's wq_b)."""
        idx = self.indexer
        return [[self.q_a_proj, idx.wk if idx is not None else None, self.kv_a_proj_with_mqa],
                [self.q_b_proj, idx.wq_b if idx is not None else None]]

    def _absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj: W_UK [H, nope, R] and W_UV [H, v, R] (no copies); an FP8 kv_b_proj is
        dequantized to `dtype` for this forward (kernels.fp8_absorbed; engine/model/fp8.py says why)."""
        if isinstance(self.kv_b_proj, Fp8Linear):
            return absorbed_weights(self.kv_b_proj.weight, self.kv_b_proj.weight_scale_inv, self.num_heads,
                                    self.nope, dtype)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, prev_topk: torch.Tensor | None,
                x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x_quant: x's FP8 codes and scales made with x (RMSNorm.forward_quant); the query residual's norm then
        quantizes its output too."""
        T = x.shape[0]
        idx = self.indexer
        # each input read (and quantized) once: one GEMM per pack (engine.model.projections)
        q_a, idx_k, kv = project(x, self.q_a_proj, idx.wk if idx else None, self.kv_a_proj_with_mqa, x_quant=x_quant)
        if x_quant is not None:
            q_resid, _, q_quant = self.q_a_layernorm.forward_quant(q_a)
        else:
            q_resid, q_quant = self.q_a_layernorm(q_a), None
        q, idx_q = project(q_resid, self.q_b_proj, idx.wq_b if idx else None, x_quant=q_quant)
        q = q.view(T, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        latent = self.kv_a_layernorm(kv[:, : self.latent])
        fused = self.fused and self.interleave and rope_fits(self.rope)
        k_pe = (rope if fused else apply_rope)(kv[:, self.latent:], ctx.cos, ctx.sin, self.interleave)
        if not fused:
            q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, self.interleave)
        ctx.backend.store_kv(ctx.kv_cache, self.layer_id, latent, k_pe, ctx.meta)

        if self.indexer is not None:
            topk = self.indexer(x, q_resid, self.layer_id, ctx, q=idx_q, k=idx_k)
        elif prev_topk is None:
            raise RuntimeError(f"layer {self.layer_id} shares its indexer but no earlier layer produced a top-k")
        else:
            topk = prev_topk

        kv_b = self.kv_b_proj
        in_place = (self.absorbed_in_place and self.fused and isinstance(kv_b, Fp8Linear) and T <= ABSORBED_MAX_ROWS
                    and x.dtype == torch.bfloat16)
        if in_place:
            q_lat = absorbed_matmul(q_nope, kv_b.weight, kv_b.weight_scale_inv, self.num_heads, self.nope, "uk")
        else:
            w_uk, w_uv = self._absorbed(x.dtype)
            q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_full = rope_cat(q_lat, q_pe, ctx.cos, ctx.sin) if fused else torch.cat([q_lat, q_pe], dim=-1)
        out_lat, _ = ctx.backend.sparse_mla(ctx.kv_cache, self.layer_id, q_full, topk, ctx.meta, self.scale)
        if in_place:
            o = absorbed_matmul(out_lat.to(x.dtype), kv_b.weight, kv_b.weight_scale_inv, self.num_heads, self.nope,
                                "uv")
        else:
            o = torch.einsum("thr,hvr->thv", out_lat.to(x.dtype), w_uv)
        return self.o_proj(o.reshape(T, self.num_heads * self.v_dim)), topk
