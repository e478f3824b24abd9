"""The EP dispatcher alone over real gloo ranks: one copy per (token, destination rank), outputs equal to
one rank holding every expert, counters that say so."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel.dist import DistEnv, RankComm, free_port
from engine.parallel.ep import AllToAllDispatcher, dispatch_pairs, expert_shard
from kernels.moe import fused_moe_ref

pytestmark = pytest.mark.xdist_group("cp")

E, H, INNER = 8, 32, 16


class _Experts:
    def __init__(self, w13, w2, offset):
        self.w13, self.w2, self.offset = w13, w2, offset

    def __call__(self, x, weights, ids, assignments=None):
        return fused_moe_ref(x, self.w13, self.w2, weights, ids, self.offset)


def _weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * INNER, H, generator=g) * 0.2, torch.randn(E, H, INNER, generator=g) * 0.2


def _inputs(rank: int, k: int):
    """Rank r's tokens (rank 1 has none when k == 3: the dummy batch of an idle DP rank)."""
    T = 0 if (k == 3 and rank == 1) else 5 + 3 * rank
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()
    w = torch.rand(T, k, generator=g)
    return x, w, ids


def _rank(rank: int, world: int, port: int, k: int, out_q) -> None:
    comm = RankComm(DistEnv(rank, world, 0, "127.0.0.1", port), torch.device("cpu"))
    try:
        w13, w2 = _weights()
        off, n = expert_shard(E, rank, world)
        disp = AllToAllDispatcher(comm, E)
        x, w, ids = _inputs(rank, k)
        got = disp(x, w, ids, _Experts(w13[off:off + n], w2[off:off + n], off))
        out_q.put((rank, got.tolist(), dict(comm.bytes)))  # plain data: the process may leave first
    finally:
        comm.shutdown()


def _run(world: int, k: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, k, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = {}
    for _ in range(world):
        rank, got, counters = q.get(timeout=120)
        res[rank] = (torch.tensor(got, dtype=torch.float32).reshape(-1, H), counters)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return res


@pytest.mark.parametrize("world,k", [(2, 2), (2, 3), (4, 4)])
def test_one_copy_per_token_and_rank(world, k):
    res = _run(world, k)
    n = E // world
    # one rank holding every expert, on all ranks' tokens at once (the batch the expert GEMMs see)
    inputs = [_inputs(r, k) for r in range(world)]
    w13, w2 = _weights()
    want_all = fused_moe_ref(torch.cat([i[0] for i in inputs]), w13, w2, torch.cat([i[1] for i in inputs]),
                             torch.cat([i[2] for i in inputs]))
    at = 0
    pairs_to = [0] * world  # (token, destination) pairs of every rank, by destination
    for r in range(world):
        x, _, ids = _inputs(r, k)
        dest, tok = dispatch_pairs(ids, n, world)
        assert len(set(zip(dest.tolist(), tok.tolist()))) == len(dest)  # no pair twice
        assert len(dest) == len({(t, int(e) // n) for t, row in enumerate(ids.tolist()) for e in row})
        for d in dest.tolist():
            pairs_to[d] += 1
        got, counters = res[r]
        want, at = want_all[at:at + len(x)], at + len(x)
        if k == 2:  # a + b in either order: the bits of one rank holding all experts
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert counters["ep_dispatch"] == pairs_to_me(r, world, k) * H * 4
        assert counters["ep_meta"] == pairs_to_me(r, world, k) * 2 * k * 4
        assert counters["ep_combine"] == len(dest) * H * 4
    sends_per_expert = sum(_inputs(r, k)[2].numel() for r in range(world))
    assert sum(pairs_to) < sends_per_expert  # duplicates on one rank travel once


def pairs_to_me(rank: int, world: int, k: int) -> int:
    n = E // world
    return sum(int((dispatch_pairs(_inputs(r, k)[2], n, world)[0] == rank).sum()) for r in range(world))


# ---- the static dispatch (decode's planned passes) against the dynamic one --------------------------------
SE, SK = 32, 8  # top-8 of 32 experts: 16 local on 2 ranks, 8 on 4


def _static_inputs(rank: int, world: int):
    """Rank 0: 6 tokens; rank 1: none (idle); rank 2: 4 tokens whose experts all live at home; rank 3: 3."""
    n_local = SE // world
    T = {0: 6, 1: 0, 2: 4, 3: 3}[rank]
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T, H, generator=g)
    if rank == 2:
        ids = torch.stack([rank * n_local + torch.randperm(n_local, generator=g)[:SK] for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(SE, generator=g)[:SK] for _ in range(T)]) if T else torch.zeros(0, SK).long()
    return x, torch.rand(T, SK, generator=g), ids


def _static_rank(rank: int, world: int, port: int, out_q) -> None:
    from engine.parallel.ep import StaticDispatcher

    comm = RankComm(DistEnv(rank, world, 0, "127.0.0.1", port), torch.device("cpu"))
    try:
        g = torch.Generator().manual_seed(11)
        w13, w2 = torch.randn(SE, 2 * INNER, H, generator=g) * 0.2, torch.randn(SE, H, INNER, generator=g) * 0.2
        off, n = expert_shard(SE, rank, world)
        experts = _Experts(w13[off:off + n], w2[off:off + n], off)
        x, w, ids = _static_inputs(rank, world)
        dynamic = AllToAllDispatcher(comm, SE)(x, w, ids, experts)
        comm.reset_counters()
        # the planned pass: 8 rows per rank; this rank's static batch has its real rows, then one padding row
        # (invalid: slot -1) with garbage ids, then the dispatcher pads to 8
        static = StaticDispatcher(comm, SE)
        static.rows = 8
        xp = torch.cat([x, torch.randn(1, H)])
        idp = torch.cat([ids, torch.arange(SK)[None]])
        wp = torch.cat([w, torch.ones(1, SK)])
        static.row_valid = torch.arange(len(xp)) < len(x)
        got = static(xp, wp, idp, experts)
        out_q.put((rank, dynamic.tolist(), got[:len(x)].tolist(), got.shape[0], dict(comm.bytes)))
    finally:
        comm.shutdown()


@pytest.mark.parametrize("world", [2, 4])
def test_static_dispatch_equals_the_dynamic_one_row_for_row(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_static_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = {}
    for _ in range(world):
        rank, dyn, got, rows, counters = q.get(timeout=120)
        res[rank] = (dyn, got, rows, counters)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    W = H * 4 + 2 * SK * 4  # one packed row: x (fp32), then k ids and k weights (32 bits each)
    for r in range(world):
        dyn, got, rows, counters = res[r]
        T = len(_static_inputs(r, world)[0])
        assert rows == T + 1 and len(got) == T
        assert got == dyn  # bit for bit, padding, idle ranks and stay-at-home ranks included
        assert counters["ep_dispatch"] == world * 8 * W  # every rank's 8 rows, fixed: no counts exchanged
        assert counters["ep_combine"] == world * 8 * H * 4
        assert "ep_counts" not in counters
