"""Packed projections (engine.model.projections): several projections of one input as the rows of one weight,
one GEMM, each member's output the same as its own GEMM's.

CPU: the packing rules (FP8 scale blocks, kinds, biases), the outputs bit for bit against the unpacked
modules, the parameters as views of the packed matrix (weight bytes unchanged), and whole engines (fp32
tiny-code, FP8 quantized at load) giving the same logits packed and unpacked. GPU: GLM-5.3's two packs
(q_a_proj + wk + kv_a_proj over the hidden states, q_b_proj + wq_b over the query residual) at decode and
prefill sizes against their members' own GEMMs (Triton split-K and cuBLAS pick their launch by N, so the
fp32 sums may group differently: within 1e-2 of the output scale), and the tiny-code FP8 engine on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM
from engine.model.fp8 import Fp8Linear
from engine.model.projections import Pack, _packable, pack_projections, project
from engine.runner import model_runner
from kernels.fp8_quant import quantize_weight_ref
from tests.helpers.kernel_inputs import gpu as gpu_marks


def gpu(f):
    for mark in gpu_marks:
        f = mark(f)
    return f


def _fp8(n: int, k: int, gen: torch.Generator, device="cpu") -> Fp8Linear:
    m = Fp8Linear(k, n).to(device)
    wq, ws = quantize_weight_ref((torch.randn(n, k, generator=gen) * k ** -0.5).to(device))
    m.weight.data.copy_(wq)
    m.weight_scale_inv.data.copy_(ws)
    return m


def _linear(n: int, k: int, gen: torch.Generator, bias: bool = False) -> nn.Linear:
    m = nn.Linear(k, n, bias=bias).requires_grad_(False)
    m.weight.copy_(torch.randn(n, k, generator=gen))
    return m


def test_fp8_pack_equals_its_members_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    a, b, c = _fp8(256, 300, gen), _fp8(80, 300, gen), _fp8(128, 300, gen)  # K not a multiple of 128
    x = torch.randn(7, 300, generator=gen)
    alone = [m(x) for m in (a, b, c)]
    codes = [m.weight.view(torch.uint8).clone() for m in (a, b, c)]
    (members,) = _packable([a, b, c])
    assert members == [a, c, b]  # the unaligned one last: its partial scale block is the packed matrix's last
    pk = Pack(members)
    assert pk.weight.shape == (464, 300) and pk.weight_scale_inv.shape == (4, 3)
    for m, code in zip((a, b, c), codes):
        assert m.pack is pk and torch.equal(m.weight.view(torch.uint8), code)
        assert m.weight.untyped_storage().data_ptr() == pk.weight.untyped_storage().data_ptr()
        assert m.weight_scale_inv.untyped_storage().data_ptr() == pk.weight_scale_inv.untyped_storage().data_ptr()
    together = project(x, a, b, c)
    for y, ref in zip(together, alone):
        assert torch.equal(y, ref)
    assert [m(x).shape for m in (a, b, c)] == [(7, 256), (7, 80), (7, 128)]  # members still run alone
    assert torch.equal(a(x), alone[0])


def test_packing_rules():
    gen = torch.Generator().manual_seed(1)
    # two unaligned FP8 members: the larger joins, the other stays alone
    big, small, aligned = _fp8(80, 256, gen), _fp8(32, 256, gen), _fp8(128, 256, gen)
    assert _packable([aligned, small, big]) == [[aligned, big]]
    assert _packable([small, big]) == []  # one unaligned at most: nothing left to pack with
    # mixed kinds pack by kind; a bias, another input width or None stays out
    f1, f2 = _fp8(128, 256, gen), _fp8(256, 256, gen)
    l1, l2 = _linear(40, 256, gen), _linear(24, 256, gen)
    assert _packable([f1, l1, None, f2, l2]) == [[f1, f2], [l1, l2]]
    assert _packable([_linear(8, 256, gen, bias=True), l1]) == []
    assert _packable([_linear(8, 128, gen), l1]) == []
    # a member already packed is not packed again
    Pack([l1, l2])
    assert _packable([l1, l2, _linear(8, 256, gen)]) == []


def test_project_uses_a_pack_only_when_all_its_members_are_asked_for(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    a, b, c = _linear(16, 32, gen), _linear(8, 32, gen), _linear(4, 32, gen)
    x = torch.randn(3, 32, generator=gen)
    alone = [m(x) for m in (a, b, c)]
    pk = Pack([a, b, c])
    calls = []
    real = Pack.__call__
    monkeypatch.setattr(Pack, "__call__", lambda self, x, q=None: calls.append(self) or real(self, x, q))
    out = project(x, a, None, b, c)
    assert out[1] is None and calls == [pk]
    assert all(torch.allclose(y, r, atol=1e-6) for y, r in zip((out[0], out[2], out[3]), alone))
    assert out[2].data_ptr() == out[0].data_ptr() + 16 * 4  # views of one output
    calls.clear()
    ya, yc = project(x, a, c)  # b not asked for: each alone
    assert calls == [] and torch.equal(ya, alone[0]) and torch.equal(yc, alone[2])


def _llm(monkeypatch, packed: bool, *args, **kw) -> LLM:
    """An engine as the runner builds it (packed), or its reference with nothing packed: every projection its own
    GEMM (the runner always packs; the unpacked model is only this comparison's reference)."""
    with monkeypatch.context() as m:
        if not packed:
            m.setattr(model_runner, "pack_projections", lambda model: 0)
        return LLM(*args, **kw)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_packed_equals_unpacked(tiny_code, quantization, monkeypatch):
    """tiny-code (fp32, and FP8 quantized at load): every layer's packs made (MLA's, the gated MLPs'), weight bytes
    unchanged, the prompt's logits the same bits as with nothing packed."""
    ids = list(range(300, 600))
    kw = {"num_blocks": 16, **({"quantization": quantization} if quantization else {})}
    runs = {}
    for packed in ("1", "0"):
        llm = _llm(monkeypatch, packed == "1", str(tiny_code), **kw)
        model = llm.core.runner.model
        attn = model.model.layers[0].self_attn
        runs[packed] = llm.prompt_logits(ids), llm.get_stats().weight_bytes, model, attn
    (on, bytes_on, model, attn), (off, bytes_off, _, attn_off) = runs["1"], runs["0"]
    assert torch.equal(on, off) and bytes_on == bytes_off
    assert getattr(attn_off.q_a_proj, "pack", None) is None
    assert attn.q_a_proj.pack is attn.kv_a_proj_with_mqa.pack and attn.q_b_proj.pack is attn.indexer.wq_b.pack
    # fp32: all three projections of x; FP8: wk's 32 rows and kv_a's 80 are not both 128-aligned
    assert (getattr(attn.indexer.wk, "pack", None) is attn.q_a_proj.pack) == (quantization is None)
    assert pack_projections(model) == 0  # packed once
    packs = {id(m.pack) for m in model.modules() if getattr(m, "pack", None) is not None}
    # x's projections in every layer; the query residual's where the layer has its own indexer (wq_b); every gated
    # MLP's gate and up projections (the dense layers', the shared experts')
    attns = [m for m in model.modules() if type(m).__name__ == "MLAttention"]
    mlps = [m for m in model.modules() if type(m).__name__ == "GatedMLP"]
    assert mlps and all(m.gate_proj.pack is m.up_proj.pack is not None for m in mlps)
    assert len(packs) == sum(1 + (a.indexer is not None) for a in attns) + len(mlps) > len(attns) + len(mlps)


@gpu
@pytest.mark.parametrize("M", [4, 64, 256, 8192])
def test_glm_packs_equal_their_members_gpu(M):
    gen = torch.Generator().manual_seed(3)
    # MLA's packs of x and of the query residual; the shared expert's and a dense layer's gate + up
    for widths, K in (((2048, 128, 576), 6144), ((16384, 4096), 2048), ((2048, 2048), 6144), ((12288, 12288), 6144)):
        mods = [_fp8(n, K, gen, "cuda") for n in widths]
        x = (torch.randn(M, K, generator=gen) * 2).cuda().bfloat16()
        alone = [m(x) for m in mods]
        (members,) = _packable(mods)
        Pack(members)
        for m, y, ref in zip(mods, project(x, *mods), alone):
            assert y.shape == ref.shape == (M, m.out_features)
            assert (y.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max(), (M, m.out_features)


@gpu
def test_fp8_engine_packed_equals_unpacked_gpu(tiny_code, monkeypatch):
    ids = list(range(300, 812))
    logits = []
    for packed in (True, False):
        llm = _llm(monkeypatch, packed, str(tiny_code), num_blocks=32, device="cuda", quantization="fp8")
        logits.append(llm.prompt_logits(ids).float().cpu())
    top1 = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1).min().item()
    assert top1 >= 0.99 and cos >= 0.999, (top1, cos)


@gpu
def test_fp8_engine_norm_quantization_gpu(tiny_code, monkeypatch):
    """RMSNorm.quantize on CUDA: the norms' codes are `quant_act`'s bits, so the FP8 engine's prompt logits (eager)
    and its greedy tokens (decode graphs captured with the switch on) are the same as with the projections
    quantizing their inputs themselves."""
    from engine import SamplingParams
    from engine.model.layers import RMSNorm

    ids = list(range(300, 500))  # 200 rows: the Triton GEMMs' sizes
    runs = []
    for on in (False, True):
        monkeypatch.setattr(RMSNorm, "quantize", on)
        llm = LLM(str(tiny_code), num_blocks=64, device="cuda", quantization="fp8")
        out = llm.generate([ids[:40], ids[100:130]], SamplingParams(max_tokens=24, temperature=0.0))
        runs.append((llm.prompt_logits(ids).float().cpu(), [o.token_ids for o in out]))
        del llm
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@gpu
def test_fp8_engine_absorbed_in_place_gpu(tiny_code, monkeypatch):
    """MLAttention.absorbed_in_place on CUDA: the FP8 engine's decode-sized prompt logits with kv_b_proj read in
    place agree with the dequantized copy's (the same bf16 weight values, sums in another order)."""
    import engine.model.mla as mla
    from engine.model.mla import MLAttention

    calls = []
    real = mla.absorbed_matmul
    monkeypatch.setattr(mla, "absorbed_matmul", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    ids = list(range(300, 500))
    logits = []
    for on in (False, True):
        monkeypatch.setattr(MLAttention, "absorbed_in_place", on)
        llm = LLM(str(tiny_code), num_blocks=64, device="cuda", quantization="fp8", dtype="bfloat16")
        logits.append(llm.prompt_logits(ids).float().cpu())
        assert bool(calls) == on  # the in-place kernel ran with the switch only
        del llm
    top1 = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1).min().item()
    assert top1 >= 0.99 and cos >= 0.999, (top1, cos)
