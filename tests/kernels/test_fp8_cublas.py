"""The cuBLAS block-scaled FP8 path (kernels.fp8_cublas): the operand layouts it hands cuBLAS, the grouped
MoE's Triton launches around the per-expert GEMMs, the launcher's choice, and on the GPU cuBLAS itself
against the fp32 references.

On CPU the GEMM is `scaled_mm_ref` (what cuBLAS computes, in fp32), called through the same code with the
same views, so a wrong segment, scale layout or combine fails here; every call is also checked against
cuBLAS's contract (rows a multiple of 4, activation scales with strides (1, rows), weight scales with
strides (1, K/128)). Tolerances as tests/kernels/test_fp8_gemm.py: 1e-3 of the output scale on CPU (an
e4m3 rounding boundary crossed by summation order), 2e-2 and cosine >= 0.999 on the GPU (bf16 outputs,
and here also bf16 gate/up and down rows before the last sum).
"""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_cublas
from kernels.fp8_cublas import fused_moe_fp8_cublas, scaled_mm_ref, use_dense, use_moe
from kernels.fp8_gemm import w8a8_block_fp8_matmul
from kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_ref
from kernels.fp8_quant import quant_act, quant_act_ref
from tests.helpers.kernel_inputs import gpu, interp
from tests.helpers.sm90 import compile_sm90, nvidia_backend
from tests.kernels.test_fp8_gemm import _activation, check_gemm, make_fp8_moe


@interp
@pytest.mark.parametrize("M,pad", [(21, 4), (8, 4), (3, 16)])
def test_quant_act_pads_rows_and_stores_scales_column_major_interp(M, pad):
    gen = torch.Generator().manual_seed(2)
    x = _activation(M, 300, torch.float32, "cpu", gen, "nan_padded")
    q, s = quant_act(x, col_major_scales=True, pad_rows_to=pad)
    rows = -(-M // pad) * pad
    assert q.shape == (rows, 300) and s.shape == (rows, 3) and s.stride() == (1, rows)
    qr, sr = quant_act_ref(x)
    assert torch.equal(q[:M].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:M], sr)
    assert not q[M:].view(torch.uint8).any() and torch.all(s[M:] > 0)  # padding: zero codes, a finite scale


