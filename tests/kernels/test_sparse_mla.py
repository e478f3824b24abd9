"""sparse_mla_decode / sparse_mla_prefill against sparse_mla_ref (computed in fp32 on the same inputs)."""

from __future__ import annotations

import pytest
import torch

from kernels.formats import mla_row_bytes
from kernels.sparse_mla import sparse_mla, sparse_mla_decode, sparse_mla_prefill, sparse_mla_ref
from kernels.store_kv import store_kv_ref
from tests.helpers.kernel_inputs import (
    assert_attention_close,
    block_tables,
    gpu,
    interp,
    poisoned_cache,
    randn,
    slots_of,
)

CACHE = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_cache(kind: str, seq_lens: list[int], R: int, P: int, block_size: int, device, gen):
    """Rows for every position of each request, in shuffled blocks of a NaN-poisoned strided layer view."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    row = mla_row_bytes(R, P) if kind == "fp8" else R + P
    _, cache = poisoned_cache(num_blocks, block_size, row, CACHE[kind], device)
    table = block_tables(seq_lens, block_size, num_blocks, gen, device)
    for b, S in enumerate(seq_lens):
        pos = torch.arange(S, device=device)
        store_kv_ref(randn(gen, S, R, device=device, scale=2.0), randn(gen, S, P, device=device), cache,
                     slots_of(table[b], pos, block_size))
    return cache, table


def pick(gen, S: int, K: int, device) -> torch.Tensor:
    """K distinct positions of [0, S) (fewer when S < K), -1 padded and shuffled in."""
    sel = torch.full((K,), -1, dtype=torch.int64)
    n = min(S, K - K // 8)
    sel[:n] = torch.randperm(S, generator=gen)[:n]
    return sel[torch.randperm(K, generator=gen)].to(device)


def check_decode(kind: str, B: int, Sq: int, H: int, K: int, R: int, P: int, block_size: int, device,
                 num_splits=None, q_dtype=torch.bfloat16, config=None, kernel=None):
    gen = torch.Generator().manual_seed(B * 1000 + H * 10 + Sq)
    seq_lens = [K // 2 + 7 * b for b in range(B)]  # some requests shorter than K: padded rows
    cache, table = make_cache(kind, seq_lens, R, P, block_size, device, gen)
    idx = torch.stack([torch.stack([slots_of(table[b], pick(gen, seq_lens[b], K, device).clamp(min=0), block_size)
                                    for _ in range(Sq)]) for b in range(B)])
    pad = torch.stack([torch.stack([pick(gen, seq_lens[b], K, device) for _ in range(Sq)]) for b in range(B)]) < 0
    idx = idx.masked_fill(pad, -1).to(torch.int32)
    idx[0, -1] = -1  # a row with nothing selected: out 0, lse -inf
    q = randn(gen, B, Sq, H + 3, R + P, dtype=q_dtype, device=device)[:, :, 1: H + 1]  # non-contiguous heads
    scale = (R + P) ** -0.5
    if config is None and kernel is None:
        out, lse = sparse_mla_decode(q, cache, idx, scale, R, num_splits=num_splits)
    else:
        out, lse = sparse_mla(q, cache, idx, scale, R, num_splits=num_splits, config=config, kernel=kernel)
    ref_out, ref_lse = sparse_mla_ref(q.float(), cache, idx, scale, R, P)
    assert out.shape == (B, Sq, H, R) and out.dtype == q.dtype and lse.shape == (B, Sq, H)
    assert_attention_close(out, lse, ref_out, ref_lse)


def check_prefill(kind: str, T: int, H: int, K: int, R: int, P: int, device, q_dtype=torch.bfloat16,
                  kernel=None):
    gen = torch.Generator().manual_seed(T + H + K)
    S = 3 * K
    if kind == "workspace":
        kv = randn(gen, S, R + P, dtype=torch.bfloat16, device=device, scale=2.0)
        idx = torch.stack([pick(gen, S, K, device) for _ in range(T)])
    else:
        kv, table = make_cache(kind, [S], R, P, 16, device, gen)
        pos = torch.stack([pick(gen, S, K, device) for _ in range(T)])
        idx = torch.where(pos >= 0, slots_of(table[0], pos.clamp(min=0), 16), -1)
    idx = idx.to(torch.int32)
    idx[T // 2] = -1  # zero-length row
    q = randn(gen, H, T, R + P, dtype=q_dtype, device=device).transpose(0, 1)  # [T, H, D], non-contiguous
    if kernel is None:
        out, lse = sparse_mla_prefill(q, kv, idx, 0.0625, R)
    else:
        out, lse = sparse_mla(q, kv, idx, 0.0625, R, num_splits=1, kernel=kernel)
    ref_out, ref_lse = sparse_mla_ref(q.float(), kv, idx, 0.0625, R, P)
    assert_attention_close(out, lse, ref_out, ref_lse)


def check_positions(B: int, H: int, K: int, R: int, P: int, block_size: int, device, num_splits=None,
                    trim: bool = True):
    """Request positions mapped through the block table inside the kernel == the same rows given as slots."""
    gen = torch.Generator().manual_seed(B * 7 + K)
    seq_lens = [K + 5 * b for b in range(B)]
    cache, table = make_cache("fp8", seq_lens, R, P, block_size, device, gen)
    req = torch.tensor([b for b in range(B) for _ in range(1 + b % 2)], dtype=torch.int32, device=device)
    pos = torch.stack([pick(gen, seq_lens[b], K, device) for b in req.tolist()])
    pos[-1] = -1  # a row with nothing selected
    slots = torch.where(pos >= 0, torch.stack([slots_of(table[b], pos[t].clamp(min=0), block_size)
                                               for t, b in enumerate(req.tolist())]), -1)
    q = randn(gen, len(req), H, R + P, dtype=torch.bfloat16, device=device)
    out, lse = sparse_mla(q, cache, pos.to(torch.int32), 0.1, R, num_splits=num_splits,
                          block_table=table.to(torch.int32), token_req_idx=req, trim=trim)
    ref_out, ref_lse = sparse_mla_ref(q.float(), cache, slots, 0.1, R, P)
    assert_attention_close(out, lse, ref_out, ref_lse)


@interp
@pytest.mark.parametrize("splits", [1, 3])
def test_positions_through_the_block_table_interp(splits):
    check_positions(B=3, H=4, K=40, R=128, P=16, block_size=16, device="cpu", num_splits=splits)


@interp
def test_positions_need_a_paged_cache_and_request_rows_interp():
    _, cache = poisoned_cache(2, 16, mla_row_bytes(128, 16), torch.uint8, "cpu")
    q = torch.randn(2, 4, 144).bfloat16()
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="token_req_idx"):
        sparse_mla(q, cache, idx, 0.1, 128, block_table=torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_positions_through_the_block_table_gpu(mark):
    check_positions(B=33, H=64, K=2048, R=512, P=64, block_size=64, device="cuda")


@interp
@pytest.mark.parametrize("Sq,H,splits", [(1, 5, 1), (2, 3, None), (4, 16, 3)])
def test_decode_fp8_interp(Sq, H, splits):
    check_decode("fp8", B=3, Sq=Sq, H=H, K=40, R=128, P=16, block_size=16, device="cpu", num_splits=splits)


@interp
def test_padding_never_reads_a_poisoned_page_interp():
    """-1 entries must not pull in slot 0's page (here unused and NaN): neither kernel nor reference."""
    gen = torch.Generator().manual_seed(5)
    _, cache = poisoned_cache(3, 16, mla_row_bytes(128, 16), torch.uint8, "cpu")
    store_kv_ref(randn(gen, 16, 128), randn(gen, 16, 16), cache, torch.arange(16, 32))  # only block 1
    idx = torch.tensor([[[16, 20, -1, 31, -1]]], dtype=torch.int32)
    q = randn(gen, 1, 1, 4, 144, dtype=torch.bfloat16)
    out, lse = sparse_mla_decode(q, cache, idx, 0.1, 128)
    ref_out, ref_lse = sparse_mla_ref(q.float(), cache, idx, 0.1, 128, 16)
    assert_attention_close(out, lse, ref_out, ref_lse)


