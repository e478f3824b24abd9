"""The decode forwards padded to a capture size, run from static buffers (and, on CUDA, as CUDA graphs).

A forward qualifies when every request continues a sequence (start > 0) with at most R rows, R = 1 +
the speculative tokens for the target pass and the MTP catch-up, 1 for the draft steps:

    padded rows      each request gets exactly R rows; the extra ones repeat its last row (same token and
                     position, slot -1: they write nothing and their outputs are dropped)
    padded requests  up to the next capture size, each R rows at positions 0..R-1 of an empty block
                     table (block 0), slot -1
    buffers          engine.attention.static: one pinned host buffer, one H2D copy, fixed device tensors

Rows never interact inside a layer (attention reads the cache, every other op is per row), so the real
rows compute what they would unpadded. On CUDA, with a graph-safe backend, each (kind, size, R) is
captured once and replayed; elsewhere the same padded forward runs eagerly.

The buffers come from the attention backend (`metadata_builder`), so a wrapping backend adds what its
forward reads: HiSparse's builder sends each request's page-table row and hot slot in the same copy, and
its forward routes from those on the device, so it is padded and captured like any other. A backend that
routes from host lists per forward (`pads_decode` false: HiSparse's offload-only baseline) runs here unpadded
and is never captured.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.padded_batch import PaddedBatch, eager_forward

log = logging.getLogger(__name__)
PROGRESS_S = 10.0  # capture_all logs its progress at most this often


class StaticDecode:
    def __init__(self, runner):
        cfg = runner.cfg
        self.runner = runner
        self.sizes = cfg.graphs.capture_sizes(cfg.scheduler.max_num_seqs)
        self.rows_per_req = 1 + cfg.num_spec_tokens
        self.pad = runner.backend.pads_decode
        bs = runner.block_size
        self.max_blocks = -(-(cfg.scheduler.max_model_len + self.rows_per_req) // bs) + 1
        self.builder = runner.backend.metadata_builder(self.sizes[-1] * self.rows_per_req, self.sizes[-1],
                                                       self.max_blocks, runner.device)
        self.graph_safe = runner.backend.graph_safe and self.pad
        self.capture = self.graph_safe and runner.device.type == "cuda"
        self.bound = self.max_blocks * bs if self.graph_safe else None
        self.graphs = DecodeGraphs(runner) if self.capture else None
        self.num_static = 0  # forwards on this path: built (one H2D copy each) or derived (instrumented for the tests)
        self.num_derived = 0  # ... of those, derived on the device from the last build (`next_rows`)
        self.num_reruns = 0  # forwards run again on a built batch (the device step's MTP catch-up)
        self.shapes: Counter = Counter()  # (real requests, padded requests, rows per request) of each forward
        self.capture_seconds: dict[tuple, float] = {}  # (kind, size, rows) -> its capture_all time (warm-up included)
        self.forced: tuple[int, int] | None = None  # (requests, rows per request) a DP group's plan pads every batch to

    @property
    def num_captures(self) -> int:
        return self.graphs.num_captures if self.graphs is not None else 0

    def bucket(self, n: int) -> int | None:
        if self.forced is not None:
            return self.forced[0] if n <= self.forced[0] else None
        return next((s for s in self.sizes if s >= n), None)

    def force(self, bucket: int | None, rows_per_req: int | None = None) -> None:
        """Pad every batch to `bucket` requests of `rows_per_req` rows (a DP × EP group's planned step: every rank
        runs the same shapes) until `force(None)`."""
        if bucket is not None and (bucket not in self.sizes or rows_per_req not in (1, self.rows_per_req)):
            raise ValueError(f"a planned step of {bucket} requests x {rows_per_req} rows is not among this rank's "
                             f"capture sizes {self.sizes} x rows (1, {self.rows_per_req})")
        self.forced = None if bucket is None else (bucket, rows_per_req)

    def prepare(self, rows, extras: tuple[list[int], ...] = ()) -> PaddedBatch | None:
        """rows: (request state, start, token ids) -> the padded static batch, or None (run eagerly);
        `extras` (int lists) come along in the same host -> device copy (`PaddedBatch.extras`)."""
        if not rows or any(start == 0 or not tokens for _, start, tokens in rows):
            return None
        R = 1 if all(len(t) == 1 for _, _, t in rows) else self.rows_per_req
        if self.forced is not None:
            R = self.forced[1]
        B = len(rows)
        B_pad = self.bucket(B) if self.pad else B
        if B_pad is None or B_pad > self.sizes[-1] or any(len(t) > R for _, _, t in rows) \
                or any(len(st.block_ids) > self.max_blocks for st, _, _ in rows):
            return None
        bs, slot_fn, pad = self.runner.block_size, self.runner.slot_fn, self.pad
        ids, pos, slots, counts, lens, tables, real_idx, src_idx, req_ids = [], [], [], [], [], [], [], [], []
        r = 0  # real rows so far
        for st, start, tokens in rows:
            n, end = len(tokens), start + len(tokens)
            at = len(ids)
            rng = range(start, end)
            ids.extend(tokens)
            pos.extend(rng)
            slots.extend(slot_fn(st.block_ids, rng, bs))
            real_idx.extend(range(at, at + n))  # padded rows of its real rows
            src_idx.extend(range(r, r + n))
            extra = R - n if pad else 0
            if extra:  # padding rows repeat its last row and write nowhere
                ids.extend([tokens[-1]] * extra)
                pos.extend([end - 1] * extra)
                slots.extend([-1] * extra)
                src_idx.extend([r + n - 1] * extra)
            r += n
            counts.append(n + extra)
            lens.append(end)
            tables.append(st.block_ids)
            req_ids.append(st.req_id)
        for _ in range(B_pad - B):
            ids.extend([0] * R)
            pos.extend(range(R))
            slots.extend([-1] * R)
            src_idx.extend([0] * R)
            counts.append(R)
            lens.append(R)
            tables.append([])
            req_ids.append("")
        ids, meta, (real_t, src_t, *extra_t) = self.builder.build_columns(
            ids, pos, slots, counts, lens, tables, (real_idx, src_idx, *extras), req_ids=req_ids)
        meta.max_seq_len_bound = self.bound
        self.num_static += 1
        self.shapes[(B, B_pad, R)] += 1
        return PaddedBatch(ids, meta, real_t, src_t, (B_pad, R), extra_t)

    def next_rows(self, positions: torch.Tensor, host_positions: list[int], req_ids: list[str],
                  requests: torch.Tensor | None = None, live: torch.Tensor | None = None) -> PaddedBatch:
        """One row per request of the last built batch at `positions` [B] (device; `host_positions` the same on
        the host, exact or upper bounds as the backend needs them), derived on the device (the builder's
        `derive`): the decode step's MTP draft passes. `requests`: which of the batch's requests, by index into
        the last forward's requests, in order (None: its first B, in order); `req_ids` theirs; `live` [B]: which
        of them write their row (None: all; the builder's `derive`). The caller writes the token ids
        (`input_ids[real_idx]`)."""
        B = len(host_positions)
        B_pad = self.bucket(B) if self.pad else B
        lens = [p + 1 for p in host_positions] + [1] * (B_pad - B)
        meta_ids = req_ids + [""] * (B_pad - B)
        # a backend's per-request ints follow their requests on the device (`derive`), its host lists are new
        ids, meta = self.builder.derive(positions, lens, B_pad, requests, live=live, req_ids=meta_ids)
        meta.max_seq_len_bound = self.bound
        self.num_static += 1
        self.num_derived += 1
        self.shapes[(B, B_pad, 1)] += 1
        real = self.builder.arange[:B]
        return PaddedBatch(ids, meta, real, torch.nn.functional.pad(real, (0, B_pad - B)), (B_pad, 1))

    def keys(self) -> list[tuple[str, int, int]]:
        """Every (kind, padded requests, rows per request) a decode forward can take: the target pass and
        the MTP catch-up with one row per request or 1 + the speculative tokens, the draft steps with one."""
        rows = sorted({1, self.rows_per_req})
        kinds = ["target"] + (["mtp"] if self.runner.mtp is not None and self.rows_per_req > 1 else [])
        return [(kind, size, R) for kind in kinds for R in rows for size in self.sizes]

    def dummy(self, B_pad: int, R: int) -> PaddedBatch:
        """A batch of padding requests only (R rows at positions 0..R-1 of block 0, slot -1: nothing written)."""
        entries = [([], list(range(R)), R, [0] * R, [-1] * R) for _ in range(B_pad)]
        ids, meta, (real_t, src_t) = self.builder.build(entries, ([], [0] * (B_pad * R)), req_ids=[""] * B_pad)
        meta.max_seq_len_bound = self.bound
        return PaddedBatch(ids, meta, real_t, src_t, (B_pad, R))

    def capture_all(self) -> None:
        """Capture every key at start-up (vLLM's convention), so serving never pauses to capture and a
        request joining or leaving only ever replays."""
        if self.graphs is None:
            return
        mc = self.runner.cfg.model
        keys = self.keys()
        backend = self.runner.backend.name
        log.info("capturing %d decode graphs (sizes %s) over %s", len(keys), ",".join(map(str, self.sizes)), backend)
        t0 = last = time.perf_counter()
        for i, (kind, size, R) in enumerate(keys):
            t = time.perf_counter()
            prev = None
            if kind == "mtp":
                prev = self.graphs.static_prev(torch.zeros((size * R, mc.hidden_size), device=self.runner.device,
                                                           dtype=self.runner.cfg.torch_dtype))
            self.graphs.capture(kind, self.dummy(size, R), prev)
            now = time.perf_counter()
            self.capture_seconds[(kind, size, R)] = now - t
            if self.graphs.failed is not None:
                return
            if now - last >= PROGRESS_S and i + 1 < len(keys):
                last = now
                log.info("captured %d of %d decode graphs in %.1f s (last: %s, %d requests x %d rows, %.2f s)",
                         i + 1, len(keys), now - t0, kind, size, R, now - t)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs in %.1f s over %s", len(keys), time.perf_counter() - t0, backend)

    def run(self, kind: str, batch: PaddedBatch, prev_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The model (kind "target") or its MTP layer ("mtp") over the padded batch -> the real rows' outputs."""
        prev = None if prev_hidden is None else prev_hidden[batch.src_idx]
        self.runner.begin_pass(kind, batch.key[0] * batch.key[1] if self.pad else None)  # unpadded: an eager pass
        self.num_reruns += batch.runs > 0
        batch.runs += 1
        if self.graphs is not None:
            out = self.graphs.run(kind, batch, prev)
        else:
            out = eager_forward(self.runner, kind, batch.input_ids, batch.meta, prev)
        return out[batch.real_idx]

