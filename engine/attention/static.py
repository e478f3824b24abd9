"""Step metadata in buffers allocated once: what a graph-captured decode step reads its inputs from.

One forward's host-side inputs (token ids, positions, slots, the rows' requests, query starts, seq lens,
block table, and any extra int lists the caller sends along) are packed into one host buffer (pinned on
CUDA), copied to the device in one transfer, and spread into fixed device tensors there (device-side
copies, no host sync). The returned metadata holds views of those tensors, so a batch of the same padded
shape always sees the same addresses: a CUDA graph captured on them replays on the next step's values.

The pinned buffer of each build comes from torch's caching host allocator, which does not hand a buffer out
again before the copy that reads it has run: the host can build any number of forwards ahead of the GPU
(a whole step of MTP passes, and with async scheduling the next step) without waiting for it.

Rows and requests are given already padded (the runner's padding rows write nowhere: slot -1).
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttnMetadata


class StaticMetadataBuilder:
    def __init__(self, max_rows: int, max_reqs: int, max_blocks: int, block_size: int, device: torch.device | str):
        self.max_rows, self.max_reqs, self.max_blocks = max_rows, max_reqs, max(1, max_blocks)
        self.block_size = block_size
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        # the extra lists of one build (row maps, per-request values of the decode step) share this room
        self.max_extra = 2 * max_rows + 16 * max_reqs
        n = 4 * max_rows + 2 * max_reqs + 1 + max_reqs * self.max_blocks + self.max_extra
        self.flat = torch.zeros(n, dtype=torch.int64, device=self.device)
        i64 = {"dtype": torch.int64, "device": self.device}
        i32 = {"dtype": torch.int32, "device": self.device}
        self.input_ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.slot_mapping = torch.full((max_rows,), -1, **i64)
        self.token_req_idx = torch.zeros(max_rows, **i32)
        self.query_start_loc = torch.zeros(max_reqs + 1, **i32)
        self.seq_lens = torch.zeros(max_reqs, **i32)
        self.block_table = torch.zeros((max_reqs, self.max_blocks), **i32)
        self.num_h2d = 0  # host -> device copies made (one per build)

    def build(self, rows: list[tuple[list[int], list[int], int, list[int], list[int]]],
              extras: tuple[list[int], ...] = ()) -> tuple[torch.Tensor, AttnMetadata, list[torch.Tensor]]:
        """rows: per request (block ids, positions of its rows, seq len after the step, token ids, write
        slots); extras: int lists that travel in the same copy. Returns (input_ids [T], metadata, the extras
        as device int64 tensors)."""
        T, B = sum(len(r[3]) for r in rows), len(rows)
        W = max([len(r[0]) for r in rows] + [1])  # columns copied; those past them are never read
        if T > self.max_rows or B > self.max_reqs or sum(len(e) for e in extras) > self.max_extra:
            raise ValueError(f"static batch of {T} rows / {B} requests / {sum(len(e) for e in extras)} extra ints "
                             f"exceeds the buffers ({self.max_rows} / {self.max_reqs} / {self.max_extra})")
        ids, pos, slots, req_idx, qsl, lens, table = [], [], [], [], [0], [], []
        for b, (blocks, row_pos, seq_len, tokens, row_slots) in enumerate(rows):
            if not len(row_pos) == len(tokens) == len(row_slots):
                raise ValueError(f"request {b}: positions, tokens and slots differ in length")
            if len(blocks) > self.max_blocks:
                raise ValueError(f"request {b} holds {len(blocks)} blocks, more than the table width "
                                 f"{self.max_blocks}")
            ids.extend(tokens)
            pos.extend(row_pos)
            slots.extend(row_slots)
            req_idx.extend([b] * len(tokens))
            qsl.append(qsl[-1] + len(tokens))
            lens.append(seq_len)
            table.extend(blocks)
            table.extend([0] * (W - len(blocks)))
        packed = ids + pos + slots + req_idx + qsl + lens + table
        for e in extras:
            packed.extend(e)
        host = torch.tensor(packed, dtype=torch.int64)
        if self.pin:
            host = host.pin_memory()
        self.flat[: len(packed)].copy_(host, non_blocking=True)  # the forward's one H2D copy
        self.num_h2d += 1
        at = self._spread(T, B, W)
        out = []
        for e in extras:
            out.append(self.flat[at: at + len(e)])
            at += len(e)
        meta = AttnMetadata(positions=self.positions[:T], slot_mapping=self.slot_mapping[:T],
                            query_start_loc=self.query_start_loc[: B + 1], seq_lens=self.seq_lens[:B],
                            block_table=self.block_table[:B], token_req_idx=self.token_req_idx[:T],
                            query_start_loc_cpu=qsl, seq_lens_cpu=lens, block_size=self.block_size)
        return self.input_ids[:T], meta, out

    def _spread(self, T: int, B: int, W: int) -> int:
        """The packed device copy -> the typed static tensors (device-side copies)."""
        f, at = self.flat, 0
        for dst, n in ((self.input_ids, T), (self.positions, T), (self.slot_mapping, T), (self.token_req_idx, T),
                       (self.query_start_loc, B + 1), (self.seq_lens, B)):
            dst[:n].copy_(f[at: at + n])
            at += n
        self.block_table[:B, :W].copy_(f[at: at + B * W].view(B, W))
        return at + B * W
