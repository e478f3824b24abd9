"""GLM-5.x DSA causal LM: embeddings -> decoder layers (MLA + DSA, dense MLP or MoE) -> norm -> lm_head.

Module names mirror the HF checkpoint (`model.layers.{i}.self_attn.q_a_proj`, ...) so loading is a
rename only for experts and the MTP layer (see engine/loading/weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model_config import ModelConfig
from engine.model.context import ForwardContext
from engine.model.fp8 import Fp8Linear
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.mla import MLAttention
from engine.model.moe import MoE
from kernels.fp8_gemm import DECODE_MAX_M


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, has_indexer: bool, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id, has_indexer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, prev_topk: torch.Tensor | None,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream is x, or x + delta (the last layer's MLP output, added here inside the input norm's
        launch: one launch fewer a layer). Returns (the stream before this layer's MLP output, that output, the
        top-k): the next layer, or the final norm, adds them."""
        if self._quantizes(x):  # each norm's launch also quantizes its output for the FP8 projections after it
            h, s, h_quant = self.input_layernorm.forward_quant(x, delta)
            x = x if s is None else s
            attn, topk = self.self_attn(h, ctx, prev_topk, x_quant=h_quant)
            h, x, h_quant = self.post_attention_layernorm.forward_quant(attn, x)
            return x, self.mlp(h, h_quant), topk
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.forward_add(delta, x)  # x + delta, then its norm
        attn, topk = self.self_attn(h, ctx, prev_topk)
        h, x = self.post_attention_layernorm.forward_add(attn, x)  # x + attn, then its norm
        return x, self.mlp(h), topk

    def _quantizes(self, x: torch.Tensor) -> bool:
        """RMSNorm.quantize applies: fused norms, FP8 attention projections, decode-sized batches (the Triton
        GEMMs, which take the norm's codes; cuBLAS at prefill sizes lays its scales out its own way)."""
        return (RMSNorm.quantize and self.input_layernorm.fused and x.shape[0] <= DECODE_MAX_M
                and isinstance(self.self_attn.q_a_proj, Fp8Linear))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, has_indexer=cfg.indexer_types[i] == "full", moe=cfg.mlp_layer_types[i] == "sparse")
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """u = eh_proj([enorm(embed(next token)) ; hnorm(h)]) -> one DSA decoder layer -> shared_head.norm.

    Its own MLA and indexer caches are the last layer of the cache tensors (layer id = num_hidden_layers).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg, cfg.mtp_layer_index, has_indexer=True, moe=cfg.n_routed_experts > 0)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        u = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        x, delta, _ = self.layer(u, ctx, None)
        return self.shared_head.norm.forward_add(delta, x)[0]


class GlmDsaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, with_mtp: bool = True):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPLayer(cfg) if with_mtp and cfg.has_mtp else None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        topk = delta = None
        for layer in self.model.layers:
            x, delta, topk = layer(x, ctx, topk, delta)
        return self.model.norm(x) if delta is None else self.model.norm.forward_add(delta, x)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_forward(self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Draft hidden for the token after `next_ids` (post shared_head.norm; logits via compute_logits)."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its MTP layer (num_nextn_predict_layers = 0?)")
        return self.mtp(self.model.embed_tokens(next_ids), prev_hidden, ctx)

    def num_parameters(self, include_mtp: bool = False) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if include_mtp or not n.startswith("mtp."))
