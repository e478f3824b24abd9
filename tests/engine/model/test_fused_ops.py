"""The model with its norms, RoPE and routing as one-launch kernels (what CUDA runs) equals the eager model.

On the CPU the kernels run in Triton's interpreter inside a real forward of tiny-code; the MoE experts stay
on their reference so the comparison isolates the small ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.model.layers as layers
import engine.model.mla as attention
import engine.model.model as model_module
import engine.model.moe as moe
from engine.frontend.llm import LLM
from engine.model.layers import RMSNorm
from engine.model.mla import Indexer, MLAttention
from engine.model.moe import MoEGate
from kernels.triton_support import interpreting

DATA = Path(__file__).resolve().parents[2] / "data" / "heldout_python.txt"
pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernels in Triton's interpreter")


def _counted(monkeypatch, module, name: str, counts: dict) -> None:
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_small_ops_equal_the_eager_model(tiny_code, dtype, monkeypatch):
    llm = LLM(str(tiny_code), num_blocks=8, dtype=dtype)
    ids = llm.tokenizer.encode(DATA.read_text())[:12]
    eager = llm.prompt_logits(ids)
    counts: dict = {}
    for module, name in ((layers, "rms_norm"), (attention, "rope"), (attention, "rope_cat"), (moe, "route")):
        _counted(monkeypatch, module, name, counts)
    for m in llm.core.runner.model.modules():
        if isinstance(m, (RMSNorm, MLAttention, Indexer, MoEGate)):
            m.fused = True
    fused = llm.prompt_logits(ids)
    assert set(counts) == {"rms_norm", "rope", "rope_cat", "route"}, counts
    if dtype == "float32":
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    else:  # the sums of squares add in another order: a bf16 rounding may differ, rarely
        assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.95
        cos = torch.nn.functional.cosine_similarity(fused, eager, dim=-1)
        assert cos.min() > 0.999, cos.min()


def _fused_fp8(tiny_code, **kw) -> tuple[LLM, list[int]]:
    """tiny-code quantized to FP8 at load, its small ops fused (run in the interpreter), and a 12-token prompt."""
    llm = LLM(str(tiny_code), num_blocks=8, quantization="fp8", **kw)
    for m in llm.core.runner.model.modules():
        if isinstance(m, (RMSNorm, MLAttention, Indexer, MoEGate)):
            m.fused = True
    return llm, llm.tokenizer.encode(DATA.read_text())[:12]


def test_norms_quantizing_for_fp8_projections_equal_their_own_quantization(tiny_code, monkeypatch):
    """RMSNorm.quantize: the fused norms before FP8 projections write their output's codes in the same launch
    (kernels.norm.rms_norm_quant) and the projections take them, at decode sizes only (cuBLAS at prefill sizes lays
    its scales out its own way). tiny-code quantized to FP8 at load gives the same logits bits as with each
    projection quantizing its input itself, and the codes do reach the GEMMs: the input norm's (the attention's
    pack; the MLP's shared expert and dense layers), the post-attention norm's, the query residual's."""
    from engine.model import fp8 as fp8_mod
    from kernels import fp8_gemm

    llm, ids = _fused_fp8(tiny_code)
    given = {"with": 0, "without": 0}
    ref = fp8_gemm.w8a8_block_fp8_matmul_ref

    def counted(x, w, s, out_dtype=None, x_quant=None):
        given["with" if x_quant is not None else "without"] += 1
        return ref(x, w, s, out_dtype, x_quant=x_quant)

    monkeypatch.setattr(fp8_mod, "w8a8_block_fp8_matmul_ref", counted)
    monkeypatch.setattr(RMSNorm, "quantize", True)
    norms: dict = {}
    _counted(monkeypatch, layers, "rms_norm_quant", norms)
    monkeypatch.setattr(model_module, "DECODE_MAX_M", len(ids) - 1)  # the prompt's rows are past it
    own = llm.prompt_logits(ids)
    assert not norms and given["with"] == 0
    monkeypatch.setattr(model_module, "DECODE_MAX_M", len(ids))
    quantized = llm.prompt_logits(ids)
    assert torch.equal(quantized, own)
    n = len(llm.core.runner.model.model.layers)
    assert norms["rms_norm_quant"] >= 3 * n, norms  # per decoder layer: input, post-attention, query residual
    assert given["with"] >= 3 * n and given["without"] > 0, given


def test_absorbed_matmuls_reading_fp8_in_place_equal_the_dequantized_copy(tiny_code, monkeypatch):
    """MLAttention.absorbed_in_place: the absorbed matmuls read the FP8 kv_b_proj where they multiply it
    (kernels.fp8_absorbed.absorbed_matmul) instead of a dequantized bf16 copy and two einsums, at decode sizes only.
    The same bf16 weight values, sums in another order: tiny-code in bf16, FP8 at load, agrees with the copy's
    logits."""
    llm, ids = _fused_fp8(tiny_code, dtype="bfloat16")
    calls: dict = {}
    _counted(monkeypatch, attention, "absorbed_matmul", calls)
    monkeypatch.setattr(MLAttention, "absorbed_in_place", True)
    monkeypatch.setattr(attention, "ABSORBED_MAX_ROWS", len(ids) - 1)  # the prompt's rows are past it: the copy
    copy = llm.prompt_logits(ids)
    assert not calls
    monkeypatch.setattr(attention, "ABSORBED_MAX_ROWS", len(ids))
    in_place = llm.prompt_logits(ids)
    assert calls["absorbed_matmul"] >= 2 * len(llm.core.runner.model.model.layers), calls  # W_UK's and W_UV's
    assert (in_place.argmax(-1) == copy.argmax(-1)).float().mean() >= 0.95
    cos = torch.nn.functional.cosine_similarity(in_place.float(), copy.float(), dim=-1)
    assert cos.min() > 0.999, cos.min()
