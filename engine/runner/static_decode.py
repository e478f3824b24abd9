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

HiSparse: each request's page-table row and hot slot (engine.hisparse.forward.StaticRouting, padding
requests on a spare row with none) travel in the same copy into fixed device tensors, and the forward
computes its routing, plans and miss copies from those and the metadata on the device
(`plan_static`), so it is padded and captured like any other. The offload-only baseline keeps its
per-step host routing: unpadded, never captured.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttnMetadata
from engine.hisparse.forward import StaticRouting, static_routing

log = logging.getLogger(__name__)
PROGRESS_S = 10.0  # capture_all logs its progress at most this often


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


class StaticDecode:
    def __init__(self, runner):
        cfg = runner.cfg
        self.runner = runner
        self.sizes = cfg.graphs.capture_sizes(cfg.scheduler.max_num_seqs)
        self.rows_per_req = 1 + cfg.num_spec_tokens
        hs = runner.hisparse
        # HiSparse decode is padded (routed by StaticRouting) on the CPU and, on CUDA, only with graphs asked for
        # (GraphConfig.capture_hisparse) until its graph tests have run on an H200; else it runs unpadded
        padded_hs = hs is not None and not hs.offload_only and (runner.device.type != "cuda"
                                                                 or cfg.graphs.capture_hisparse)
        self.hisparse = hs if padded_hs else None
        self.pad = hs is None or padded_hs
        bs = runner.block_size
        self.max_blocks = -(-(cfg.scheduler.max_model_len + self.rows_per_req) // bs) + 1
        self.builder = runner.backend.metadata_builder(self.sizes[-1] * self.rows_per_req, self.sizes[-1],
                                                       self.max_blocks, runner.device)
        self.graph_safe = runner.backend.graph_safe and self.pad
        self.capture = self.graph_safe and runner.device.type == "cuda"
        self.bound = self.max_blocks * bs if self.graph_safe else None
        self.graphs = None
        if self.capture:
            from engine.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(runner)
        self.num_static = 0  # forwards on this path: built (one H2D copy each) or derived (instrumented for the tests)
        self.num_derived = 0  # ... of those, derived on the device from the last build (`next_rows`)
        self.num_reruns = 0  # forwards run again on a built batch (the device step's MTP catch-up)
        self.shapes: Counter = Counter()  # (real requests, padded requests, rows per request) of each forward
        self.capture_seconds: dict[tuple, float] = {}  # (kind, size, rows) -> its capture_all time (warm-up included)

    @property
    def num_captures(self) -> int:
        return self.graphs.num_captures if self.graphs is not None else 0

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def prepare(self, rows, extras: tuple[list[int], ...] = ()) -> PaddedBatch | None:
        """rows: (request state, start, token ids) -> the padded static batch, or None (run eagerly);
        `extras` (int lists) come along in the same host -> device copy (`PaddedBatch.extras`)."""
        if not rows or any(start == 0 or not tokens for _, start, tokens in rows):
            return None
        R = 1 if all(len(t) == 1 for _, _, t in rows) else self.rows_per_req
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
        route = self._routing(req_ids, lens, R)
        ids, meta, (real_t, src_t, *extra_t) = self.builder.build_columns(
            ids, pos, slots, counts, lens, tables, (real_idx, src_idx, *extras),
            route.ints if route is not None else ())
        meta.req_ids = req_ids
        meta.max_seq_len_bound = self.bound
        meta.hisparse_routing = self._attach(route, B_pad)
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
        # HiSparse: the host lists of the same routing; its device ints follow their requests in `derive`
        route = self._routing(meta_ids, lens, 1)
        pads = (self.hisparse.spare_slot, -1) if route is not None else ()
        ids, meta = self.builder.derive(positions, lens, B_pad, requests, pads, live)
        meta.req_ids = meta_ids
        meta.max_seq_len_bound = self.bound
        meta.hisparse_routing = self._attach(route, B_pad)
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
        route = self._routing([""] * B_pad, [R] * B_pad, R)
        ids, meta, (real_t, src_t) = self.builder.build(entries, ([], [0] * (B_pad * R)),
                                                        route.ints if route is not None else ())
        meta.req_ids = [""] * B_pad
        meta.max_seq_len_bound = self.bound
        meta.hisparse_routing = self._attach(route, B_pad)
        return PaddedBatch(ids, meta, real_t, src_t, (B_pad, R))

    def _routing(self, req_ids: list[str], seq_lens: list[int], R: int) -> StaticRouting | None:
        """HiSparse's routing of a padded batch (host side, after the step's placement), else None."""
        if self.hisparse is None:
            return None
        return static_routing(self.hisparse, req_ids, seq_lens, R)

    def _attach(self, route: StaticRouting | None, B_pad: int) -> StaticRouting | None:
        """The routing's device tensors: the builder's fixed per-request rows, filled by this build's copy."""
        if route is not None:
            route.slot, route.hot_slot = self.builder.req_ints[0, :B_pad], self.builder.req_ints[1, :B_pad]
        return route

    def capture_all(self) -> None:
        """Capture every key at start-up (vLLM's convention), so serving never pauses to capture and a
        request joining or leaving only ever replays."""
        if self.graphs is None:
            return
        mc = self.runner.cfg.model
        keys = self.keys()
        what = "HiSparse " if self.hisparse is not None else ""
        log.info("capturing %d %sdecode graphs (sizes %s)", len(keys), what, ",".join(map(str, self.sizes)))
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
        log.info("captured %d %sdecode graphs in %.1f s", len(keys), what, time.perf_counter() - t0)

    def run(self, kind: str, batch: PaddedBatch, prev_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The model (kind "target") or its MTP layer ("mtp") over the padded batch -> the real rows' outputs."""
        prev = None if prev_hidden is None else prev_hidden[batch.src_idx]
        self.num_reruns += batch.runs > 0
        batch.runs += 1
        if self.graphs is not None:
            out = self.graphs.run(kind, batch, prev)
        else:
            out = eager_forward(self.runner, kind, batch.input_ids, batch.meta, prev)
        return out[batch.real_idx]


def eager_forward(runner, kind: str, input_ids: torch.Tensor, meta: AttnMetadata,
                  prev: torch.Tensor | None) -> torch.Tensor:
    ctx = runner.make_context(meta)
    with torch.inference_mode():
        if kind == "target":
            return runner.model(input_ids, ctx)
        return runner.model.mtp_forward(input_ids, prev, ctx)
