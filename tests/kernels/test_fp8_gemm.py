"""The w8a8 block-scaled FP8 GEMM (prefill kernel and split-K decode path) and the FP8 grouped MoE against
their fp32 references.

Tolerances: under the interpreter both sides do the same fp32 arithmetic up to summation order, so the
kernels match the references within 1e-5 of the output's scale (the GEMM, either path: the decode path
quantizes x in its prologue exactly as `quant_act` does, and its split partials differ from one fp32
matmul by summation order only) and 1e-3 (the MoE: a
summation-order difference can move h across an e4m3 rounding boundary, one code of 1/16 relative on
one element). On the GPU the fp8 MMA accumulates each 128-deep block in its own (reduced-precision)
fp32 registers and bf16 outputs round to 2^-8: 2e-2 of the output scale and a cosine >= 0.9999.
Against the unquantized fp32 product the quantization error itself is a few percent (checked loosely,
so a scale applied twice or not at all fails). The decode path's split sums run in split order whatever
order the splits finish in, so its results are compared bit for bit across reruns and graph replays.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref
from kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_ref, merge_gate_up_scales
from kernels.fp8_quant import quant_act, quant_act_ref, quantize_weight_ref
from kernels.fp8_splitk import (
    _COUNTERS,
    MAX_SPLIT,
    MIN_KB_PER_SPLIT,
    MIN_KB_PER_SPLIT_SMALL,
    PROGRAMS_PER_SM,
    SplitKConfig,
    _tile_counters,
    splitk_config,
)
from kernels.moe import fused_moe_ref
from kernels.moe_routing import route_ref
from tests.helpers.kernel_inputs import POISON_BYTE, gpu, interp


def _poisoned_fp8(q: torch.Tensor, pad: tuple[int, int]) -> torch.Tensor:
    """q as a strided view into a bigger buffer whose extra rows/columns are NaN bytes."""
    buf = torch.full((q.shape[0] + pad[0], q.shape[1] + pad[1]), POISON_BYTE, dtype=torch.uint8, device=q.device)
    buf[: q.shape[0], : q.shape[1]] = q.view(torch.uint8)
    return buf.view(torch.float8_e4m3fn)[: q.shape[0], : q.shape[1]]


def _activation(M: int, K: int, dtype, device, gen, layout: str) -> torch.Tensor:
    x = torch.randn(M, K, generator=gen) * 3
    if layout == "transposed":  # column-major view
        return x.t().contiguous().to(dtype).to(device).t()
    if layout == "nan_padded":
        buf = torch.full((M + 3, K + 70), float("nan"), dtype=dtype, device=device)
        buf[:M, :K] = x.to(dtype)
        return buf[:M, :K]
    return x.to(dtype).to(device)


def check_gemm(M, N, K, dtype, device, layout="contiguous", tol=1e-5, cos_min=0.99999, seed=0, config=None):
    """The GEMM on seeded inputs (weight a strided view beside NaN bytes) against the reference; returns
    (x, weight, scales, output) for further checks."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device)
    wq, ws = quantize_weight_ref(w)
    wq = _poisoned_fp8(wq, (5, 64))
    x = _activation(M, K, dtype, device, gen, layout)
    got = w8a8_block_fp8_matmul(x, wq, ws, config=config)
    want = w8a8_block_fp8_matmul_ref(x.float(), wq, ws, torch.float32).cpu()
    assert got.shape == (M, N) and got.dtype == dtype and not torch.isnan(got).any()
    g = got.float().cpu()
    scale = want.abs().max().clamp(min=1e-6)
    err = ((g - want).abs().max() / scale).item()
    assert err <= tol, f"[{M},{N},{K}] {layout}: differs from the reference by {err:.3g} of its scale"
    cos = torch.nn.functional.cosine_similarity(g.flatten(), want.flatten(), dim=0).item()
    assert cos >= cos_min, cos
    exact = (x.float() @ w.t()).cpu()
    q_err = ((want - exact).abs().max() / scale).item()
    assert q_err <= 0.1, f"quantization error {q_err:.3g} of the output scale: a scale is misapplied"
    return x, wq, ws, got


@interp
@pytest.mark.parametrize("M,N,K", [(37, 200, 300), (1, 64, 128), (130, 257, 129), (5, 130, 640)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "nan_padded"])
def test_w8a8_gemm_interp(M, N, K, layout):
    check_gemm(M, N, K, torch.float32, "cpu", layout, config=(16, 32, 2, 4, 1))  # the prefill kernel, split in 2


