"""The decode path of the w8a8 block-scaled FP8 GEMM (kernels.fp8_gemm): split K, quantize in the prologue.

At decode M (batch x (1 + drafts) <= 256 rows) the GEMM streams the weight and does little else, but a
narrow weight has few output tiles: q_a_proj (2048 x 6144) has 16 of 128 columns, kv_a_proj 5, for 132
multiprocessors. So the grid is (output tiles, K splits): program (t, s) owns tile t's contiguous k-blocks
[s * kb // S, (s + 1) * kb // S) and every multiprocessor streams a slice of the weight.

    grid axis 0: tile t = pid_n * num_m + pid_m (the row tiles of a column tile are neighbours: one weight
                 read from HBM serves them all through L2)
    grid axis 1: split s; each writes its fp32 partial tile, then counts itself in for tile t
    the split that counts S (the last to arrive, whichever it is) adds the S partials in split order
    0..S-1 (unrolled 16 rows at a time, so its loads overlap), writes the output tile in its dtype and sets
    the count back to 0

One launch, and deterministic: the sum's order does not depend on which split finished last, so a graph
replay, an eager call and a rerun give the same bits (the engine's GPU tests of graph against eager
decoding assume it).
fp32 atomics into the output would need a zeroed fp32 buffer, a cast launch and an arrival order that
changes the bits from run to run. The price is the last split reading S partial tiles (S x BLOCK_M x
BLOCK_N x 4 B from L2), which `splitk_config` keeps small by bounding S.

The counters are a persistent int32 buffer per device, zero between launches (each launch resets what it
counted), so no memset and no data-dependent allocation: a CUDA graph captures the launch as one kernel
node with the partials in its own memory pool. Launches sharing the counters must not run concurrently
(one stream, as the engine's forward and its graph replays are).

The activation comes quantized by `quant_act` (a launch before this one: `splitk_config` sets
fuse_quant=False), or, with fuse_quant, is quantized per token per 128 channels in the prologue of each
k-block: the program loads the [BLOCK_M, 128] slice of x it multiplies anyway. Every column tile repeats
that work; on the H200 the fused form measured 1.0-4x slower than the separate launch at every GLM-5.3
decode shape and split (BENCHMARKS.md, "FP8 block-scaled weights"), so it stays an option the benchmark
sweeps, not the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_support import interpreting, jit, next_pow2, quant_e4m3_rows

MAX_M = 256  # rows up to which kernels.fp8_gemm takes this path
MAX_SPLIT = 8  # bounds the last split's reads (S partial tiles); the H200 sweep never chose more
MIN_KB_PER_SPLIT = 12  # a split streams >= 12 k-blocks (H200 sweep: shorter splits lose to the partials' cost)
# at <= 16 rows (one 16-row tile) the partials are small and >= 4 k-blocks a split win (H200 sweep at 4 and 16 rows:
# shared down 9.3 against 13.4 us, packed x 10.9 against 12.4, q_a 9.9 against 11.8); there a split that still
# streams >= MIN_KB_PER_SPLIT k-blocks takes 4 pipeline stages (o_proj 32.6 against 34.1 us, dense gate+up 45.3
# against 48.1)
MIN_KB_PER_SPLIT_SMALL = 4
PROGRAMS_PER_SM = 3  # splits stop at 3 programs per multiprocessor (H200 sweep: 4 x 96 tiles won, 6 x 96 lost)


@dataclass(frozen=True)
class SplitKConfig:
    """One launch of the decode path: tile, K splits, warps, pipeline stages, activation quantized inside."""

    block_m: int
    block_n: int
    split: int
    num_warps: int = 4
    num_stages: int = 3
    fuse_quant: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SplitKConfig.{name} must be a power of two >= 16, got {v}")
        if self.split < 1:
            raise ValueError(f"SplitKConfig.split must be >= 1, got {self.split}")


def splitk_config(M: int, N: int, K: int, num_sms: int) -> SplitKConfig:
    """The launch for one decode problem on a GPU with `num_sms` multiprocessors, fitted to the H200 sweep of
    `python -m bench.kernels.fp8_gemm --decode-only` (every GLM-5.3 projection at M = 64 and 256; the pick
    is within 4% of the sweep's fastest at 17 of the 20 shapes and within 11% at all).

    Rows: one tile of the next power of two up to 64 (M = 256: four row tiles, one weight read from HBM).
    Columns: 64 (64-column tiles beat 128 at 19 of 20 shapes). Splits: as many as keep the grid within
    PROGRAMS_PER_SM programs per multiprocessor, at most MAX_SPLIT, with >= MIN_KB_PER_SPLIT k-blocks each
    (MIN_KB_PER_SPLIT_SMALL at <= 16 rows, where long splits also take 4 stages: the sweep at 4 and 16 rows);
    a grid of 3 x num_sms tiles or more is not split. The activation is quantized by `quant_act` first."""
    block_m = min(64, max(16, next_pow2(M)))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, 64)
    num_kb = triton.cdiv(K, 128)
    min_kb = MIN_KB_PER_SPLIT_SMALL if block_m == 16 else MIN_KB_PER_SPLIT
    split = max(1, min(PROGRAMS_PER_SM * num_sms // tiles, MAX_SPLIT, num_kb // min_kb))
    stages = 4 if block_m == 16 and num_kb // split >= MIN_KB_PER_SPLIT else 3
    return SplitKConfig(block_m, 64, split, num_stages=stages, fuse_quant=False)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still point at one


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's arrival counters, at least n of them, all zero."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the FP8 split-K GEMM needs {n} tile counters on {device} and is being captured: "
                               "run the same shapes once outside the capture first (the engine's warm-up does)")
        if c is not None:
            _RETIRED.append(c)
        c = _COUNTERS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return c


@jit
def _splitk_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, num_kb,
                   sx_m, sx_k, sxs_m, sw_n, sws_n, so_m, sp_s, sp_m,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, QUANT_A: tl.constexpr,
                   DOT_F32: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """out[m, n] = sum over k-blocks of (x_q[m] . w[n]) * x_s[m, kb] * w_s[n // 128, kb], this program's
    k-blocks only; SPLIT > 1: through the partial tiles and the tile's counter (module docstring).

    QUANT_A: x is the unquantized activation (any float dtype, strides sx_m / sx_k), quantized here as
    `quant_act` does; otherwise x holds e4m3 codes (unit k stride) and xs their scales."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % num_m
    pid_n = tile // num_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * sx_m
    w_rows = w_ptr + n[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(split * num_kb // SPLIT, (split + 1) * num_kb // SPLIT):
        k = kb * 128 + tl.arange(0, 128)
        k_ok = k < K
        if QUANT_A:
            xv = tl.load(x_rows + k[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            a, a_s = quant_e4m3_rows(xv, ROUND_FIRST)
            a = a.to(tl.float8e4nv, bitcast=True)
        else:
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a_s = tl.load(xs_ptr + m.to(tl.int64) * sxs_m + kb, mask=m_ok, other=0.0)
        b = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCK_N <= 128:  # the tile lies in one 128-row block of the weight: one scale per k-block
            b_s = tl.load(ws_ptr + ((pid_n * BLOCK_N) // 128).to(tl.int64) * sws_n + kb)
            acc += part * (a_s * b_s)[:, None]
        else:
            b_s = tl.load(ws_ptr + (n // 128).to(tl.int64) * sws_n + kb, mask=n_ok, other=0.0)
            acc += part * a_s[:, None] * b_s[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + m[:, None].to(tl.int64) * so_m + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        offs = m[:, None].to(tl.int64) * sp_m + n[None, :]
        tl.store(part_ptr + split.to(tl.int64) * sp_s + offs, acc, mask=m_ok[:, None] & n_ok[None, :])
        tl.debug_barrier()  # every thread's partial is written before the count releases them
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            # Unrolled, 16 rows at a time: a chunk's SPLIT loads are in flight together (a loop over the
            # splits would wait for L2 once per split), added in split order: the same bits every run.
            for r in tl.static_range(0, BLOCK_M, 16):
                mr = pid_m * BLOCK_M + r + tl.arange(0, 16)
                mask = (mr < M)[:, None] & n_ok[None, :]
                chunk = mr[:, None].to(tl.int64) * sp_m + n[None, :]  # not `offs`: a name keeps one shape in Triton
                total = tl.zeros([16, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(part_ptr + s * sp_s + chunk, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + mr[:, None].to(tl.int64) * so_m + n[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
            tl.store(cnt_ptr + tile, 0)


def splitk_gemm(a: torch.Tensor, a_s: torch.Tensor | None, b: torch.Tensor, b_s: torch.Tensor,
                out_dtype: torch.dtype, config: SplitKConfig) -> torch.Tensor:
    """Launch on checked operands (kernels.fp8_gemm.w8a8_block_fp8_matmul checks them): a is x itself when
    a_s is None (quantized in the kernel), else e4m3 codes with unit k stride and a_s their scales;
    b float8_e4m3fn [N, K] with unit k stride, b_s its fp32 block scales with unit column stride."""
    M, K = a.shape
    N = b.shape[0]
    num_kb = triton.cdiv(K, 128)
    split = max(1, min(config.split, num_kb))
    num_m = triton.cdiv(M, config.block_m)
    tiles = num_m * triton.cdiv(N, config.block_n)
    if split * M * N >= 1 << 31:
        raise ValueError(f"the decode path's {split} partial tiles of [{M}, {N}] overflow its 32-bit offsets: "
                         "use fewer splits, or the prefill kernel at this M")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
        counters = _tile_counters(a.device, tiles)
    else:
        part = counters = out  # unread
    a_s_arg = a_s if a_s is not None else b_s  # unread with QUANT_A
    _splitk_kernel[(tiles, split)](
        a, a_s_arg, b, b_s, out, part, counters, M, N, K, num_kb, a.stride(0), a.stride(1),
        a_s_arg.stride(0), b.stride(0), b_s.stride(0), out.stride(0), part.stride(0), part.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT=split, QUANT_A=a_s is None,
        DOT_F32=interpreting(), ROUND_FIRST=interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
