"""The engine on CUDA (Triton kernels, bf16 weights, fp8 KV) against the CPU fp32 reference path."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ids(tok, n: int) -> list[int]:
    import json.decoder
    return tok.encode(inspect.getsource(json.decoder))[:n]


def test_cuda_fp8_engine_agrees_with_cpu_fp32(tiny_code):
    ref = LLM(str(tiny_code), device="cpu", dtype="float32", kv_cache_dtype="float32", num_blocks=64)
    gpu = LLM(str(tiny_code), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", num_blocks=64)
    assert gpu.core.runner.backend.name == "triton"
    ids = _ids(ref.tokenizer, 768)
    a, b = ref.prompt_logits(ids), gpu.prompt_logits(ids).float().cpu()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    print(f"\nCUDA bf16 + fp8 KV vs CPU fp32: top-1 agreement {agree:.4f}, mean cosine {cos:.5f}")
    assert agree >= 0.95 and cos >= 0.995


def test_cuda_generation_with_mtp3(tiny_code):
    llm = LLM(str(tiny_code), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", num_blocks=256,
              num_speculative_tokens=3)
    prompts = [_ids(llm.tokenizer, 768)[i * 40: i * 40 + 30] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 48 for o in outs)
    st = llm.get_stats()
    print(f"\nCUDA MTP3: mean acceptance length {st.spec_mean_acceptance_length:.2f}")
    assert st.spec_accepted > 0 and st.num_free_blocks == 256