@interp
def test_decode_several_head_blocks_interp():
    # 20 heads in blocks of 16 (what 17-32 heads use on the GPU), the last one partly masked
    check_decode("fp8", B=2, Sq=1, H=20, K=24, R=128, P=16, block_size=16, device="cpu", num_splits=2,
                 config=(16, 16, 4, 1, True))


@interp
@pytest.mark.parametrize("kind,q_dtype", [("workspace", torch.bfloat16), ("fp8", torch.float32),
                                          ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_prefill_interp(kind, q_dtype):
    check_prefill(kind, T=6, H=3, K=24, R=64, P=32, device="cpu", q_dtype=q_dtype)


@interp
def test_empty_selection_interp():
    _, cache = poisoned_cache(2, 16, mla_row_bytes(128, 16), torch.uint8, "cpu")
    q = torch.randn(2, 1, 4, 144).bfloat16()
    out, lse = sparse_mla_decode(q, cache, torch.zeros(2, 1, 0, dtype=torch.int32), 0.1, 128)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    with pytest.raises(ValueError, match="same rows"):
        sparse_mla_decode(q, cache, torch.zeros(3, 1, 4, dtype=torch.int32), 0.1, 128)


@pytest.mark.parametrize("B,Sq,H", [(16, 4, 64), (3, 1, 64), (32, 1, 8), (2, 4, 5)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_decode_fp8_gpu(B, Sq, H, mark):
    check_decode("fp8", B=B, Sq=Sq, H=H, K=2048, R=512, P=64, block_size=64, device="cuda")


@pytest.mark.parametrize("kind,q_dtype", [("workspace", torch.bfloat16), ("fp8", torch.bfloat16),
                                          ("fp32", torch.float32)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_prefill_gpu(kind, q_dtype, mark):
    check_prefill(kind, T=128, H=64, K=2048, R=512, P=64, device="cuda", q_dtype=q_dtype)


def check_trim(B: int, Sq: int, H: int, K: int, R: int, P: int, block_size: int, device, splits):
    """`trim` (stop after each row's last valid index) gives the untrimmed kernel's bits: rows shorter than K
    with their positions first and -1 after (what the indexer writes), rows with -1 anywhere, a full row and an
    empty one; and both match the fp32 reference."""
    gen = torch.Generator().manual_seed(B + K + Sq)
    seq_lens = [K // 3 + 5 * b for b in range(B - 1)] + [2 * K]
    cache, table = make_cache("fp8", seq_lens, R, P, block_size, device, gen)
    rows = []
    for b in range(B):
        for s in range(Sq):
            n = min(seq_lens[b], K)
            sel = torch.full((K,), -1, dtype=torch.int64)
            sel[:n] = torch.randperm(seq_lens[b], generator=gen)[:n].sort().values
            if s % 2:  # -1 anywhere, the last valid entry before the end
                sel = sel[torch.randperm(K, generator=gen)]
                sel[-3:] = -1
            sel = sel.to(device)
            rows.append(torch.where(sel >= 0, slots_of(table[b], sel.clamp(min=0), block_size), -1))
    idx = torch.stack(rows).view(B, Sq, K).to(torch.int32)
    idx[0, 0] = -1  # nothing selected
    q = randn(gen, B, Sq, H, R + P, dtype=torch.bfloat16, device=device)
    trimmed = sparse_mla(q, cache, idx, 0.1, R, num_splits=splits, trim=True)
    full = sparse_mla(q, cache, idx, 0.1, R, num_splits=splits, trim=False)
    assert torch.equal(trimmed[0], full[0]) and torch.equal(trimmed[1], full[1])
    ref_out, ref_lse = sparse_mla_ref(q.float(), cache, idx, 0.1, R, P)
    assert_attention_close(trimmed[0], trimmed[1], ref_out, ref_lse)


@interp
@pytest.mark.parametrize("splits", [1, 3])
def test_trim_gives_the_same_bits_interp(splits):
    check_trim(B=3, Sq=2, H=4, K=48, R=128, P=16, block_size=16, device="cpu", splits=splits)


@interp
@pytest.mark.parametrize("trim", [False, True])
def test_trim_through_the_block_table_interp(trim):
    check_positions(B=3, H=4, K=40, R=128, P=16, block_size=16, device="cpu", num_splits=2, trim=trim)


@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_trim_gives_the_same_bits_gpu(splits, mark):
    check_trim(B=17, Sq=4, H=64, K=2048, R=512, P=64, block_size=64, device="cuda", splits=splits)
