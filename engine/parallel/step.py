"""One forward pass under context parallelism: who computes which rows, where KV is written, and how
attention finds the context. Built by the rank runner, read by the CP attention backend.

Every rank builds the same plan (it sees the same SchedulerOutput); only `rank` differs. A request of
the step takes one of two attention paths when DCP > 1 (with DCP = 1 every rank holds the whole cache
and attends locally):

    prefill path   the prior context [0, start) is all-gathered from the ranks' shards into a temporary
                   buffer per layer (dcp_context.py), the step's new rows are added, attention is local
    decode path    few new rows (start > 0, rows <= DECODE_MAX_ROWS): every rank scores and attends its
                   own shard for all ranks' decode rows, a global top-k from candidates, exact LSE merge
                   (dcp_decode.py) — no context moves, only queries and partial outputs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttnMetadata, ForwardSlot
from engine.parallel.dcp_context import ContextGather
from engine.parallel.dcp_decode import DecodeAttention
from engine.parallel.pcp import RowPlan, plan_step_rows
from engine.runner.inputs import BatchRows, build_batch

# A request computing at most this many rows on top of existing context takes the decode path: moving
# its queries (rows x heads x 576) is far cheaper than moving its context (tokens x 656 B per layer).
DECODE_MAX_ROWS = 8


@dataclass
class StepRequest:
    req_idx: int  # order in the step
    start: int  # position of the first new row
    num_rows: int  # new rows of this forward (all ranks together)
    row_start: int  # first step row
    block_ids: list[int]
    decode: bool

    @property
    def seq_len(self) -> int:
        return self.start + self.num_rows


@dataclass
class CPStep:
    rank: int
    pcp_size: int
    dcp_size: int
    interleave: int
    rows: RowPlan  # PCP split of the step rows
    requests: list[StepRequest]
    write_meta: AttnMetadata  # every step row; slot_mapping = where *this rank* writes (-1: another rank)
    layer_ids: list[int]  # the layers of this forward, in order (prefetch looks one ahead)
    own_prefill_idx: torch.Tensor  # own rows (indices into own rows) of prefill-path requests
    own_decode_idx: torch.Tensor  # own rows of decode-path requests
    context: object | None = None  # dcp_context.ContextGather (DCP > 1, prefill-path requests)
    decode: object | None = None  # dcp_decode.DecodeAttention (DCP > 1, decode-path requests)
    last_topk: tuple | None = None  # (tensor handed to the model, its decode rows' global selection)

    def topk_width(self, topk: int) -> int:
        return min(topk, max([r.seq_len for r in self.requests] + [1]))

    def next_layer(self, layer: int) -> int | None:
        i = self.layer_ids.index(layer)
        return self.layer_ids[i + 1] if i + 1 < len(self.layer_ids) else None


# where the plan of this rank's forward waits for the CP attention backend (cp_backend.py)
CP_STEP: ForwardSlot[CPStep] = ForwardSlot("cp")


def select_rows(meta: AttnMetadata, rows: list[int], counts: list[int], device) -> AttnMetadata:
    """The metadata of a subset of rows (ascending, `counts` of them per request), same requests."""
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    qsl = [0]
    for n in counts:
        qsl.append(qsl[-1] + n)
    return AttnMetadata(positions=meta.positions[idx], slot_mapping=meta.slot_mapping[idx],
                        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                        seq_lens=meta.seq_lens, block_table=meta.block_table, token_req_idx=meta.token_req_idx[idx],
                        query_start_loc_cpu=qsl, seq_lens_cpu=list(meta.seq_lens_cpu), block_size=meta.block_size)


def build_step(runner, rows, layer_ids: list[int]) -> tuple[torch.Tensor, AttnMetadata, CPStep, BatchRows]:
    """rows (request state, start, token ids) of one forward -> (own input ids, own metadata with the
    plan under `CP_STEP`, the plan, the layout of all step rows)."""
    pc = runner.cfg.parallel
    input_ids, write_meta, layout = build_batch(rows, runner.block_size, runner.device, runner.slot_fn)
    plan = plan_step_rows(layout.num_rows, pc.prefill_context_parallel_size, runner.rank, runner.device)
    dcp = pc.decode_context_parallel_size
    requests = [StepRequest(i, start, len(tokens), layout.row_starts[i], state.block_ids,
                            decode=dcp > 1 and start > 0 and len(tokens) <= DECODE_MAX_ROWS)
                for i, (state, start, tokens) in enumerate(rows)]
    own = plan.own_rows
    req_of_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(layout.num_rows, dtype=torch.int64))
    own_req = req_of_row[own].tolist() if own else []
    counts = [0] * len(rows)
    for b in own_req:
        counts[b] += 1
    own_meta = select_rows(write_meta, own, counts, runner.device)
    is_decode = [requests[b].decode for b in own_req]
    step = CPStep(rank=runner.rank, pcp_size=pc.prefill_context_parallel_size, dcp_size=dcp,
                  interleave=pc.cp_kv_cache_interleave_size, rows=plan, requests=requests, write_meta=write_meta,
                  layer_ids=list(layer_ids),
                  own_prefill_idx=_where([not d for d in is_decode], runner.device),
                  own_decode_idx=_where(is_decode, runner.device))
    if dcp > 1:
        if any(not r.decode for r in requests):
            step.context = ContextGather(step, runner.kv_cache, runner.comm, runner.kv_prefetch)
        if any(r.decode for r in requests):
            step.decode = DecodeAttention(step, runner.comm, runner.backend.inner, pc.dcp_comm_backend)
    CP_STEP.put(own_meta, step)
    own_ids = input_ids[torch.tensor(own, dtype=torch.int64, device=input_ids.device)]
    return own_ids, own_meta, step, layout


def _where(flags: list[bool], device) -> torch.Tensor:
    return torch.tensor([i for i, f in enumerate(flags) if f], dtype=torch.int64, device=device)
