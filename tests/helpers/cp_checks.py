"""Functions the CP engine tests run on every rank (MultiRankEngineCore.collective_rpc)."""

from __future__ import annotations

import torch

from engine.parallel.dcp import MERGES
from kernels.merge import merge_attn_states_ref


def check_merges(runner, seed: int) -> dict:
    """Both DCP merges over the real process group against the reference merge of all partials.

    Every rank builds the same random partials (one per rank, rank-major rows padded per rank), with an
    empty shard (rank 1 selected nothing), rows masked everywhere, and a rank owning no rows; returns
    {(dtype, backend): (max |out - ref|, lse -inf pattern equal, max |lse - ref| on finite rows)}.
    """
    comm = runner.comm
    N, r = comm.world_size, comm.rank
    own_rows = [(3, 0, 5, 2, 1, 4, 2, 3)[k] for k in range(N)]
    max_rows, H, D = max(own_rows), 4, 32
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        outs = torch.randn(N, N * max_rows, H, D, generator=g).to(dtype)
        lses = torch.randn(N, N * max_rows, H, generator=g) * 4
        lses[1 % N] = float("-inf")  # an empty shard
        lses[:, ::3] = float("-inf")  # rows with nothing selected on any rank
        lo, n = r * max_rows, own_rows[r]
        ref_o, ref_l = merge_attn_states_ref(outs[:, lo: lo + n], lses[:, lo: lo + n])
        for name, merge in MERGES.items():
            o, l = merge(comm, outs[r], lses[r], max_rows, n)
            fin = torch.isfinite(ref_l)
            lse_err = float((l[fin] - ref_l[fin]).abs().max()) if bool(fin.any()) else 0.0
            out[(str(dtype), name)] = (float((o.float() - ref_o.float()).abs().max()) if n else 0.0,
                                       bool(torch.equal(torch.isinf(l), torch.isinf(ref_l))), lse_err,
                                       tuple(o.shape))
    return out
