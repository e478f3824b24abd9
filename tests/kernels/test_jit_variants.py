"""Kernels launched every step need one compiled variant whatever the step's row count (kernels/jit_variants.py).

A new variant compiles on the GPU in the middle of serving (0.5-2 s each); a row count that Triton specialises on
(1, a multiple of 16, other) triples a kernel's variants. Counted under the interpreter with Triton's own binder.
"""

from __future__ import annotations

import pytest
import torch

from kernels.indexer import indexer_topk
from kernels.indexer_fused import FusedConfig
from kernels.jit_variants import count_variants
from kernels.merge import merge_attn_states
from kernels.moe_routing import align_by_expert_many, align_by_expert_small
from kernels.store_kv import gather_rows, store_rows
from kernels.topk_threshold import SelectConfig
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
        for i, n in enumerate(ROWS):
            x = torch.randn(n, 576)
            slots = torch.randperm(8 * 64)[i:i + n]  # slots that start anywhere in a step's buffer
            store_rows(x[:, :512], x[:, 512:], cache, slots, 128)
            gather_rows(cache, slots, 512, 64, 128)
    assert v.counts() == {"_store_rows_kernel": 1, "_gather_rows_kernel": 1}, v.varying()


def test_the_indexer_query_quantisation_needs_one_variant_for_any_row_count():
    """Its staging buffer's block size is a constexpr of the store kernel: one block of T x H rows compiled a
    variant per batch on the GPU (226 variants in a served minute, bench/data/simulate/NOTES.md)."""
    from kernels.formats import quantize_index_q_ref
    from kernels.indexer import quantize_index_q

    with count_variants() as v:
        for n in ROWS:
            q = torch.randn(n, 4, 64)
            codes, scales = quantize_index_q(q)
            want_codes, want_scales = quantize_index_q_ref(q)
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
            assert torch.equal(scales, want_scales)
    assert v.counts() == {"_store_rows_kernel": 1}, v.varying()


def test_sparse_mla_needs_one_variant_for_any_batch_selection_and_table():
    from tests.kernels.test_sparse_mla import check_positions

    with count_variants() as v:
        for B, K in ((1, 40), (2, 48), (3, 33), (4, 64)):  # rows, entries, splits' lengths and table widths vary
            check_positions(B=B, H=4, K=K, R=128, P=16, block_size=16, device="cpu", num_splits=3)
    assert v.counts()["_sparse_mla_kernel"] == 1, v.varying()
    # the splits' merge: a variant per power of two of splits (a constexpr; the warm-up's batch classes meet them)
    assert set(v.varying().get("_merge_kernel", {})) <= {"BLOCK_N"}, v.varying()


@pytest.mark.parametrize("parts", [2, 3])
def test_the_attention_merge_needs_one_variant_for_any_row_count(parts):
    with count_variants() as v:
        for n in ROWS:
            merge_attn_states(torch.randn(parts, n, 4, 64), torch.randn(parts, n, 4))
    assert v.counts() == {"_merge_kernel": 1}, v.varying()


def test_the_expert_sort_needs_one_variant_per_power_of_two_of_assignments():
    """The one-program sort's block sizes follow the assignments' power of two (a constexpr: the warm-up meets each
    bucket); within a bucket, and for the counting sort at any size, one variant."""
    with count_variants() as v:
        for tokens in (5, 6, 7, 8):  # 2 experts each: 10-16 assignments, one bucket of 16
            align_by_expert_small(torch.randint(0, 32, (tokens, 2)), 32, 0, 16)
        for tokens in (1, 16, 17, 100, 333):
            align_by_expert_many(torch.randint(0, 32, (tokens, 8)), 32, 0, 16)
    assert v.counts()["_align_kernel"] == 1, v.varying()
    for name in ("_count_kernel", "_place_kernel"):
        assert v.counts()[name] == 1, v.varying()
    # the offsets' block count's power of two is a constexpr too (a warm-up's bucket); nothing else varies
    assert set(v.varying().get("_offsets_kernel", {})) <= {"BLOCK_B"}, v.varying()


def test_the_indexer_top_k_needs_one_variant_for_any_batch_and_context():
    from tests.kernels.test_indexer import make_batch

    cfg = FusedConfig(block_t=1, block_n=16, num_stages=1, keys_per_prog=32,
                      select=SelectConfig(group=4, sum_cap=64, gcap=64, cap=64, scan=32, block=32, programs=1))
    with count_variants() as v:
        # block tables of 7, 9, 17, 6 and 16 blocks a row: a row stride of 16 is a class of its own unless unspecialised
        for seq_lens, k in (([100], 24), ([130, 77, 99], 16), ([257, 70, 71, 72, 73], 24), ([80] * 16 + [91], 17),
                            ([250, 60], 24)):
            bt = make_batch("fp8", seq_lens, [[n - 1] for n in seq_lens], 16, 32, 16, spare_blocks=2, device="cpu")
            indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, k, max_seq_len=max(seq_lens),
                         query_start_loc_cpu=bt.qsl, seq_lens_cpu=bt.seq_lens, return_slots=False, impl="fused",
                         config=cfg)
    assert v.counts()["_fused_scores_kernel"] == 1 and v.counts()["_select_kernel"] == 1, v.varying()


def test_the_indexer_scores_need_two_tile_heights_for_any_rows_per_request():
    """MTP decodes score 1-4 rows a request: a tile height per power of two of the rows was a variant that the
    warm-up's decodes (4 rows, then 1) did not meet and traffic's 2-row steps compiled (an H100, 2026-12-06)."""
    from tests.kernels.test_indexer import make_batch

    cfg = FusedConfig(block_t=4, block_n=16, num_stages=1, keys_per_prog=32,
                      select=SelectConfig(group=4, sum_cap=64, gcap=64, cap=64, scan=32, block=32, programs=1))
    with count_variants() as v:
        for rows in (1, 2, 3, 4, 2, 1):
            seq_lens = [90, 100]
            pos = [list(range(n - rows, n)) for n in seq_lens]
            bt = make_batch("fp8", seq_lens, pos, 16, 32, 16, spare_blocks=2, device="cpu")
            indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, 24, max_seq_len=max(seq_lens),
                         query_start_loc_cpu=bt.qsl, seq_lens_cpu=bt.seq_lens, return_slots=False, impl="fused",
                         config=cfg)
    assert v.counts()["_fused_scores_kernel"] == 2, v.varying()  # one row a request, or the config's height


def test_the_counter_needs_the_interpreter(monkeypatch):
    import kernels.jit_variants as jv

    monkeypatch.setattr(jv, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="interpreter"), jv.count_variants():
        pass
