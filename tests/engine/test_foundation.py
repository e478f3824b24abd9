"""Foundation: fp8 serving agrees with the fp32 path, checkpoints round-trip, bad input is refused."""

from __future__ import annotations

import inspect
import json
import shutil
import textwrap

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.checkpoint import make_checkpoint
from engine.loading.weights import WeightLoadError


def _python_text() -> str:
    import json.decoder
    return inspect.getsource(json.decoder) + inspect.getsource(textwrap)


def test_fp8_kv_and_indexer_agree_with_fp32(tiny_code):
    exact = LLM(str(tiny_code), kv_cache_dtype="float32", indexer_precision="fp32", num_blocks=64)
    fp8 = LLM(str(tiny_code), kv_cache_dtype="fp8_ds_mla", indexer_precision="fp8", num_blocks=64)
    ids = exact.tokenizer.encode(_python_text())[:768]
    a, b = exact.prompt_logits(ids), fp8.prompt_logits(ids)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    assert agree >= 0.98, f"top-1 agreement {agree:.4f}"
    assert cos >= 0.999, f"mean cosine {cos:.5f}"
    assert not torch.equal(a, b), "the fp8 path must actually quantise"


def test_generate_greedy_text_and_ids(tiny_code):
    llm = LLM(str(tiny_code), num_blocks=64)
    (out,) = llm.generate("def add(a, b):\n", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    (again,) = llm.generate([llm.tokenizer.encode("def add(a, b):\n")],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert again.token_ids == out.token_ids


def test_make_checkpoint_sharded_roundtrip(tmp_path):
    one = make_checkpoint(tmp_path / "one", seed=3)
    two = make_checkpoint(tmp_path / "two", seed=3, num_shards=3)
    assert (two / "model.safetensors.index.json").exists()
    ids = list(range(20, 60))
    a = LLM(str(one), num_blocks=16).prompt_logits(ids)
    b = LLM(str(two), num_blocks=16).prompt_logits(ids)
    assert torch.equal(a, b)
    cfg = json.loads((one / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and "indexer_types" in cfg


def test_loads_merged_3d_expert_tensors(tmp_path, tiny_ckpt):
    """HF's merged `experts.gate_up_proj` / `experts.down_proj` load like per-expert tensors."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "merged"
    shutil.copytree(tiny_ckpt, out)
    sd = load_file(str(out / "model.safetensors"))
    merged = {}
    for layer in {k.split(".mlp.experts.")[0] for k in sd if ".mlp.experts." in k}:
        n = len({k for k in sd if k.startswith(layer + ".mlp.experts.") and k.endswith("down_proj.weight")})
        gate_up = [torch.cat([sd.pop(f"{layer}.mlp.experts.{e}.gate_proj.weight"),
                              sd.pop(f"{layer}.mlp.experts.{e}.up_proj.weight")]) for e in range(n)]
        merged[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        merged[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [sd.pop(f"{layer}.mlp.experts.{e}.down_proj.weight") for e in range(n)])
    save_file({**sd, **merged}, str(out / "model.safetensors"))
    ids = list(range(30, 50))
    assert torch.equal(LLM(str(out), num_blocks=8).prompt_logits(ids),
                       LLM(str(tiny_ckpt), num_blocks=8).prompt_logits(ids))


def test_fp8_block_scaled_weights_are_dequantised(tmp_path, tiny_ckpt):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "fp8"
    shutil.copytree(tiny_ckpt, out)
    sd = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    w = sd[name]
    scale = torch.full((2, 1), 2.0 ** -6)  # [192, 64]: two 128-row blocks by one 128-column block
    sd[name] = (w / scale[0, 0]).to(torch.float8_e4m3fn)
    sd[name + "_scale_inv"] = scale
    save_file(sd, str(out / "model.safetensors"))
    llm = LLM(str(out), num_blocks=8)
    got = llm.core.runner.model.model.layers[1].self_attn.q_b_proj.weight
    assert torch.allclose(got, w, rtol=0.07, atol=2 ** -6 * 2 ** -9)
    assert not torch.equal(got, w)


def test_missing_tensor_is_named(tmp_path, tiny_ckpt):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, out)
    sd = load_file(str(out / "model.safetensors"))
    del sd["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        LLM(str(out), num_blocks=8)


def test_misshaped_tensor_is_named(tmp_path, tiny_ckpt):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "shape"
    shutil.copytree(tiny_ckpt, out)
    sd = load_file(str(out / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(7)
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight.*\(7,\)"):
        LLM(str(out), num_blocks=8)


def test_bad_prompts_are_refused_without_leaking(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), num_blocks=8, max_model_len=100)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, -3]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(5, 105))])
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_ckpt), num_blocks=8, max_model_len=10**7)
    stats = llm.get_stats()
    assert stats.num_free_blocks == 8 and stats.num_running == 0 and stats.num_waiting == 0
    (ok,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(ok.token_ids) == 3
