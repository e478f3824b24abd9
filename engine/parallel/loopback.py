"""One rank of a D-rank expert-parallel group on one device, the other D - 1 ranks played locally: the
one-GPU emulation of a DP×EP decode rank (benchmarks and GPU tests; docs/dp_ep.md, "Measuring one rank on
one GPU").

What it keeps of the real group: every buffer of the static dispatch at its real shape ([D · T, W]
received, [D · T, H] partials sent back), the bytes a rank receives written into device memory, the
experts' work (the ghost ranks' rows reach this rank's 32 experts with the load balanced EP gives them) and
the absence of host syncs. What it models instead: the wire. A collective here is a device copy of the
same bytes; the NVLink time of the real all-gather and all-to-all is added afterwards from measured or
published figures (bench/decode_dp.py states which).

The ghost ranks: rank d's rows are this rank's own rows, with each token's experts on rank d moved onto
this rank's experts (`ghost_expert_ids`), so that slot d brings this rank the assignments rank d's tokens
would under balanced routing, and the D slots together bring T · k, as D real ranks would.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.core.core import EngineCore
from engine.parallel.dist import CommCounters
from engine.parallel.dp_runner import DPModelRunner, plan_step


class LoopbackComm(CommCounters):
    """`RankComm`'s tensor and object calls for rank 0 of `world_size` ranks, on one device."""

    control = None

    def __init__(self, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = 0, world_size, device
        self._shifts: dict = {}  # (rows, experts per rank, device) -> each gathered row's ghost rank's id shift
        self._init_counters()

    def all_gather(self, x: torch.Tensor, tag: str, **_) -> torch.Tensor:
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        out.copy_(x.unsqueeze(0).expand_as(out))  # every ghost rank's rows: the bytes a real gather writes
        self._count(tag, out)
        return out.view(self.world_size * x.shape[0], *x.shape[1:])

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int], tag: str) -> torch.Tensor:
        if list(send_counts) != list(recv_counts):
            raise ValueError("the loopback all-to-all plays symmetric ranks: send and receive counts must match")
        out = torch.empty_like(x)
        out.copy_(x)
        self._count(tag, out)
        return out

    def exchange_counts(self, send_counts: list[int], tag: str) -> list[int]:
        return list(send_counts)

    def all_reduce_max(self, value: int, tag: str) -> int:
        return value

    def all_reduce_min(self, value: int) -> int:
        return value

    def control_max(self, values: list[int], tag: str) -> list[int]:
        return list(values)

    def all_gather_objects(self, obj) -> list:
        return [obj] * self.world_size

    def ghost_expert_ids(self, ids: torch.Tensor, rows: int, num_local: int, num_experts: int) -> torch.Tensor:
        """ids [D · rows, k] as gathered (every slot this rank's own) -> slot d's ids moved by d ranks' worth
        of experts (rank d's experts become this rank's); the sentinel of padding rows stays put."""
        key = (rows, num_local, ids.device)
        shift = self._shifts.get(key)
        if shift is None:
            d = torch.arange(self.world_size, device=ids.device).repeat_interleave(rows)[:, None]
            shift = (d * num_local).to(ids.dtype)
            # kept once made eagerly: inside a capture its kernels have not run yet, so its values exist only
            # in that graph's replays
            if not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._shifts[key] = shift
        moved = (ids - shift) % num_experts
        return torch.where(ids < num_experts, moved, ids)

    def shutdown(self) -> None:
        pass


class EmulatedDPRunner(DPModelRunner):
    """Rank 0 of a DP × EP group over `LoopbackComm`: it plans every step from its own batch (every ghost rank
    has the same one)."""

    def step_plan(self, sched):
        c = self.cfg
        return plan_step([[len(ch.token_ids) for ch in sched.chunks]] * self.comm.world_size,
                         c.graphs.capture_sizes(c.scheduler.max_num_seqs), c.num_spec_tokens, c.with_mtp)


def emulated_rank_core(cfg, world_size: int, model=None) -> EngineCore:
    """An EngineCore whose runner is rank 0 of a `world_size`-rank DP × EP group over the loopback transport:
    `cfg`'s engine with expert parallelism over `world_size` ranks (the model holds rank 0's experts; `model`:
    an already built one, whose MoE dispatchers are replaced)."""
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_size=world_size,
                                                                enable_expert_parallel=True))
    def runner(c):
        return EmulatedDPRunner(c, LoopbackComm(world_size, torch.device(c.device)), model=model)

    return EngineCore(cfg, runner_factory=runner)
