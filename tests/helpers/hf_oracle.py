"""Random tiny GlmMoeDsa checkpoints written by transformers itself (the independent oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

# Two deliberately different shapes. A: IndexShare via freq/offset, one dense-first layer, MoE with a
# shared expert, top-k 16 (sparse selection active). B: explicit pattern, group-limited routing, two
# dense-first layers, other widths and theta, top-k 24.
ORACLE_CONFIGS = {
    "A": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
              v_head_dim=32, qk_nope_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=16,
              first_k_dense_replace=1, index_topk_freq=2, index_skip_topk_offset=1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096),
    "B": dict(vocab_size=640, hidden_size=192, intermediate_size=384, moe_intermediate_size=96,
              num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=6, n_routed_experts=12,
              num_experts_per_tok=3, n_shared_experts=1, n_group=3, topk_group=2, kv_lora_rank=96,
              q_lora_rank=96, qk_rope_head_dim=8, v_head_dim=24, qk_nope_head_dim=24, index_topk=24,
              index_head_dim=16, index_n_heads=16, first_k_dense_replace=2, index_topk_pattern="FSFFS",
              routed_scaling_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
              max_position_embeddings=2048),
}


def write_oracle_checkpoint(name: str, out: Path, seed: int = 0) -> tuple[Path, object]:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**ORACLE_CONFIGS[name])
    model = GlmMoeDsaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises the routing bias to zeros: make it matter
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.05 * torch.randn_like(gate.e_score_correction_bias))
    model.save_pretrained(out)
    return out, model
