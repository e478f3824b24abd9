"""Expert parallelism: the routed experts are partitioned over the ranks (rank r holds experts
[r·E/N, (r+1)·E/N)); each token-expert assignment travels to the expert's rank and back by all-to-all.

    home rank:    route own tokens -> group assignments by destination rank -> all-to-all (x, expert id)
    expert rank:  run its experts on what it received (one expert per row, weight 1)
    home rank:    all-to-all the outputs back -> weighted sum in the single-rank order (by expert id)

Summing the per-assignment outputs at home in the order `fused_moe_ref` uses makes EP give the same
bits as one rank holding all experts. (A token with two experts on the same rank is sent twice; a
deduplicating dispatch would send it once — an optimisation for the GPU path.)
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


class AllToAllDispatcher:
    """`MoE.dispatcher`: (x [T, H], weights [T, k], ids [T, k], local experts) -> routed output [T, H]."""

    def __init__(self, comm: RankComm, num_experts: int):
        self.comm = comm
        self.num_local = expert_shard(num_experts, comm.rank, comm.world_size)[1]

    def _run_experts(self, x: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        """Each received row through its one expert, weight 1 (exact: the weighting happens at home)."""
        n = x.shape[0]
        if x.device.type == "cpu":
            # MKL picks its GEMM kernel, and so the last bit, by the row count of the padded expert batch
            # (fused_moe_ref: [experts, tallest expert's rows, H]). One rank holding every expert uses the
            # tallest expert's rows over all ranks: pad the local tallest expert to that many (zero rows,
            # dropped after) so EP gives that rank's bits. Every rank joins the max, rows or not.
            counts = torch.bincount(ids - experts.offset, minlength=self.num_local) if n else None
            local_max = int(counts.max()) if n else 0
            pad = self.comm.all_reduce_max(local_max, "ep_rows") - local_max
            if pad > 0 and n:
                x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
                ids = torch.cat([ids, ids.new_full((pad,), experts.offset + int(counts.argmax()))])
        ones = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        return experts(x, ones, ids[:, None])[:n]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        T, k = ids.shape
        flat_ids = ids.reshape(-1)
        tok = torch.arange(T, device=x.device).repeat_interleave(k)
        dest = flat_ids // self.num_local
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.comm.world_size).tolist()
        recv_counts = self.comm.exchange_counts(send_counts, "ep_counts")
        x_recv = self.comm.all_to_all(x[tok[order]], send_counts, recv_counts, "ep_dispatch")
        ids_recv = self.comm.all_to_all(flat_ids[order], send_counts, recv_counts, "ep_dispatch")
        y_recv = self._run_experts(x_recv, ids_recv, experts)
        y = torch.empty((T * k, x.shape[1]), dtype=y_recv.dtype, device=x.device)
        y[order] = self.comm.all_to_all(y_recv, recv_counts, send_counts, "ep_combine")
        by_expert = torch.argsort(flat_ids, stable=True)
        out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)[by_expert].float()
        out.index_add_(0, tok[by_expert], y[by_expert].float() * w[:, None])
        return out.to(x.dtype)
