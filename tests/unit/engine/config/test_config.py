"""Parsing HF config.json: field precedence, derived shapes, presets and the KV byte budget."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config.model_config import ConfigError, ModelConfig
from engine.config.presets import preset, preset_dict

BASE = preset_dict("tiny")


def cfg(**kw) -> ModelConfig:
    d = dict(BASE)
    d.pop("indexer_types", None)
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def test_indexer_types_precedence_matches_hf():
    explicit = ["full", "full", "shared", "shared"]
    assert cfg(indexer_types=explicit, index_topk_pattern="FSFS").indexer_types == tuple(explicit)
    assert cfg(index_topk_pattern="FSSF", index_topk_freq=1).indexer_types == ("full", "shared", "shared", "full")
    # freq/offset: layer i is full when max(i - offset + 1, 0) % freq == 0
    assert cfg(num_hidden_layers=8, index_topk_freq=2, index_skip_topk_offset=1,
               first_k_dense_replace=1).indexer_types == ("full", "shared", "full", "shared", "full", "shared",
                                                          "full", "shared")
    # HF's default offset is 2
    assert cfg(index_topk_freq=2).indexer_types == ("full", "full", "shared", "full")


def test_glm53_full_layers_are_the_documented_21():
    c = preset("glm-5.3")
    assert c.full_indexer_layers == (0, 1, 2) + tuple(range(6, 78, 4))
    assert len(c.full_indexer_layers) == 21


def test_mlp_layer_types_and_first_k_dense():
    assert cfg(first_k_dense_replace=2).mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    assert cfg(mlp_layer_types=["sparse", "dense", "sparse", "dense"]).mlp_layer_types[1] == "dense"


def test_rope_and_eps_fields():
    c = cfg(rope_parameters={"rope_type": "default", "rope_theta": 123.0}, q_lora_norm_eps=1e-5)
    assert c.rope_theta == 123.0 and c.q_lora_norm_eps == 1e-5 and c.kv_lora_norm_eps == 1e-6
    assert cfg(rope_parameters=None, rope_theta=77.0).rope_theta == 77.0
    with pytest.raises(ConfigError, match="rope_type"):
        cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0, "factor": 4})
    assert cfg().rope_interleave and cfg().indexer_rope_interleave


def test_deepseek_v32_same_path_without_indexshare():
    c = cfg(model_type="deepseek_v32")
    assert c.indexer_types == ("full",) * 4
    assert not c.indexer_rope_interleave  # V3.2's indexer rotates half-split


@pytest.mark.parametrize("bad,match", [
    (dict(model_type="llama"), "model_type"),
    (dict(indexer_types=["shared", "full", "full", "full"]), "layer 0"),
    (dict(indexer_types=["full", "full"]), "indexer_types"),
    (dict(num_experts_per_tok=99), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_bad_configs_raise_clear_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        cfg(**bad)


def test_missing_field_is_named(tmp_path):
    d = dict(BASE)
    del d["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_pretrained(tmp_path)


def test_glm53_kv_bytes_per_token():
    """78 MLA rows of 656 B and 21 indexer keys of 132 B per token, plus one of each for the MTP layer."""
    from engine.kv.cache import KVCacheSpec
    spec = KVCacheSpec.from_model(preset("glm-5.3"), kv_cache_dtype="fp8_ds_mla", indexer_precision="fp8",
                                  with_mtp=True)
    assert (spec.num_mla_layers, spec.num_index_layers) == (78 + 1, 21 + 1)
    assert spec.mla_row == 656 and spec.index_row == 132
    assert spec.bytes_per_token == 78 * 656 + 21 * 132 + 656 + 132 == 54728


def test_glm53_instantiates_on_meta_with_hf_parameter_count():
    from engine.model import GlmDsaForCausalLM

    c = preset("glm-5.3")
    with torch.device("meta"):
        model = GlmDsaForCausalLM(c, with_mtp=True)
    n = model.num_parameters(include_mtp=False)
    assert round(n / 1e9, 1) == 743.4
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in preset_dict("glm-5.3").items()
                                             if k not in ("model_type", "dtype", "num_nextn_predict_layers")})
    with torch.device("meta"):
        hf = transformers.GlmMoeDsaForCausalLM(hf_cfg)
    assert n == sum(p.numel() for p in hf.parameters())


def test_roundtrip_through_hf_dict():
    c = preset("tiny")
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
