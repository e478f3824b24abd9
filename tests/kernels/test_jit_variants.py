"""Kernels launched every step need one compiled variant whatever the step's row count (kernels/jit_variants.py).

A new variant compiles on the GPU in the middle of serving (0.5-2 s each); a row count that Triton specialises on
(1, a multiple of 16, other) triples a kernel's variants. Counted under the interpreter with Triton's own binder.
"""

from __future__ import annotations

import pytest
import torch

from kernels.jit_variants import count_variants
from kernels.merge import merge_attn_states
from kernels.store_kv import gather_rows, store_rows
from kernels.triton_support import jit, tl  # kernels first: it picks the interpreter before Triton loads

ROWS = (1, 5, 16, 17, 32, 33, 64)


@jit
def _specialised_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def test_the_counter_sees_a_row_count_that_is_specialised():
    with count_variants() as v:
        for n in ROWS:
            x = torch.arange(n, dtype=torch.float32)
            y = torch.empty_like(x)
            _specialised_copy[(1,)](x, y, n, BLOCK=64)
            assert torch.equal(x, y)  # the kernel still ran
    assert v.counts() == {"_specialised_copy": 3}  # n == 1, n % 16 == 0, neither
    assert v.varying() == {"_specialised_copy": {"n": ["('constexpr', 1)", "('i32', '')", "('i32', 'D')"]}}


def test_kv_row_stores_and_gathers_need_one_variant_for_any_row_count():
    cache = torch.zeros(8, 64, 656, dtype=torch.uint8)  # fp8_ds_mla rows: 512 codes + 4 scales + 64 bf16 rope
    with count_variants() as v:
        for n in ROWS:
            x = torch.randn(n, 576)
            slots = torch.randperm(8 * 64)[:n]
            store_rows(x[:, :512], x[:, 512:], cache, slots, 128)
            gather_rows(cache, slots, 512, 64, 128)
    assert v.counts() == {"_store_rows_kernel": 1, "_gather_rows_kernel": 1}, v.varying()


@pytest.mark.parametrize("parts", [2, 3])
def test_the_attention_merge_needs_one_variant_for_any_row_count(parts):
    with count_variants() as v:
        for n in ROWS:
            merge_attn_states(torch.randn(parts, n, 4, 64), torch.randn(parts, n, 4))
    assert v.counts() == {"_merge_kernel": 1}, v.varying()


def test_the_counter_needs_the_interpreter(monkeypatch):
    import kernels.jit_variants as jv

    monkeypatch.setattr(jv, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="interpreter"), jv.count_variants():
        pass
