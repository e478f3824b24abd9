"""Step metadata in buffers allocated once: what a graph-captured decode step reads its inputs from.

One forward's host-side inputs (token ids, positions, slots, the rows' requests, query starts, seq lens,
block table) are packed into a persistent host buffer (pinned on CUDA; two, used in turn), copied to the
device in one transfer, and spread into fixed device tensors there (device-side copies, no host sync). The
returned metadata holds views of those tensors, so a batch of the same padded shape always sees the same
addresses: a CUDA graph captured on them replays on the next step's values.

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
        n = 6 * max_rows + 2 * max_reqs + 1 + max_reqs * self.max_blocks  # + two row-index extras
        pin = self.device.type == "cuda"
        # two host buffers used in turn: a build waits only for the copy two builds back (the draft steps
        # of MTP issue builds without reading anything back in between)
        self.hosts = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)] if pin else None
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
        slots); extras: int lists (row indices...) that travel in the same copy. Returns (input_ids [T],
        metadata, the extras as device int64 tensors)."""
        T, B = sum(len(r[3]) for r in rows), len(rows)
        W = max([len(r[0]) for r in rows] + [1])  # columns copied; those past them are never read
        if T > self.max_rows or B > self.max_reqs or len(extras) > 2 or any(len(e) > self.max_rows for e in extras):
            raise ValueError(f"static batch of {T} rows / {B} requests exceeds the buffers "
                             f"({self.max_rows} rows / {self.max_reqs} requests)")
        turn = self.num_h2d % 2
        host = self.hosts[turn]
        if self.copied is not None:
            self.copied[turn].synchronize()  # the copy that last read this host buffer is done
        ids, pos, slots, req_idx, qsl, lens = [], [], [], [], [0], []
        table = torch.zeros((B, W), dtype=torch.int64)
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
            if blocks:
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        at = 0
        for seg in (ids, pos, slots, req_idx, qsl, lens, table.flatten().tolist(), *extras):
            host[at: at + len(seg)] = torch.tensor(seg, dtype=torch.int64)
            at += len(seg)
        self.flat[:at].copy_(host[:at], non_blocking=True)  # the forward's one H2D copy
        if self.copied is not None:
            self.copied[turn].record()
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
