"""A decode forward padded to a capture size, in the static buffers (engine/runner/static_decode.py), and
its eager run: what the CUDA graphs (cuda_graphs.py) capture and what runs when they cannot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttnMetadata


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [T_pad] static view
    meta: AttnMetadata
    real_idx: torch.Tensor  # [T] padded row of each real row, in the rows' order
    src_idx: torch.Tensor  # [T_pad] real row each padded row takes its MTP input hidden state from
    key: tuple  # (num padded requests, rows per request)
    extras: list[torch.Tensor] = field(default_factory=list)  # the caller's lists, on the device (one copy)
    runs: int = 0  # forwards run on it so far

    def place(self, start: torch.Tensor, built: torch.Tensor) -> None:
        """Move every real request's rows to start at `start` [B] (device) instead of `built` [B] (the host
        starts they were built with): positions, write slots and seq lens, on the device. Padding rows move
        with their request and keep writing nowhere; padding requests stay where they are."""
        m = self.meta
        req = m.token_req_idx.long()
        delta = start.long() - built.long()
        pad = m.seq_lens.shape[0] - delta.shape[0]
        if pad:
            delta = torch.cat([delta, delta.new_zeros(pad)])
        pos = m.positions + delta[req]
        bs = m.block_size
        slots = m.block_table.long()[req, pos // bs] * bs + pos % bs
        m.slot_mapping.copy_(torch.where(m.slot_mapping >= 0, slots, m.slot_mapping))
        m.positions.copy_(pos)
        m.seq_lens.add_(delta.to(m.seq_lens.dtype))


def eager_forward(runner, kind: str, input_ids: torch.Tensor, meta: AttnMetadata,
                  prev: torch.Tensor | None) -> torch.Tensor:
    ctx = runner.make_context(meta)
    with torch.inference_mode():
        if kind == "target":
            return runner.model(input_ids, ctx)
        return runner.model.mtp_forward(input_ids, prev, ctx)