SPLITK_CASES = [  # (M, N, K, config): what each case exercises
    (37, 200, 300, SplitKConfig(16, 64, 2)),  # 3 k-blocks in 2 splits (1 + 2), ragged M, N and K
    (1, 64, 128, SplitKConfig(16, 128, 4)),  # one k-block: the split clamps to 1, no partials
    (130, 257, 129, SplitKConfig(64, 128, 2, fuse_quant=False)),  # 3 row tiles, x quantized by quant_act
    (5, 130, 640, SplitKConfig(16, 256, 3)),  # a tile over two weight-scale rows, 5 k-blocks in 3 splits
    (77, 100, 1100, SplitKConfig(32, 32, 8)),  # 9 k-blocks in 8 splits, 4 column tiles (the last one ragged)
    (256, 96, 1000, None),  # the launcher's pick at the largest decode M
]


@interp
@pytest.mark.parametrize("M,N,K,config", SPLITK_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "nan_padded"])
def test_splitk_gemm_interp(M, N, K, config, layout):
    x, wq, ws, got = check_gemm(M, N, K, torch.float32, "cpu", layout, config=config)
    assert torch.equal(w8a8_block_fp8_matmul(x, wq, ws, config=config), got), "a rerun must give the same bits"
    assert all(not c.any() for c in _COUNTERS.values()), "every launch leaves its tile counters at zero"


@interp
@pytest.mark.parametrize("layout", ["transposed", "nan_padded"])
def test_splitk_fused_quantization_is_quant_act_interp(layout):
    """Quantizing x in the prologue gives the bits of quantizing it with `quant_act` first."""
    gen = torch.Generator().manual_seed(4)
    wq, ws = quantize_weight_ref(torch.randn(150, 700, generator=gen))
    x = _activation(40, 700, torch.bfloat16, "cpu", gen, layout)
    x[7, 128:256] = 0.0  # an all-zero block
    fused = w8a8_block_fp8_matmul(x, wq, ws, torch.float32, config=SplitKConfig(32, 64, 3))
    separate = w8a8_block_fp8_matmul(x, wq, ws, torch.float32, config=SplitKConfig(32, 64, 3, fuse_quant=False))
    assert torch.equal(fused, separate)


@interp
def test_splitk_gemm_bf16_and_out_dtype_interp():
    check_gemm(9, 96, 200, torch.bfloat16, "cpu", tol=1e-2, cos_min=0.9999, config=SplitKConfig(16, 64, 2))
    gen = torch.Generator().manual_seed(2)
    wq, ws = quantize_weight_ref(torch.randn(70, 300, generator=gen))
    x = torch.randn(3, 300, generator=gen)
    got = w8a8_block_fp8_matmul(x, wq, ws, torch.bfloat16, config=SplitKConfig(16, 32, 3))
    want = w8a8_block_fp8_matmul_ref(x, wq, ws, torch.float32)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())


