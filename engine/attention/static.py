"""Step metadata in buffers allocated once: what a graph-captured decode step reads its inputs from.

One forward's host-side inputs (token ids, positions, slots, the rows' requests, query starts, seq lens,
block table, per-request ints a wrapping backend reads inside the forward, and any extra int lists the caller
sends along) are packed into one host buffer (pinned on CUDA), copied to the device in one transfer, and
spread into fixed device tensors there (device-side copies, no host sync). The returned metadata holds views
of those tensors, so a batch of the same padded shape always sees the same addresses: a CUDA graph captured
on them replays on the next step's values. (The extras land after the block table's used columns, so their
addresses move with its width: they are for the code around the forward, `req_ints` for the code inside.)

The pinned buffer of each build comes from torch's caching host allocator, which does not hand a buffer out
again before the copy that reads it has run: the host can build any number of forwards ahead of the GPU
(a whole step of MTP passes, and with async scheduling the next step) without waiting for it.

Rows and requests are given already padded (the runner's padding rows write nowhere: slot -1).

`derive` writes a forward of one row per request of the last build (the decode step's MTP draft passes)
on the device instead: positions, slots and seq lens from device tensors and the block table already
there (and the per-request ints, gathered with it), no host list packed and no copy from the host.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from engine.attention.metadata import AttnMetadata


class StaticMetadataBuilder:
    def __init__(self, max_rows: int, max_reqs: int, max_blocks: int, block_size: int, device: torch.device | str,
                 num_req_ints: int = 0):
        self.max_rows, self.max_reqs, self.max_blocks = max_rows, max_reqs, max(1, max_blocks)
        self.block_size = block_size
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        # the extra lists of one build (row maps, per-request values of the decode step) share this room
        self.max_extra = 2 * max_rows + 16 * max_reqs
        n = 4 * max_rows + 2 * max_reqs + 1 + max_reqs * self.max_blocks + num_req_ints * max_reqs + self.max_extra
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
        self.arange = torch.arange(max(max_rows, max_reqs + 1), **i64)
        # per-request int lists at fixed addresses (HiSparse: each request's page-table row and hot slot)
        self.req_ints = torch.zeros((num_req_ints, max_reqs), **i64)
        self.num_h2d = 0  # host -> device copies made (one per build)

    def build(self, rows: list[tuple[list[int], list[int], int, list[int], list[int]]],
              extras: tuple[list[int], ...] = (), req_ints: tuple[list[int], ...] = (),
              req_ids: list[str] | None = None) -> tuple[torch.Tensor, AttnMetadata, list[torch.Tensor]]:
        """rows: per request (block ids, positions of its rows, seq len after the step, token ids, write
        slots); extras: int lists that travel in the same copy; req_ints: lists of one int per request, which
        land in `self.req_ints[i, :B]` (None: the backend's `route` decides them from `req_ids`); req_ids:
        the requests' ids ("" for a padding request). Returns (input_ids [T], metadata, the extras as device
        int64 tensors)."""
        ids, pos, slots, counts, lens, tables = [], [], [], [], [], []
        for b, (blocks, row_pos, seq_len, tokens, row_slots) in enumerate(rows):
            if not len(row_pos) == len(tokens) == len(row_slots):
                raise ValueError(f"request {b}: positions, tokens and slots differ in length")
            ids.extend(tokens)
            pos.extend(row_pos)
            slots.extend(row_slots)
            counts.append(len(tokens))
            lens.append(seq_len)
            tables.append(blocks)
        return self.build_columns(ids, pos, slots, counts, lens, tables, extras, req_ints, req_ids)

    def build_columns(self, ids: list[int], pos: list[int], slots: list[int], counts: list[int], seq_lens: list[int],
                      tables: list[list[int]], extras: tuple[list[int], ...] = (),
                      req_ints: tuple[list[int], ...] = (),
                      req_ids: list[str] | None = None) -> tuple[torch.Tensor, AttnMetadata, list[torch.Tensor]]:
        """`build` from its rows already flattened: every row's token id, position and write slot, in order;
        per request its number of rows, seq len after the step and block ids (the one pass a caller that
        builds the rows itself saves)."""
        T, B = len(ids), len(counts)
        if req_ids is not None and not req_ints:
            req_ints = self.route(req_ids, seq_lens, max(counts, default=1))
        W = max(max(map(len, tables), default=1), 1)  # columns copied; those past them are never read
        if T > self.max_rows or B > self.max_reqs or sum(len(e) for e in extras) > self.max_extra:
            raise ValueError(f"static batch of {T} rows / {B} requests / {sum(len(e) for e in extras)} extra ints "
                             f"exceeds the buffers ({self.max_rows} / {self.max_reqs} / {self.max_extra})")
        if len(req_ints) > self.req_ints.shape[0] or any(len(v) != B for v in req_ints):
            raise ValueError(f"{len(req_ints)} per-request int lists for {self.req_ints.shape[0]} rows, "
                             f"each of {B} ints")
        if not len(pos) == len(slots) == T == sum(counts):
            raise ValueError("positions, tokens, slots and the requests' row counts differ in length")
        if W > self.max_blocks:
            b = next(b for b, t in enumerate(tables) if len(t) > self.max_blocks)
            raise ValueError(f"request {b} holds {len(tables[b])} blocks, more than the table width "
                             f"{self.max_blocks}")
        req_idx, table = [], []
        for b, (n, blocks) in enumerate(zip(counts, tables)):
            req_idx.extend([b] * n)
            table.extend(blocks)
            if len(blocks) < W:
                table.extend([0] * (W - len(blocks)))
        qsl = [0, *accumulate(counts)]
        packed = ids + pos + slots + req_idx + qsl + seq_lens + table
        for v in req_ints:
            packed.extend(v)
        for e in extras:
            packed.extend(e)
        host = torch.tensor(packed, dtype=torch.int64)
        if self.pin:
            host = host.pin_memory()
        self.flat[: len(packed)].copy_(host, non_blocking=True)  # the forward's one H2D copy
        self.num_h2d += 1
        at = self._spread(T, B, W, len(req_ints))
        out = []
        for e in extras:
            out.append(self.flat[at: at + len(e)])
            at += len(e)
        meta = AttnMetadata(positions=self.positions[:T], slot_mapping=self.slot_mapping[:T],
                            query_start_loc=self.query_start_loc[: B + 1], seq_lens=self.seq_lens[:B],
                            block_table=self.block_table[:B], token_req_idx=self.token_req_idx[:T],
                            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=self.block_size,
                            req_ids=req_ids)
        self.attach(meta)
        return self.input_ids[:T], meta, out

    def derive(self, positions: torch.Tensor, seq_lens_cpu: list[int], num_padded: int,
               requests: torch.Tensor | None = None, pad_req_ints: tuple[int, ...] | None = None,
               live: torch.Tensor | None = None,
               req_ids: list[str] | None = None) -> tuple[torch.Tensor, AttnMetadata]:
        """The forward of one row per request at `positions` [B] (device), written into the buffers on the device:
        no host list is packed and nothing is copied from the host. The requests are those of the buffers' block
        table (`requests`: which of its rows, in order, gathered first; None: its first B), so each position must
        lie in the blocks the last build gave its request; padded to `num_padded` requests as a build pads (one
        row at position 0, slot -1, seq len 1, an empty table row). `seq_lens_cpu`: the host list of every seq
        len (exact, or upper bounds for a graph-safe backend). The per-request ints follow their requests;
        `pad_req_ints`: the value of each list for a padding request. `live` [B] (device, nonzero: a real
        request): rows of the others write nowhere, as padding requests' rows (the whole-step graph passes
        its padding requests as requests). `req_ids`: the padded batch's request ids, for the backend's `route`
        (whose per-request ints are gathered here, not copied; None: no routing). Returns (input_ids
        [num_padded], metadata); the caller writes the token ids."""
        B, Bp, bs = positions.shape[0], num_padded, self.block_size
        if req_ids is not None:
            self.route(req_ids, seq_lens_cpu, 1)
        if pad_req_ints is None:
            pad_req_ints = self.pad_req_ints
        n_ints = len(pad_req_ints)
        if requests is not None:
            self.block_table[:B].copy_(self.block_table[requests])
            if n_ints:
                self.req_ints[:n_ints, :B].copy_(self.req_ints[:n_ints, requests])
        if Bp > B:
            self.block_table[B:Bp].zero_()
            self.input_ids[B:Bp].zero_()
            for i, v in enumerate(pad_req_ints):
                self.req_ints[i, B:Bp].fill_(v)
        pos = torch.nn.functional.pad(positions.long(), (0, Bp - B))
        slots = self.block_table[:Bp].long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        self.positions[:Bp].copy_(pos)
        writes = self.arange[:Bp] < B
        if live is not None:
            writes = writes & torch.nn.functional.pad(live != 0, (0, Bp - B))
        self.slot_mapping[:Bp].copy_(torch.where(writes, slots, -1))
        self.seq_lens[:Bp].copy_(pos + 1)
        self.token_req_idx[:Bp].copy_(self.arange[:Bp])
        self.query_start_loc[:Bp + 1].copy_(self.arange[:Bp + 1])
        meta = AttnMetadata(positions=self.positions[:Bp], slot_mapping=self.slot_mapping[:Bp],
                            query_start_loc=self.query_start_loc[:Bp + 1], seq_lens=self.seq_lens[:Bp],
                            block_table=self.block_table[:Bp], token_req_idx=self.token_req_idx[:Bp],
                            query_start_loc_cpu=list(range(Bp + 1)), seq_lens_cpu=seq_lens_cpu,
                            block_size=self.block_size, req_ids=req_ids)
        self.attach(meta)
        return self.input_ids[:Bp], meta

    # ---- what a wrapping backend's builder adds (engine.hisparse.builder) --------------------------
    pad_req_ints: tuple[int, ...] = ()  # each per-request int list's value for a padding request (`derive`)

    def route(self, req_ids: list[str], seq_lens: list[int], rows_per_req: int) -> tuple[list[int], ...]:
        """The per-request ints the backend's forward reads for this batch (they land in `req_ints`), decided
        on the host before the copy from the requests' ids ("" for padding) and seq lens. None here."""
        return ()

    def attach(self, meta: AttnMetadata) -> None:
        """Put the backend's per-forward inputs on the metadata (views of `req_ints`). Nothing here."""
        return None

    def _spread(self, T: int, B: int, W: int, num_req_ints: int = 0) -> int:
        """The packed device copy -> the typed static tensors (device-side copies)."""
        f, at = self.flat, 0
        for dst, n in ((self.input_ids, T), (self.positions, T), (self.slot_mapping, T), (self.token_req_idx, T),
                       (self.query_start_loc, B + 1), (self.seq_lens, B)):
            dst[:n].copy_(f[at: at + n])
            at += n
        self.block_table[:B, :W].copy_(f[at: at + B * W].view(B, W))
        at += B * W
        if num_req_ints:
            self.req_ints[:num_req_ints, :B].copy_(f[at: at + num_req_ints * B].view(num_req_ints, B))
        return at + num_req_ints * B
