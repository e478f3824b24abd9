"""Indexer: scores against index_scores_ref, and top-k exact for the scores the kernel computed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.indexer import (
    gather_index_k_ref,
    index_scores,
    index_scores_ref,
    indexer_topk,
    indexer_topk_ref,
    store_index_k_ref,
    topk_positions_ref,
)
from kernels.topk import topk_rows
from tests.helpers.kernel_inputs import as_sets, block_tables, gpu, interp, poisoned_cache, randn, slots_of


@dataclass
class Batch:
    q: torch.Tensor
    w: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor
    req: torch.Tensor
    pos: torch.Tensor
    qsl: list
    seq_lens: list


def make_batch(mode: str, seq_lens: list[int], rows: list[list[int]], H: int, D: int, block_size: int,
               spare_blocks: int, device, seed: int = 0) -> Batch:
    """Keys for every position of every request in shuffled blocks of a NaN-poisoned cache; query rows
    at the given positions (grouped per request, like the runner's flattened batch)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    row = D + 4 if mode == "fp8" else D
    _, cache = poisoned_cache(num_blocks, block_size, row, torch.uint8 if mode == "fp8" else torch.float32, device)
    table = block_tables(seq_lens, block_size, num_blocks, gen, device)
    for b, S in enumerate(seq_lens):
        pos = torch.arange(S, device=device)
        store_index_k_ref(randn(gen, S, D, device=device), cache, slots_of(table[b], pos, block_size))
    pos = torch.tensor([p for r in rows for p in r], dtype=torch.int64, device=device)
    req = torch.tensor([b for b, r in enumerate(rows) for _ in r], dtype=torch.int32, device=device)
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + len(r))
    q = randn(gen, len(pos), 2 * H, D, device=device)[:, ::2]  # non-contiguous heads
    w = randn(gen, len(pos), H, device=device) + 0.3  # mostly positive, some negative weights
    return Batch(q, w, cache, table, req, pos, qsl, seq_lens)


def ref_scores(bt: Batch, S: int) -> torch.Tensor:
    """index_scores_ref over each row's own request, fp8 queries quantised as the kernel does."""
    from kernels.formats import quantize_index_q_ref
    D = bt.q.shape[-1]
    q, w = bt.q, bt.w
    if bt.cache.dtype == torch.uint8:
        q, scale = quantize_index_q_ref(q)
        w = w * scale
    out = torch.full((len(bt.pos), S), float("-inf"), device=q.device)
    for t in range(len(bt.pos)):
        b, n = int(bt.req[t]), int(bt.pos[t]) + 1
        slots = slots_of(bt.table[b], torch.arange(n, device=q.device), bt.cache.shape[1])
        kv, ks = gather_index_k_ref(bt.cache, slots, D)
        out[t, :n] = index_scores_ref(q[t: t + 1], w[t: t + 1], kv, ks)[0]
    return out


def assert_topk_near(sel: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, k: int, eps: float) -> None:
    """Selections that differ from the exact top-k of `scores` only between near-ties of the k-th score."""
    exact = as_sets(topk_positions_ref(scores, pos, k))
    for t, (got, want) in enumerate(zip(as_sets(sel), exact)):
        assert len(got) == len(want), f"row {t}: {len(got)} selected, expected {len(want)}"
        if got != want:
            kth = scores[t, want].min()
            gap = max((scores[t, list(set(got) ^ set(want))] - kth).abs().max().item(), 0.0)
            assert gap <= eps * scores[t, : int(pos[t]) + 1].abs().max().item(), f"row {t}: not a near-tie"