def test_splitk_config_fills_the_gpu_within_its_bounds():
    """At GLM-5.3's decode shapes on 132 multiprocessors: at most PROGRAMS_PER_SM programs per multiprocessor
    once K is split, every split >= MIN_KB_PER_SPLIT k-blocks, and only those bounds or MAX_SPLIT stop a
    split; the activation is quantized by its own launch; the H200 sweep's picks come out."""
    sms = 132
    for N, K in [(2048, 6144), (576, 6144), (16384, 2048), (6144, 16384), (24576, 6144), (4096, 6144),
                 (6144, 2048), (4096, 2048), (6144, 12288)]:
        for M in (1, 16, 64, 100, 256):
            c = splitk_config(M, N, K, sms)
            num_kb = -(-K // 128)
            tiles = -(-M // c.block_m) * -(-N // c.block_n)
            assert c.block_m >= min(M, 64) and c.block_n == 64 and not c.fuse_quant, (M, N, K, c)
            assert c.split == 1 or tiles * c.split <= PROGRAMS_PER_SM * sms, (M, N, K, c)
            min_kb = MIN_KB_PER_SPLIT_SMALL if c.block_m == 16 else MIN_KB_PER_SPLIT
            assert c.split == 1 or num_kb // c.split >= min_kb, (M, N, K, c)
            assert (c.split in (MAX_SPLIT, num_kb // min_kb)
                    or tiles * (c.split + 1) > PROGRAMS_PER_SM * sms), (M, N, K, c)
            assert c.num_stages == (4 if c.block_m == 16 and num_kb // c.split >= MIN_KB_PER_SPLIT else 3)
    # the sweeps' fastest (or within 4%) at these shapes: (M, N, K) -> splits (64 / 256 rows: 2026-12-02;
    # 4 rows: bench/data/fp8-gemm/decode-small-h200-2026-12-07.json)
    for (M, N, K), split in {(64, 2048, 6144): 4, (64, 6144, 16384): 4, (64, 16384, 2048): 1, (64, 576, 6144): 4,
                             (256, 2048, 6144): 3, (256, 6144, 16384): 1, (4, 6144, 2048): 4, (4, 2752, 6144): 8,
                             (4, 2048, 6144): 8, (4, 576, 6144): 8, (4, 20480, 2048): 1, (4, 6144, 16384): 4}.items():
        assert splitk_config(M, N, K, sms).split == split, (M, N, K)


@interp
def test_tile_counters_grow_and_keep_the_old_buffer_interp():
    cpu = torch.device("cpu")
    first = _tile_counters(cpu, 10)
    bigger = _tile_counters(cpu, first.numel() + 1)
    assert bigger.numel() > first.numel() and not bigger.any() and _tile_counters(cpu, 10) is bigger


@interp
def test_w8a8_gemm_bf16_and_empty_interp():
    check_gemm(9, 96, 200, torch.bfloat16, "cpu", tol=1e-2, cos_min=0.9999)
    wq, ws = quantize_weight_ref(torch.randn(64, 128))
    assert w8a8_block_fp8_matmul(torch.zeros(0, 128), wq, ws).shape == (0, 64)


@interp
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "nan_padded"])
def test_quant_act_matches_ref_bit_for_bit_interp(layout):
    gen = torch.Generator().manual_seed(1)
    x = _activation(21, 300, torch.float32, "cpu", gen, layout)
    x[3, :128] = 0.0  # an all-zero block
    q, s = quant_act(x)
    qr, sr = quant_act_ref(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    assert not torch.isnan(q.float()).any()


def test_launcher_rejects_bad_scales():
    wq, ws = quantize_weight_ref(torch.randn(200, 300))
    with pytest.raises(ValueError, match="weight_scale_inv must be fp32"):
        w8a8_block_fp8_matmul(torch.randn(4, 300), wq, ws[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_block_fp8_matmul(torch.randn(4, 300), wq.float(), ws)


def make_fp8_moe(T, H, inner, E, k, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    gate = torch.randn(E, inner, H, generator=gen) * H ** -0.5
    up = torch.randn(E, inner, H, generator=gen) * H ** -0.5
    down = torch.randn(E, H, inner, generator=gen) * inner ** -0.5
    (qg, sg), (qu, su), (q2, s2) = (quantize_weight_ref(t) for t in (gate, up, down))
    w13, s13 = torch.cat([qg, qu], 1), merge_gate_up_scales(sg, su)
    weights, ids = route_ref(torch.randn(T, E, generator=gen), torch.randn(E, generator=gen) * 0.1, k, scaling=2.5)
    fp8 = [t.to(device) for t in (w13, s13, q2, s2)]
    return x.to(device), fp8, (torch.cat([gate, up], 1), down), weights.to(device), ids.to(device)


def check_fp8_moe(T, H, inner, E, k, device, offset=0, num_local=None, dtype=torch.float32, tol=1e-3,
                  cos_min=0.99999, config=None):
    x, (w13, s13, w2, s2), (w13_f, w2_f), weights, ids = make_fp8_moe(T, H, inner, E, k, device)
    lo, n = offset, num_local or E
    local = [t[lo: lo + n] for t in (w13, s13, w2, s2)]
    got = fused_moe_fp8(x.to(dtype), *local, weights, ids, offset, config=config)
    want = fused_moe_fp8_ref(x.to(dtype).float(), *local, weights, ids, offset).cpu()
    assert got.shape == (T, H) and got.dtype == dtype and not torch.isnan(got).any()
    g = got.float().cpu()
    scale = want.abs().max().clamp(min=1e-6)
    err = ((g - want).abs().max() / scale).item()
    assert err <= tol, f"fused_moe_fp8 differs by {err:.3g} of the output scale"
    live = want.norm(dim=-1) > 0
    if live.any():
        cos = torch.nn.functional.cosine_similarity(g[live], want[live], dim=-1).min().item()
        assert cos >= cos_min, cos
    exact = fused_moe_ref(x.float().cpu(), w13_f[lo: lo + n], w2_f[lo: lo + n], weights.cpu(), ids.cpu(), offset)
    assert ((want - exact).abs().max() / scale).item() <= 0.15, "quantization error too large: a scale is misapplied"


@interp
@pytest.mark.parametrize("T,H,inner,offset,num_local", [(13, 200, 160, 0, None), (29, 256, 128, 2, 4),
                                                         (1, 130, 96, 0, None)])
def test_fused_moe_fp8_interp(T, H, inner, offset, num_local):
    check_fp8_moe(T, H, inner, E=8, k=2, device="cpu", offset=offset, num_local=num_local)


def check_prequantized_rows(device):
    """Rows quantized elsewhere (the static EP dispatch quantizes at home, strided inside its gathered buffer) give
    the bits of quantizing here; a mis-shaped pair is refused."""
    from kernels.fp8_quant import quant_act

    x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(11, 256, 128, 8, 2, device)
    x = x.to(torch.bfloat16)
    xq, xs = quant_act(x)
    pad = torch.zeros(11, 8, dtype=torch.uint8, device=device)
    buf = torch.cat([xq.view(torch.uint8), xs.view(torch.uint8), pad], 1)
    q, s = buf[:, :256].view(xq.dtype), buf[:, 256:264].view(torch.float32)
    want = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids)
    got = fused_moe_fp8(x.new_zeros(()).expand(11, 256), w13, s13, w2, s2, weights, ids, x_quantized=(q, s))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="x_quantized"):
        fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, x_quantized=(q[:5], s[:5]))


@interp
def test_fused_moe_fp8_takes_rows_quantized_elsewhere_interp():
    check_prequantized_rows("cpu")


@interp
def test_fused_moe_fp8_nothing_local_interp():
    x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(5, 64, 32, 8, 2, "cpu")
    assert torch.all(fused_moe_fp8(x, w13[:2], s13[:2], w2[:2], s2[:2], weights, ids, expert_offset=100) == 0)


@interp
def test_fused_moe_fp8_launches_each_gemm_its_own_way_interp():
    """A 6-tuple config launches the up and down GEMMs with their own settings (down column tile 32 here, 16
    rows, H not a multiple of either) and gives the reference's result; other lengths are refused."""
    check_fp8_moe(11, 200, 160, E=8, k=2, device="cpu", config=(16, 4, 1, 32, 2, 1))
    x, (w13, s13, w2, s2), _, weights, ids = make_fp8_moe(3, 64, 32, 4, 2, "cpu")
    with pytest.raises(ValueError, match="4 or 6 entries"):
        fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, config=(16, 32, 4))


def test_fused_moe_fp8_tile_follows_the_rows_per_expert(monkeypatch):
    """The compiled kernel's tiles by assignments per local expert (the H200 sweeps in bench/data/fp8-gemm/NOTES.md):
    16 rows up to 4 (B <= 4 with MTP3 over 32 experts), 32 up to 16, 64 beyond, 128 from 64 (prefill)."""
    import kernels.fp8_moe as fp8_moe

    monkeypatch.setattr(fp8_moe, "interpreting", lambda: False)
    picks = {n: fp8_moe._config(n, 32)[0] for n in (8, 32, 128, 129, 512, 513, 2048, 2049)}
    assert picks == {8: 16, 32: 16, 128: 16, 129: 32, 512: 32, 513: 64, 2048: 128, 2049: 128}
    # between those, the up and down GEMMs launch apart (the split sweep): down on 128-column tiles with 4 warps
    for n in (512, 1024):
        _, (up_warps, _), (down_n, down_warps, _) = fp8_moe._launches(fp8_moe._config(n, 32))
        assert down_n == 128 and down_warps == 4 and up_warps in (4, 8)


@pytest.mark.parametrize("M,N,K", [(8192, 2048, 6144), (64, 6144, 2048), (256, 24576, 6144), (1, 576, 6144),
                                   (300, 1000, 1100)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_w8a8_gemm_gpu(M, N, K, mark):
    check_gemm(M, N, K, torch.bfloat16, "cuda", tol=2e-2, cos_min=0.9999)
    check_gemm(M, N, K, torch.bfloat16, "cuda", "transposed", tol=2e-2, cos_min=0.9999,
               config=SplitKConfig(64, 64, 2, fuse_quant=False) if M <= 256 else (128, 256, 1, 8, 3))
    check_gemm(min(M, 77), N, K, torch.bfloat16, "cuda", "nan_padded", tol=2e-2, cos_min=0.9999)


GLM_DECODE = [(2048, 6144), (576, 6144), (16384, 2048), (6144, 16384), (24576, 6144), (6144, 12288),
              (4096, 6144), (6144, 2048), (4096, 2048)]  # (N, K): q_a, kv_a, q_b, o, dense gate+up / down, ...


@pytest.mark.parametrize("M", [1, 16, 64, 100, 256])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_splitk_gemm_glm_decode_gpu(M, mark):
    """The decode path at GLM-5.3's projection shapes: the launcher's pick, its prequantized twin, and
    forced splits (8, 3) on every layout; reruns give the same bits."""
    for N, K in GLM_DECODE:
        pick = splitk_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
        x, wq, ws, got = check_gemm(M, N, K, torch.bfloat16, "cuda", tol=2e-2, cos_min=0.9999, config=pick)
        assert torch.equal(w8a8_block_fp8_matmul(x, wq, ws, config=pick), got), f"[{M},{N},{K}] {pick}: a rerun differs"
        check_gemm(M, N, K, torch.bfloat16, "cuda", "transposed", tol=2e-2, cos_min=0.9999,
                   config=SplitKConfig(pick.block_m, pick.block_n, 8, fuse_quant=False))
        check_gemm(M, N, K, torch.bfloat16, "cuda", "nan_padded", tol=2e-2, cos_min=0.9999,
                   config=SplitKConfig(pick.block_m, 128, 3))
    assert not _COUNTERS[torch.device("cuda", 0)].any(), "every launch leaves its tile counters at zero"


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_splitk_gemm_cuda_graph_gpu(mark, monkeypatch):
    """Captured after one eager call, replays of the decode path give the eager bits for new inputs, for
    several projections in one graph (they share the tile counters)."""
    import kernels.fp8_gemm

    monkeypatch.setattr(kernels.fp8_gemm, "SPLITK_DECODE", True)
    gen = torch.Generator().manual_seed(5)
    shapes = [(2048, 6144), (576, 6144), (6144, 12288)]  # each split at 64 rows (splitk_config)
    weights = [quantize_weight_ref(torch.randn(N, K, generator=gen).cuda() * K ** -0.5) for N, K in shapes]
    xs = [torch.randn(64, K, generator=gen).cuda().bfloat16() for _, K in shapes]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for x, (wq, ws) in zip(xs, weights):
        assert splitk_config(64, wq.shape[0], wq.shape[1], sms).split > 1  # the partials are exercised
        w8a8_block_fp8_matmul(x, wq, ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [w8a8_block_fp8_matmul(x, wq, ws) for x, (wq, ws) in zip(xs, weights)]
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=gen).cuda().bfloat16())
        graph.replay()
        for x, (wq, ws), out in zip(xs, weights, outs):
            assert torch.equal(out, w8a8_block_fp8_matmul(x, wq, ws)), "a graph replay differs from eager"
            want = w8a8_block_fp8_matmul_ref(x.float(), wq, ws, torch.float32)
            assert ((out.float() - want).abs().max() / want.abs().max()).item() <= 2e-2
    torch.cuda.synchronize()
    assert not _COUNTERS[torch.device("cuda", 0)].any()


@pytest.mark.parametrize("T", [7, 64, 2048])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_fused_moe_fp8_gpu(T, mark):
    check_prequantized_rows("cuda")
    check_fp8_moe(T, H=2048, inner=256, E=32, k=8, device="cuda", dtype=torch.bfloat16, tol=2e-2, cos_min=0.999)
    check_fp8_moe(T, H=200, inner=160, E=16, k=4, device="cuda", offset=4, num_local=8, tol=2e-2, cos_min=0.999)


def check_dequant(N, K, dtype, device):
    from kernels.fp8_absorbed import dequantize_fp8, dequantize_fp8_ref

    gen = torch.Generator().manual_seed(3)
    wq, ws = quantize_weight_ref(torch.randn(N, K, generator=gen))
    wq = _poisoned_fp8(wq.to(device), (3, 64))  # strided view, NaN bytes beside it
    got = dequantize_fp8(wq, ws.to(device), dtype)
    want = dequantize_fp8_ref(wq.cpu(), ws, dtype)
    assert got.dtype == dtype and torch.equal(got.cpu(), want), "dequantization must match bit for bit"


@interp
@pytest.mark.parametrize("N,K", [(448 * 3, 200), (100, 64)])
def test_dequantize_fp8_interp(N, K):
    check_dequant(N, K, torch.bfloat16, "cpu")
    check_dequant(N, K, torch.float32, "cpu")


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_dequantize_fp8_gpu(mark):
    check_dequant(64 * 448, 512, torch.bfloat16, "cuda")
