"""The decode GEMM's split-K kernel compiles for the H200 at the launches the engine makes.

Triton's interpreter, which runs the kernel in every other CPU test, accepted a partial-sum loop the
compiler rejects; this builds the cubin itself (tests/helpers/sm90.py)."""

from __future__ import annotations

import pytest

from tests.helpers.sm90 import compile_sm90, nvidia_backend

pytestmark = pytest.mark.skipif(not nvidia_backend(), reason="Triton without its NVIDIA backend")


def test_splitk_kernel_compiles_for_sm90():
    out = compile_sm90('''
        from kernels.fp8_gemm import DECODE_MAX_M
        from kernels.fp8_splitk import _splitk_kernel, splitk_config

        ints = "M N K num_kb sx_m sx_k sxs_m sw_n sws_n so_m sp_s sp_m".split()
        shapes = [(2048, 6144), (576, 6144), (16384, 2048), (6144, 16384), (24576, 6144), (4096, 2048)]
        picks = {splitk_config(M, N, K, 132) for M in (1, 16, 64, DECODE_MAX_M) for N, K in shapes}
        # every tile the launcher picks (e4m3 codes from quant_act), with one split and with several (the
        # partial sums), then the activation quantized in the kernel (fuse_quant) on 128-column tiles
        jobs = {(c.block_m, c.block_n, s, c.fuse_quant) for c in picks for s in (1, 8)}
        jobs |= {(16, 128, 2, True), (64, 128, 1, True)}
        for bm, bn, split, quant in sorted(jobs):
            sig = {"x_ptr": "*bf16" if quant else "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                   "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                   **{k: "i32" for k in ints}}
            const = dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, QUANT_A=quant, DOT_F32=False, ROUND_FIRST=False)
            print(bm, bn, split, quant, build(_splitk_kernel, sig, const, num_warps=4, num_stages=3))
    ''')
    builds = [line.split() for line in out.splitlines()]
    assert len(builds) >= 6 and all(len(b) == 5 and int(b[4]) > 0 for b in builds), out  # tile, split, cubin bytes