def check_indexer(mode: str, seq_lens, rows, H, D, topk, block_size, device, eps: float, impl: str | None = None):
    bt = make_batch(mode, seq_lens, rows, H, D, block_size, spare_blocks=3, device=device)
    S = max(seq_lens)
    got = index_scores(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, S, impl=impl)
    want = ref_scores(bt, S)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), "scores past a row's position must stay -inf"
    scale = want.masked_fill(~fin, 0).abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    err = ((got - want).masked_fill(~fin, 0).abs() / scale).max().item()
    assert err <= eps, f"scores differ by {err:.3g} of the row scale"
    # exact top-k of the kernel's own scores (same tiling: no host layout), as positions and as slots
    sel = indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, return_slots=False, impl=impl)
    assert as_sets(sel) == as_sets(topk_positions_ref(got, bt.pos, topk)), "top-k is not exact for its scores"
    valid = sel >= 0
    assert torch.all(valid[:, :-1] >= valid[:, 1:]), "valid entries must come first"
    slots = indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, impl=impl)
    for t in range(len(bt.pos)):
        expect = slots_of(bt.table[int(bt.req[t])], sel[t][valid[t]], block_size)
        assert torch.equal(slots[t][valid[t]].long(), expect) and torch.all(slots[t][~valid[t]] == -1)
    # with the runner's host layout (multi-row tiles, unscored short requests) and the reference entry point
    width = min(topk, S)
    fast = indexer_topk(bt.q, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, return_slots=False, max_seq_len=S,
                        query_start_loc_cpu=bt.qsl, seq_lens_cpu=bt.seq_lens, out_width=width, impl=impl)
    assert fast.shape == (len(bt.pos), width)
    assert_topk_near(fast, want, bt.pos, topk, eps)
    q_in, q_scale = bt.q, None
    if mode == "fp8":
        from kernels.formats import quantize_index_q_ref
        q_in, q_scale = quantize_index_q_ref(bt.q)
    ref_slots = indexer_topk_ref(q_in, bt.w, bt.cache, bt.table, bt.req, bt.pos, topk, q_scale=q_scale)
    assert_topk_near(slots_to_positions(slots, bt), want, bt.pos, topk, eps)
    assert_topk_near(slots_to_positions(ref_slots, bt), want, bt.pos, topk, eps)


def slots_to_positions(slots: torch.Tensor, bt: Batch) -> torch.Tensor:
    """Inverse of each row's block table (slot -> position of its request), -1 kept."""
    bs = bt.cache.shape[1]
    out = torch.full_like(slots, -1)
    for b, S in enumerate(bt.seq_lens):
        pos = torch.arange(S, device=slots.device)
        inverse = torch.full((bt.cache.shape[0] * bs,), -1, dtype=slots.dtype, device=slots.device)
        inverse[slots_of(bt.table[b], pos, bs)] = pos.to(slots.dtype)
        mine = (bt.req == b)[:, None] & (slots >= 0)
        out = torch.where(mine, inverse[slots.clamp(min=0).long()], out)
    return out


@interp
@pytest.mark.parametrize("mode,impl", [("fp8", "fused"), ("fp8", "radix"), ("fp32", None)])
def test_indexer_interp(mode, impl):
    rows = [[3, 20, 60, 140, 145, 149], [30, 33, 36], [8]]  # a chunk, an MTP-style verify, a short request
    check_indexer(mode, [150, 37, 9], rows, H=16, D=32, topk=24, block_size=16, device="cpu", eps=1e-5, impl=impl)


def check_topk_rows(device, n_max: int, k: int, block_size: int):
    gen = torch.Generator().manual_seed(k)
    T = 7
    s = randn(gen, T, n_max, device=device)
    s[1] = torch.randint(0, 5, (n_max,), generator=gen).float().to(device)  # heavy ties
    s[2] = -s[2].abs()  # all negative
    s[3, ::2], s[3, 1::2] = 0.0, -0.0  # +0 and -0 tie
    s[4] = s[4].round()
    pos = torch.tensor([n_max - 1, n_max - 2, n_max // 2, n_max - 1, k, k - 1, 0], device=device)
    out = torch.full((T, k), 1234, dtype=torch.int32, device=device)
    topk_rows(s, pos, k, out)
    assert as_sets(out) == as_sets(topk_positions_ref(s, pos, k))
    assert torch.all(out[5, : k] == torch.arange(k, dtype=torch.int32, device=device))  # n == k: all, in order
    assert torch.all(out[6, 1:] == -1) and out[6, 0] == 0


@interp
def test_topk_rows_interp():
    check_topk_rows("cpu", n_max=700, k=50, block_size=16)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_topk_rows_gpu(mark):
    check_topk_rows("cuda", n_max=131072, k=2048, block_size=64)


@pytest.mark.parametrize("mode,impl", [("fp8", "fused"), ("fp8", "radix"), ("fp32", None)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_indexer_gpu(mode, impl, mark):
    # 128K-token cache: a 64-row prefill chunk deep into a 100K prompt, a 4-row verify at 28K, a short request
    rows = [list(range(100_000 - 64, 100_000)), [28_000, 28_001, 28_002, 28_003], [1000]]
    check_indexer(mode, [100_000, 28_004, 1001], rows, H=32, D=128, topk=2048, block_size=64, device="cuda",
                  eps=1e-2 if mode == "fp8" else 1e-5, impl=impl)
