"""Context-parallel arithmetic without processes: DualChunkSwap, DCP placement, merges, global top-k."""

from __future__ import annotations

import pytest
import torch

from engine.config.engine import ParallelConfig
from engine.kv.manager import KVCacheManager
from engine.parallel.dcp import (
    dcp_slot_fn,
    global_position,
    local_index,
    local_topk_candidates,
    merge_scales,
    merge_topk_candidates,
    num_local,
    owner_rank,
    token_locations,
)
from engine.parallel.pcp import dualchunk_ranges, plan_step_rows
from kernels.indexer import topk_positions_ref
from kernels.merge import merge_attn_states_ref
from tests.helpers.kv_pages import KVPageMap


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 127, 1000])
@pytest.mark.parametrize("N", [1, 2, 4, 8])
def test_dualchunk_covers_once_and_balances(n, N):
    size = -(-n // (2 * N))
    seen = []
    for r in range(N):
        ranges = dualchunk_ranges(n, N, r)
        for lo, hi in ranges:
            assert lo < hi and lo % size == 0
            assert lo // size in (r, 2 * N - 1 - r)
            seen.extend(range(lo, hi))
        assert sum(hi - lo for lo, hi in ranges) <= 2 * size
    assert sorted(seen) == list(range(n))


def test_row_plan_gather_index_restores_step_order():
    counts = [1, 3, 7, 127, 2]
    N = 4
    plans = [plan_step_rows(counts, N, r, "cpu") for r in range(N)]
    T = sum(counts)
    assert sorted(row for p in plans for row in p.own_rows) == list(range(T))
    p = plans[0]
    padded = torch.full((N, p.max_rows), -1)
    for r in range(N):  # what an all-gather of every rank's own row ids gives
        padded[r, : plans[r].num_own] = torch.tensor(plans[r].own_rows)
    assert padded.flatten()[p.gather_index].tolist() == list(range(T))
    sub = p.subset([5, 6, 100])
    assert sorted(r for rows in sub.rows_of_rank for r in rows) == [0, 1, 2]


@pytest.mark.parametrize("N,I", [(1, 1), (2, 1), (4, 1), (2, 16), (4, 64), (8, 4)])
def test_dcp_placement_round_trip_and_counts(N, I):
    pos = torch.arange(3000)
    rank, j = owner_rank(pos, N, I), local_index(pos, N, I)
    for r in range(N):
        mine = pos[rank == r]
        assert torch.equal(global_position(j[rank == r], r, N, I), mine)
        assert torch.equal(j[rank == r], torch.arange(mine.numel()))  # dense local sequence
        for L in (0, 1, 63, 64, 65, 1000, 2999):
            assert num_local(L, r, N, I) == int((rank[:L] == r).sum())


@pytest.mark.parametrize("N,I", [(2, 1), (4, 64), (4, 8)])
def test_slot_fn_matches_virtual_blocks_of_the_kv_manager(N, I):
    L = 1000
    kv = KVCacheManager(num_blocks=32, block_size=64, dcp_size=N)
    assert kv.blocks_needed(L) == -(-L // (64 * N))
    block_ids = [7, 3, 11, 5, 9, 2, 4, 8, 1, 6, 10, 12, 13, 14, 15, 16][: kv.blocks_needed(L)]
    ranks, slots = token_locations(L, block_ids, N, I, 64)
    per_rank_slots = []
    for r in range(N):
        got = dcp_slot_fn(r, N, I)(block_ids, range(L), 64)
        mine = ranks == r
        assert torch.equal(torch.tensor(got)[mine], slots[mine])
        assert all(s == -1 for s, m in zip(got, mine.tolist()) if not m)
        per_rank_slots.append(slots[mine])
        assert set((slots[mine] // 64).tolist()) <= set(block_ids)
    for s in per_rank_slots:  # no two tokens of a rank share a slot
        assert s.unique().numel() == s.numel()


def test_kv_page_map_ranks_and_replicas():
    m = KVPageMap("r", 250, (4, 9), 64, 2, 1, 2)
    pos0, _ = m.rank_tokens(0)
    pos1, _ = m.rank_tokens(1)
    assert pos0.tolist() == list(range(0, 250, 2)) and pos1.tolist() == list(range(1, 250, 2))
    assert m.rank_blocks(0) == [4, 9] and not m.replicated
    rep = KVPageMap("r", 100, (3, 5), 64, 1, 1, 2)
    assert rep.replicated and rep.rank_tokens(1)[0].numel() == 100 and rep.rank_blocks(1) == [3, 5]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_distributed_scaled_sum_equals_reference_merge(dtype, tol):
    """ag_rs sums exp(lse_r - lse)·out_r over the ranks; with empty shards and all-masked rows."""
    g = torch.Generator().manual_seed(0)
    N, T, H, D = 4, 9, 3, 16
    outs = torch.randn(N, T, H, D, generator=g).to(dtype)
    lses = torch.randn(N, T, H, generator=g) * 3
    lses[1] = float("-inf")  # rank 1 holds nothing
    lses[:, 4] = float("-inf")  # row 4: nothing selected anywhere
    lses[2, 6, 1] = float("-inf")
    ref_out, ref_lse = merge_attn_states_ref(outs, lses)
    scale, lse = merge_scales(lses)
    out = sum(outs[r].float() * scale[r][..., None] for r in range(N))
    assert torch.allclose(out, ref_out.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-5)
    assert torch.all(out[4] == 0)


@pytest.mark.parametrize("N,I", [(2, 1), (4, 1), (4, 16), (3, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_global_topk_from_candidates_equals_single_rank(N, I, ties):
    g = torch.Generator().manual_seed(N * 10 + I)
    S, topk = 300, 16
    positions = torch.tensor([5, 15, 16, 17, 40, 150, 299])
    scores = torch.randn(len(positions), S, generator=g)
    if ties:  # coarse scores: many exact ties, broken towards the lower position
        scores = (scores * 2).round()
    ref = topk_positions_ref(scores, positions, topk)
    pos = torch.arange(S)
    cand_s, cand_p = [], []
    for r in range(N):
        mine = pos[owner_rank(pos, N, I) == r]
        local = scores[:, mine].masked_fill(mine[None, :] > positions[:, None], float("-inf"))
        s, p = local_topk_candidates(local, mine, topk)
        cand_s.append(s)
        cand_p.append(p)
    got = merge_topk_candidates(torch.stack(cand_s), torch.stack(cand_p), topk)
    for t in range(len(positions)):  # same set (order is irrelevant to attention)
        assert sorted(got[t][got[t] >= 0].tolist()) == sorted(ref[t][ref[t] >= 0].tolist())
        assert int((got[t] >= 0).sum()) == min(topk, int(positions[t]) + 1)


def test_parallel_config_validation(tiny_ckpt):
    from engine.config.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        ParallelConfig(prefill_context_parallel_size=4, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="dcp_comm_backend"):
        ParallelConfig(dcp_comm_backend="ring")
    with pytest.raises(ValueError, match="interleave"):
        ParallelConfig(cp_kv_cache_interleave_size=3)
    with pytest.raises(ValueError, match="n_routed_experts"):  # tiny has 8 experts
        EngineArgs(model=str(tiny_ckpt), prefill_context_parallel_size=3,
                   enable_expert_parallel=True).create_engine_config()
    ok = EngineArgs(model=str(tiny_ckpt), prefill_context_parallel_size=4, decode_context_parallel_size=4,
                    enable_expert_parallel=True, dcp_comm_backend="a2a").create_engine_config()
    assert ok.parallel.world_size == 4
