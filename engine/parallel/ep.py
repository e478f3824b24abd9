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

`StaticDispatcher` is decode's form (docs/dp_ep.md, "The static dispatch"): every rank passes the same
number of rows T (the group's padded pass), so every buffer has a fixed shape, nothing is counted on the
host and the layer can be captured in a CUDA graph:

    home rank:    ids of rows that are not real (padding) -> a sentinel no rank holds; x, ids and weights
                  packed into one [T, W] byte row each -> all-gather -> [D * T, W] on every rank
    expert rank:  its experts over all D * T rows (rows with none of its experts come out zero: the grouped
                  GEMM reads per-expert counts on the device)
    home rank:    all-to-all of equal splits -> [D, T, H] partials of its own rows -> summed in rank order

It moves every row to every rank (D - 1 copies of T rows out, as many partials back; FP8 experts on the GPU get
their rows as FP8 codes and per-128 scales, quantized once at home) where the dynamic
dispatcher moves one per (token, destination rank); its outputs are the dynamic dispatcher's, bit for bit.
"""

from __future__ import annotations

import torch

from engine.parallel.dist import RankComm
from kernels.ep_pack import fp8_row_bytes, pack_fp8_rows


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


def static_dispatch_bytes(rows: int, hidden: int, top_k: int, world_size: int, elem: int = 2,
                          fp8: bool = False) -> dict[str, int]:
    """Bytes one rank sends per MoE layer with the static dispatch of `rows` rows (to the other ranks); `fp8`:
    rows sent as FP8 codes and per-128 scales (FP8 experts on the GPU)."""
    other = world_size - 1
    row = fp8_row_bytes(hidden) if fp8 else hidden * elem
    return {"dispatch": other * rows * (row + 8 * top_k), "combine": other * rows * hidden * elem}


class AllToAllDispatcher:
    """`MoE.dispatcher`: (x [T, H], weights [T, k], ids [T, k], local experts) -> routed output [T, H]."""

    def __init__(self, comm: RankComm, num_experts: int):
        self.comm = comm
        self.num_experts = num_experts
        self.offset, self.num_local = expert_shard(num_experts, comm.rank, comm.world_size)

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                     assignments: int | None = None, **quantized) -> torch.Tensor:
        """Each received row through its experts on this rank, weighted -> [rows, H] (`assignments`: the
        experts' tile hint, see `Experts.forward`)."""
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
        if assignments is None:
            return experts(x, weights, ids)[:n]
        return experts(x, weights, ids, assignments=assignments, **quantized)[:n]

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


class StaticDispatcher(AllToAllDispatcher):
    """The fixed-shape dispatch of decode passes (module docstring): no host sync, capturable.

    `rows`: the group's row count for the pass when this rank's x may be shorter (an eager pass of a planned
    step: padded here); None inside a static pass (x already has the group's rows). `row_valid` [T] bool
    (device): which rows are real, set per forward by the runner (padding rows of a static batch write no KV
    and their outputs are dropped: they claim no expert)."""

    def __init__(self, comm: RankComm, num_experts: int):
        super().__init__(comm, num_experts)
        self.rows: int | None = None
        self.row_valid: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
        n, k = ids.shape
        H, D = x.shape[1], self.comm.world_size
        T = n if self.rows is None else self.rows
        if n > T:
            raise ValueError(f"a pass of {n} rows on DP rank {self.comm.rank} exceeds the {T} rows the group "
                             f"planned for it (the static dispatch buffers hold {T})")
        valid = self.row_valid
        valid = valid if valid is not None and valid.shape[0] == n else None
        fp8 = x.is_cuda and getattr(experts, "takes_fp8_rows", False) and H % 4 == 0
        if fp8:  # quantized once at home, as the experts would (half the bytes, the same codes): one launch packs
            payload = pack_fp8_rows(x, ids, weights, valid, T, self.num_experts)  # codes, scales, ids, weights
            nx = fp8_row_bytes(H)
        else:
            if valid is not None:  # padding rows -> an id past every rank's experts
                ids = torch.where(valid[:, None], ids, torch.full_like(ids, self.num_experts))
            if T > n:
                x = torch.cat([x, x.new_zeros((T - n, H))])
                ids = torch.cat([ids, ids.new_full((T - n, k), self.num_experts)])
                weights = torch.cat([weights, weights.new_zeros((T - n, k))])
            meta = torch.cat([ids.to(torch.int32), weights.float().view(torch.int32)], dim=1)
            rows = x.contiguous().view(torch.uint8)
            payload = torch.cat([rows, meta.view(torch.uint8)], dim=1)
            nx = rows.shape[1]
        recv = self.comm.all_gather(payload, "ep_dispatch")  # [D * T, W]
        meta_recv = _columns(recv[:, nx:], None, torch.int32)
        quantized = {}
        if fp8:
            quantized["x_quantized"] = (_columns(recv, H, torch.float8_e4m3fn),
                                        _columns(recv[:, H:nx], None, torch.float32))
            x_recv = x.new_zeros(()).expand(D * T, H)  # shape and dtype only
        else:
            x_recv = _columns(recv, nx, x.dtype)
        ids_recv = meta_recv[:, :k].long()
        ghost = getattr(self.comm, "ghost_expert_ids", None)  # the one-GPU emulation's transport only
        if ghost is not None:
            ids_recv = ghost(ids_recv, T, self.num_local, self.num_experts)
        w_recv = meta_recv[:, k:].view(torch.float32)
        # about T * k of the D * T * k entries are this rank's (balanced routing): the experts' tiles fit those
        hint = T * k if x.is_cuda else None
        y = self._run_experts(x_recv, w_recv, ids_recv, experts, hint, **quantized)  # [D * T, H]
        back = self.comm.all_to_all(y, [T] * D, [T] * D, "ep_combine").view(D, T, H)
        if back.is_cuda and back.dtype == x.dtype:  # one kernel: accumulated in fp32, rounded once at the end
            return back.sum(dim=0)[:n]
        out = back.sum(dim=0, dtype=torch.float32)  # rank order on the CPU: the dynamic dispatcher's bits
        return out[:n].to(x.dtype)


def _columns(buf: torch.Tensor, width: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Bytes buf[:, :width] (all: None) as `dtype` rows, a view where the row stride allows it."""
    cols = buf if width is None else buf[:, :width]
    try:
        return cols.view(dtype)
    except RuntimeError:
        return cols.contiguous().view(dtype)
