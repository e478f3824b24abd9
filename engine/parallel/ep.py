"""Expert parallelism: the routed experts are partitioned over the ranks (rank r holds experts
[r·E/N, (r+1)·E/N)); tokens travel to the ranks owning their experts and back by all-to-all. The same
dispatcher serves PCP × EP prefill (each rank's own rows) and DP × EP decode (each rank's own requests).

    home rank:    route own tokens -> one copy per (token, destination rank), sorted by destination,
                  with the token's expert ids and weights alongside -> all-to-all (x, ids | weights)
    expert rank:  run its experts on each received row: the weighted sum over the row's experts that
                  live here (ids of other ranks are skipped) -> one partial output per row
    home rank:    all-to-all the partials back -> sum them per token in rank order

Bytes per MoE layer: every (token, destination rank) pair moves H values out, H values back and 2k
32-bit words of ids and weights (tags ep_dispatch, ep_combine, ep_meta), plus N counts (ep_counts):
a token with several experts on one rank travels once, not once per expert.

Exactness: with top-2 routing (or both of a token's experts on one rank) the sum is a + b in either
order, the same bits as one rank holding every expert; with a larger top-k the partials are summed in
rank order, which equals the single-rank order up to fp32 rounding.
"""

from __future__ import annotations

import torch

from engine.parallel.dist import RankComm


def expert_shard(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, num_local) of `rank`'s experts."""
    if num_experts % world_size:
        raise ValueError(f"expert parallelism needs n_routed_experts ({num_experts}) divisible by the number of "
                         f"ranks ({world_size})")
    n = num_experts // world_size
    return rank * n, n


def dispatch_pairs(ids: torch.Tensor, num_local: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination rank, token) of every (token, destination rank) pair, sorted by rank then token."""
    to = torch.zeros((ids.shape[0], world_size), dtype=torch.bool, device=ids.device)
    to.scatter_(1, ids.long() // num_local, True)
    rank, tok = to.t().nonzero(as_tuple=True)
    return rank, tok


class AllToAllDispatcher:
    """`MoE.dispatcher`: (x [T, H], weights [T, k], ids [T, k], local experts) -> routed output [T, H]."""

    def __init__(self, comm: RankComm, num_experts: int):
        self.comm = comm
        self.num_experts = num_experts
        self.offset, self.num_local = expert_shard(num_experts, comm.rank, comm.world_size)

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        """Each received row through its experts on this rank, weighted -> [rows, H]."""
        n = x.shape[0]
        if x.device.type == "cpu":
            # MKL picks its GEMM kernel, and so the last bit, by the row count of the padded expert batch
            # (fused_moe_ref: [experts, tallest expert's rows, H]). One rank holding every expert uses the
            # tallest expert's rows over all ranks: pad the local tallest expert to that many (zero rows,
            # dropped after) so EP gives that rank's bits. Every rank joins the max, rows or not.
            local = ids - self.offset
            local = local[(local >= 0) & (local < self.num_local)]
            counts = torch.bincount(local, minlength=self.num_local) if local.numel() else None
            local_max = int(counts.max()) if counts is not None else 0
            pad = self.comm.all_reduce_max(local_max, "ep_rows") - local_max
            if pad > 0 and counts is not None:
                pad_ids = ids.new_full((pad, ids.shape[1]), self.num_experts)  # past every rank's experts
                pad_ids[:, 0] = self.offset + int(counts.argmax())
                x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
                ids = torch.cat([ids, pad_ids])
                weights = torch.cat([weights, weights.new_zeros((pad, weights.shape[1]))])
        return experts(x, weights, ids)[:n]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        T, k = ids.shape
        world = self.comm.world_size
        dest, tok = dispatch_pairs(ids, self.num_local, world)
        send_counts = torch.bincount(dest, minlength=world).tolist()
        recv_counts = self.comm.exchange_counts(send_counts, "ep_counts")
        meta = torch.cat([ids.to(torch.int32), weights.float().view(torch.int32)], dim=1)[tok]
        x_recv = self.comm.all_to_all(x[tok], send_counts, recv_counts, "ep_dispatch")
        meta_recv = self.comm.all_to_all(meta, send_counts, recv_counts, "ep_meta")
        ids_recv = meta_recv[:, :k].long()
        w_recv = meta_recv[:, k:].contiguous().view(torch.float32)
        y_recv = self._run_experts(x_recv, w_recv, ids_recv, experts)
        y = self.comm.all_to_all(y_recv, recv_counts, send_counts, "ep_combine")
        out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float())
        return out.to(x.dtype)