class Recorder:
    """scaled_mm_ref, after checking each call against what cuBLAS accepts."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b_t, scale_a, scale_b_t, out):
        M, K = a.shape
        assert M % 4 == 0 and M > 0 and a.stride() == (K, 1) and b_t.stride() == (1, K)
        assert scale_a.shape == (M, K // 128) and scale_a.stride() == (1, M)
        assert scale_b_t.shape == (K // 128, b_t.shape[1] // 128) and scale_b_t.stride() == (1, K // 128)
        assert out.shape == (M, b_t.shape[1]) and out.is_contiguous()
        self.calls.append(M)
        scaled_mm_ref(a, b_t, scale_a, scale_b_t, out)


@interp
@pytest.mark.parametrize("T,offset,num_local", [(37, 0, None), (29, 2, 4), (1, 0, None)])
def test_grouped_moe_through_per_expert_gemms_interp(T, offset, num_local):
    """Gather + quantize in expert order, one GEMM per expert with rows, SiLU-and-mul + quantize, one GEMM
    per expert, weighted combine: the fp32 reference of the Triton grouped MoE, for every local expert
    count (experts with no tokens, tokens with no local expert)."""
    E = 8
    x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(T, 256, 128, E, 2, "cpu")
    n = num_local or E
    local = [t[offset: offset + n] for t in (w13, s13, w2, s2)]
    mm = Recorder()
    got = fused_moe_fp8_cublas(x, *local, weights, ids, offset, mm=mm, inter_dtype=torch.float32)
    want = fused_moe_fp8_ref(x, *local, weights, ids, offset)
    scale = want.abs().max().clamp(min=1e-6)
    assert got.shape == (T, 256) and ((got - want).abs().max() / scale).item() <= 1e-3
    key = ids.reshape(-1) - offset
    counts = torch.bincount(key[(key >= 0) & (key < n)], minlength=n)
    assert mm.calls == [int(-(-c // 16) * 16) for c in counts if c] * 2  # one call per GEMM per busy expert


@interp
def test_grouped_moe_with_nothing_local_is_zero_interp():
    x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(5, 256, 128, 8, 2, "cpu")
    mm = Recorder()
    out = fused_moe_fp8_cublas(x, w13[:2], s13[:2], w2[:2], s2[:2], weights, ids, 100, mm=mm,
                               inter_dtype=torch.float32)
    assert not mm.calls and torch.all(out == 0)


def test_the_launcher_picks_cublas_where_it_was_measured_faster(monkeypatch):
    dev = torch.device("cpu")
    assert not use_dense(8192, 2048, 6144, torch.bfloat16, dev)  # no cuBLAS block scaling on the CPU
    monkeypatch.setattr(fp8_cublas, "available", lambda device: True)
    bf16 = torch.bfloat16
    assert use_dense(8192, 576, 6144, bf16, dev) and use_dense(300, 2048, 6144, bf16, dev)  # prefill, all
    assert use_dense(256, 24576, 6144, bf16, dev) and not use_dense(256, 2048, 6144, bf16, dev)  # by weight size
    assert not use_dense(128, 24576, 6144, bf16, dev)  # the split-K kernel's rows
    assert not use_dense(8192, 2048, 6144, torch.float32, dev)  # bf16 outputs only
    assert not use_dense(8192, 2048, 1100, bf16, dev) and not use_dense(8192, 2050, 6144, bf16, dev)
    assert use_moe(8192, 8 * 8192, 32, 6144, 2048, bf16, dev)
    assert not use_moe(2048, 8 * 2048, 32, 6144, 2048, bf16, dev)  # too few rows per expert
    assert not use_moe(256, 8 * 256, 32, 6144, 2048, bf16, dev)  # a decode step's tokens: no host wait
    assert not use_moe(8192, 65536, 32, 6144, 2000, bf16, dev)
    assert not use_moe(8192, 65536, 32, 6144, 2048, torch.float32, dev)


def test_forcing_cublas_where_it_cannot_run_is_a_clear_error():
    wq = torch.zeros(128, 512).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cuBLAS's block-scaled GEMM does not take"):
        w8a8_block_fp8_matmul(torch.randn(4, 512), wq, torch.ones(1, 4), impl="cublas")
    with pytest.raises(ValueError, match="impl must be"):
        w8a8_block_fp8_matmul(torch.randn(4, 512), wq, torch.ones(1, 4), impl="cutlass")


@pytest.mark.skipif(not nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_cublas_path_kernels_compile_for_sm90():
    out = compile_sm90('''
        from kernels.fp8_cublas import _combine_sorted_kernel, _gather_quant_kernel, _silu_quant_kernel
        from kernels.fp8_quant import _act_quant_kernel

        P = "*i32"
        g = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", rows_ptr=P, block_expert_ptr=P, seg_start_ptr=P,
                 seg_len_ptr=P, num_experts="i32", top_k="i32", K="i32", sx_t="i64", sq_r="i64")
        print(build(_gather_quant_kernel, g, dict(BLOCK_R=16, ROUND_FIRST=False), num_warps=4))
        s = dict(g_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", block_expert_ptr=P, seg_start_ptr=P, seg_len_ptr=P,
                 num_experts="i32", inter="i32", sg_r="i64", sq_r="i64")
        print(build(_silu_quant_kernel, s, dict(BLOCK_R=16, ROUND_FIRST=False), num_warps=4))
        c = dict(d_ptr="*bf16", pos_ptr=P, w_ptr="*fp32", out_ptr="*bf16", H="i32", top_k="i32", sd_r="i64",
                 so_t="i64")
        print(build(_combine_sorted_kernel, c, dict(BLOCK_H=1024, ROUND_FIRST=False), num_warps=4))
        a = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", M="i32", M_out="i32", K="i32", sx_m="i64", sx_k="i64",
                 sq_m="i64", ss_m="i64", ss_k="i64")
        print(build(_act_quant_kernel, a, dict(BLOCK_M=32, ROUND_FIRST=False), num_warps=4))
    ''')
    sizes = [int(v) for v in out.split()]
    assert len(sizes) == 4 and all(v > 0 for v in sizes), out


# ---- GPU: cuBLAS itself ----------------------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K", [(8192, 2048, 6144), (8193, 576, 6144), (1, 6144, 2048), (63, 16384, 2048),
                                   (256, 24576, 6144), (4097, 6144, 16384)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cublas_dense_gemm_gpu(M, N, K, mark):
    """Rows that are not a multiple of 4 (padded), N not a multiple of 128 (kv_a_proj), strided and NaN-padded
    activations: against the fp32 reference, and close to the Triton kernel on the same inputs."""
    assert fp8_cublas.available(torch.device("cuda")), "cuBLAS block-scaled FP8 should run on this GPU"
    for layout in ("contiguous", "transposed", "nan_padded"):
        x, wq, ws, got = check_gemm(M, N, K, torch.bfloat16, "cuda", layout, tol=2e-2, cos_min=0.9999)
        if layout == "contiguous":
            forced = w8a8_block_fp8_matmul(x, wq, ws, impl="cublas")
            triton_out = w8a8_block_fp8_matmul(x, wq, ws, impl="triton").float()
            assert torch.equal(forced, got) or not use_dense(M, N, K, torch.bfloat16, x.device)
            err = (forced.float() - triton_out).abs().max() / triton_out.abs().max()
            assert err.item() <= 2e-2


@pytest.mark.parametrize("T", [256, 4096])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cublas_grouped_moe_gpu(T, mark):
    """Per-expert cuBLAS GEMMs at 64+ assignments per expert (the launcher's choice) against the fp32
    reference and the Triton grouped kernel, with expert parallelism's offset; under graph capture the
    launcher keeps the Triton kernel (no host synchronisation there)."""
    for H, inner, E, k, offset, num_local in ((2048, 512, 32, 8, 0, None), (1024, 512, 16, 4, 4, 8)):
        x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(T, H, inner, E, k, "cuda")
        x = x.bfloat16()
        n = num_local or E
        local = [t[offset: offset + n] for t in (w13, s13, w2, s2)]
        got = fused_moe_fp8(x, *local, weights, ids, offset, impl="cublas")
        want = fused_moe_fp8_ref(x.float(), *local, weights, ids, offset)
        tri = fused_moe_fp8(x, *local, weights, ids, offset, impl="triton").float()
        scale = want.abs().max()
        assert ((got.float() - want).abs().max() / scale).item() <= 2e-2
        assert ((got.float() - tri).abs().max() / scale).item() <= 2e-2
        live = want.norm(dim=-1) > 0
        cos = torch.nn.functional.cosine_similarity(got.float()[live], want[live], dim=-1).min().item()
        assert cos >= 0.999, cos
        if T >= 1024 and T * k >= 2048 * n:
            assert torch.equal(fused_moe_fp8(x, *local, weights, ids, offset), got), "the launcher picks cuBLAS"
    graph = torch.cuda.CUDAGraph()
    fused_moe_fp8(x, *local, weights, ids, offset)
    with torch.cuda.graph(graph):
        captured = fused_moe_fp8(x, *local, weights, ids, offset)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, tri.to(captured.dtype)) or \
        ((captured.float() - tri).abs().max() / scale).item() <= 1e-2


@pytest.mark.parametrize("M", [8192, 301, 64])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_projections_of_one_input_share_its_quantization_gpu(M, mark):
    """MLA's q_a_proj and kv_a_proj_with_mqa through `project`: x quantized once, the bits of two separate
    calls (where cuBLAS does not serve both, the separate calls themselves)."""
    from engine.model.fp8 import Fp8Linear
    from engine.model.projections import project
    from kernels.fp8_quant import quantize_weight_ref

    gen = torch.Generator().manual_seed(4)
    mods = []
    for n in (2048, 576):
        m = Fp8Linear(6144, n).cuda()
        wq, ws = quantize_weight_ref(torch.randn(n, 6144, generator=gen).cuda() * 6144 ** -0.5)
        m.weight.data.copy_(wq)
        m.weight_scale_inv.data.copy_(ws)
        mods.append(m)
    x = torch.randn(M, 6144, generator=gen).cuda().bfloat16()
    together = project(x, *mods)
    for m, y in zip(mods, together):
        assert y.shape == (M, m.out_features) and torch.equal(y, m(x))
