"""Named model shapes: `glm-5.3` (the served model, for memory math on `meta`), `glm-5.3-fp8` (the same as
its FP8 checkpoint declares itself) and `tiny` (tests, demo)."""

from __future__ import annotations

from typing import Any

from engine.config.model_config import ConfigError, ModelConfig

_GLM_5_3: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "dtype": "bfloat16",
}

# Small enough for CPU tests, with every structural feature on: dense-first layers, MoE with a shared
# expert, IndexShare, MTP; top-k 16 so sparse selection is active on prompts of a few dozen tokens.
# kv_lora_rank 128 keeps fp8_ds_mla's one-scale-per-128-values layout valid.
_TINY: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 16,
    "indexer_types": ["full", "shared", "full", "shared"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "float32",
}

# The served checkpoint's form: block-scaled FP8 weights (docs/fp8.md), for memory math and the simulator
_GLM_5_3_FP8: dict[str, Any] = {**_GLM_5_3, "quantization_config": {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}

PRESETS: dict[str, dict[str, Any]] = {"glm-5.3": _GLM_5_3, "glm-5.3-fp8": _GLM_5_3_FP8, "tiny": _TINY}


def preset_dict(name: str, **overrides: Any) -> dict[str, Any]:
    """The HF-style config dict of a preset, with fields overridden (e.g. `index_topk=8`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    d = dict(PRESETS[name])
    d.update(overrides)
    return d


def preset(name: str, **overrides: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict(preset_dict(name, **overrides))
