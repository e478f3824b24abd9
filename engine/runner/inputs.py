"""Flattening scheduled chunks into one forward batch (host lists -> device tensors in one copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttnMetadata, pack_metadata
from engine.core.scheduler_output import ScheduledChunk
from engine.runner.state import RunnerRequest


@dataclass
class BatchRows:
    """Where each request's rows sit in the flat batch: rows [row_start, row_start + num_rows)."""

    req_ids: list[str]
    row_starts: list[int]
    num_rows: list[int]


def slots_for(block_ids: list[int], positions: range | list[int], block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def build_batch(rows: list[tuple[RunnerRequest, int, list[int]]], block_size: int, device: torch.device,
                slot_fn=slots_for) -> tuple[torch.Tensor, AttnMetadata, BatchRows]:
    """rows: (request, start position, token ids) -> (input_ids [T], metadata, row layout).

    Positions of a request's rows are start .. start + len - 1 and its context after the step is
    start + len tokens. `slot_fn(block_ids, positions, block_size)` maps positions to write slots (context
    parallelism replaces it with its rank-local mapping).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    layout = BatchRows([], [], [])
    for req, start, tokens in rows:
        n = len(tokens)
        layout.req_ids.append(req.req_id)
        layout.row_starts.append(len(input_ids))
        layout.num_rows.append(n)
        input_ids.extend(tokens)
        pos = range(start, start + n)
        positions.extend(pos)
        slot_mapping.extend(slot_fn(req.block_ids, pos, block_size))
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(req.block_ids)
    meta, (ids,) = pack_metadata(positions=positions, slot_mapping=slot_mapping, query_lens=query_lens,
                                 seq_lens=seq_lens, block_tables=tables, block_size=block_size, device=device,
                                 extras=(input_ids,))  # one host -> device copy for the whole forward
    meta.req_ids = layout.req_ids  # backends that keep per-request state (HiSparse) look them up
    return ids, meta, layout


def device_index(idx: list[int], device: torch.device) -> torch.Tensor:
    """Row indices for a gather on `device`: through pinned memory on CUDA, so the copy does not wait
    for the stream (indexing a CUDA tensor with a Python list would copy synchronously)."""
    host = torch.tensor(idx, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def rows_layout(rows: list[tuple[RunnerRequest, int, list[int]]]) -> BatchRows:
    """The row layout `build_batch` gives the same rows."""
    layout, at = BatchRows([], [], []), 0
    for req, _, tokens in rows:
        layout.req_ids.append(req.req_id)
        layout.row_starts.append(at)
        layout.num_rows.append(len(tokens))
        at += len(tokens)
    return layout


def chunk_rows(chunks: list[ScheduledChunk],
               states: dict[str, RunnerRequest]) -> list[tuple[RunnerRequest, int, list[int]]]:
    return [(states[c.req_id], c.start, c.token_ids) for c in chunks]
