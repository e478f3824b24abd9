"""bench.kernels.fp8_gemm --norm-quant on the CPU (Triton's interpreter, small shapes): both ways of feeding the
projection after a norm are timed, and the row says what each costs against copy bandwidth."""

from __future__ import annotations

import pytest
import torch

from bench.kernels.fp8_gemm import NORM_FED, SHAPES, bench_norm_quant
from tests.helpers.kernel_inputs import interp


@interp
def test_a_norm_fed_projection_is_timed_with_and_without_the_norms_quantization():
    row = bench_norm_quant(torch.device("cpu"), {"copy_tbps": 1.0}, "small", 4, 128, 256)
    assert row["M"] == 4 and row["config"]["block_m"] > 0
    for key in ("norm_us", "norm_quant_us", "separate_us", "fused_us"):
        assert row[key] > 0, key
    assert row["saved_us"] == row["separate_us"] - row["fused_us"]
    assert row["fused_frac_copy_bw"] == pytest.approx(128 * 256 / (row["fused_us"] * 1e-6) / 1e12)  # bytes/s / copy
    assert set(NORM_FED) <= {name for name, _, _ in SHAPES}


@interp
def test_the_absorbed_matmuls_are_timed_both_ways():
    from bench.kernels.fp8_gemm import bench_absorbed

    row = bench_absorbed(torch.device("cpu"), 4, H=2, nope=64, v=64, R=128, ceil={"copy_tbps": 1.0})
    for key in ("bf16_uk_us", "fp8_dequant_uk_uv_us", "fp8_in_place_uk_us", "fp8_in_place_uv_us",
                "fp8_in_place_uk_uv_us"):
        assert row[key] > 0, key
    assert row["fp8_bytes"] == 2 * 128 * 128 and row["fp8_in_place_frac_copy_bw"] == pytest.approx(
        row["fp8_bytes"] / (row["fp8_in_place_uk_uv_us"] * 1e-6) / 1e12)
