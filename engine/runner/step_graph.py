"""The whole greedy MTP decode step as one CUDA graph per capture size (docs/decode_graphs.md, "Whole-step graphs").

The device decode step (engine/runner/device_step.py) replays a graph per forward but runs everything
between them eagerly: the verification, the MTP drafts' argmaxes, the draft passes' metadata, the packing of
the outputs, a few hundred small launches from Python. A step that qualifies runs as one graph instead:

    qualifies      every request greedy, verifying k drafts and proposing k more (k: the speculative tokens),
                   a resident engine (HiSparse places pages on the host between forwards) on a graph-safe
                   backend; any other step takes the per-forward path, with the same results
    padded         the step computes over the capture size's requests: a padding request has k drafts
                   like a real one, its rows write nowhere (slot -1: the builder's padding for the target
                   and catch-up passes, `live` for the draft passes) and its outputs are dropped, so the
                   shapes depend on the capture size alone
    inputs         what a step's Python decides sits at fixed addresses before the replay: the static
                   batch (one host -> device copy, `StaticDecode.prepare`), the per-request columns
                   (start, placeholder, last row, synthetic acceptance, live) copied into `cols`, and the
                   last step's next ids and starts copied into `last_ids` / `last_start` (a placeholder
                   request reads its tokens and start there on the device)
    outputs        packed [B, 3 + 2k] (emitted | count | drafts | next start), the next step's ids and starts:
                   static tensors of the graph, read by the next step's copies and the pinned read-back
                   before any later replay writes them

Everywhere but a GPU the same padded body runs eagerly (what the CPU tests compare with the per-forward
path). The keys are captured at start-up with padding-only batches, which write nothing.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.runner.padded_batch import eager_forward
from engine.runner.speculative import StepRows, verify
from engine.runner.step_output import LastStep, StepHandle

log = logging.getLogger(__name__)

NUM_COLS = 5  # per-request columns of a step: start, placeholder, last row, synthetic acceptance, live


class StepGraphs:
    def __init__(self, dd):
        self.dd = dd
        runner = dd.runner
        self.runner = runner
        self.k = dd.k
        st = runner.static
        self.capture = st.graphs is not None
        max_b, dev = st.sizes[-1], runner.device
        i64 = {"dtype": torch.int64, "device": dev}
        self.cols = torch.zeros((NUM_COLS, max_b), **i64)
        self.last_ids = torch.zeros((max_b, 1 + self.k), **i64)
        self.last_start = torch.zeros(max_b, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.num_steps = 0  # steps that took this path (replayed, or the padded body run eagerly)
        self.num_captures = 0
        self.num_replays = 0
        self.failed: str | None = None  # why a capture failed: qualifying steps take the per-forward path then
        self.capture_seconds: dict[int, float] = {}

    @staticmethod
    def supported(dd) -> bool:
        """An engine whose decode steps can take this path: MTP drafts, a resident runner on the padded static
        path, and a graph-safe backend on a GPU (elsewhere the body runs eagerly with exact host lists)."""
        r = dd.runner
        return (dd.k > 0 and r.hisparse is None and r.static.pad
                and (r.static.graph_safe or r.device.type != "cuda"))

    def key(self, chunks, states) -> int | None:
        """The capture size of a qualifying step, else None."""
        k, st = self.k, self.runner.static
        if self.failed is not None:
            return None
        for c, s in zip(chunks, states):
            if c.num_draft_tokens != k or c.max_drafts < k or not s.sampling_params.greedy:
                return None
        return st.bucket(len(chunks))

    # ---- one step ------------------------------------------------------------------------------
    def run(self, chunks, states, last: LastStep | None, B_pad: int) -> tuple[StepHandle, LastStep]:
        r, k, st = self.runner, self.k, self.runner.static
        B = len(chunks)
        self.num_steps += 1
        ph = [int(c.placeholder) for c in chunks]
        self.dd.num_placeholders += sum(ph)
        starts = [c.start for c in chunks]  # exact, or for a placeholder the largest it can be (graph-safe bounds)
        if any(ph) and self.dd.exact:
            starts = [self.dd._host_start(last, c) if c.placeholder else c.start for c in chunks]
        pad = [0] * (B_pad - B)
        cols = (starts + pad,
                ph + pad,
                [last.row_of[c.req_id] if c.placeholder else 0 for c in chunks] + pad,
                [r.synthetic.num_accepted(k) if r.synthetic is not None else 0 for _ in chunks] + pad,
                [1] * B + pad)
        flat = [v for col in cols for v in col]
        batch = st.prepare([(s, p, c.token_ids) for s, p, c in zip(states, starts, chunks)], (flat,))
        if batch is None or batch.key != (B_pad, 1 + k):
            raise RuntimeError("a whole-step graph got a batch the static buffers refuse (see StepGraphs.key)")
        self.cols[:, :B_pad].copy_(batch.extras[0].view(NUM_COLS, B_pad))
        if any(ph):
            n_last = last.next_ids.shape[0]
            self.last_ids[:n_last].copy_(last.next_ids)
            self.last_start[:n_last].copy_(last.next_start)
        for s in states:
            s.draft_probs = None  # greedy drafts carry no distributions
        host_starts = cols[0]
        r.begin_pass("step", None)
        entry = self.graphs.get(B_pad)  # captured at start-up only: the body changes its inputs as it runs
        if entry is not None:
            graph, outs = entry
            graph.replay()
            self.num_replays += 1
        else:
            with torch.inference_mode():
                outs = self.body(batch, B_pad, host_starts)
        packed, next_start, next_ids = outs
        q = [k] * B
        handle = StepHandle(packed=packed[:B], finish=lambda rows: self.dd._finish(chunks, states, q, rows))
        return handle, LastStep([c.req_id for c in chunks], handle, lambda b: self.dd._host_next(handle, q, b),
                                next_start[:B], next_ids[:B])

    def run_padding(self, B_pad: int) -> None:
        """The step of B_pad padding requests (what start-up captured): a DP rank's side of a planned step
        it has no requests in. Writes no KV and leaves the last step's device outputs to later replays' rules
        (read before any replay: the DP group steps synchronously)."""
        st = self.runner.static
        batch = st.dummy(B_pad, 1 + self.k)
        self.cols[:, :B_pad].zero_()
        entry = self.graphs.get(B_pad)
        if entry is not None:
            entry[0].replay()
            self.num_replays += 1
        else:
            with torch.inference_mode():
                self.body(batch, B_pad, [0] * B_pad)

    def body(self, batch, B_pad: int, host_starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step over B_pad requests of 1 + k rows each, from the static inputs: device work only (the host
        lists it passes on are upper bounds, or exact where the backend needs them: read on the CPU)."""
        r, k, st = self.runner, self.k, self.runner.static
        R = 1 + k
        T = B_pad * R
        cols = self.cols[:, :B_pad]
        starts, is_ph, last_row, syn, live = cols[0], cols[1] != 0, cols[2], cols[3], cols[4]
        rows = st.builder.arange[:T]
        row_req, row_off = rows // R, rows % R
        row_start = st.builder.arange[:B_pad] * R
        ids = torch.where(is_ph[row_req], self.last_ids[last_row[row_req], row_off], batch.input_ids[:T])
        start = torch.where(is_ph, self.last_start[last_row], starts)
        batch.input_ids.copy_(ids)
        batch.place(start, starts)
        hidden = eager_forward(r, "target", batch.input_ids, batch.meta, None)
        step_rows = StepRows(ids=ids, row_start=row_start, nd=torch.full_like(starts, k), nd_host=[k] * B_pad, k=k,
                             params=None, order=[], order_t=starts[:0],
                             syn=syn if r.synthetic is not None else None)
        n_acc, emitted = verify(r.sampler, r.model.compute_logits(hidden), step_rows)
        batch.input_ids.copy_(emitted[row_req, row_off])  # the catch-up's inputs
        out = eager_forward(r, "mtp", batch.input_ids, batch.meta, hidden)
        prev, pos0 = out[row_start + n_acc], start + n_acc
        acc = n_acc.tolist() if self.dd.exact else [k] * B_pad  # the CPU's backend sizes its work by host lists
        drafts = []
        for j in range(k):
            tok = r.model.compute_logits(prev).argmax(dim=-1)
            drafts.append(tok)
            if j + 1 == k:
                break
            sb = st.next_rows(pos0 + j + 1, [s + a + j + 1 for s, a in zip(host_starts, acc)], [""] * B_pad,
                              live=live)
            sb.input_ids.copy_(tok)
            prev = eager_forward(r, "mtp", sb.input_ids, sb.meta, prev)
        drafts = torch.stack(drafts, dim=1)
        next_start = start + 1 + n_acc
        packed = torch.cat([emitted, (n_acc + 1)[:, None], drafts, next_start[:, None]], dim=1)
        next_ids = torch.cat([emitted.gather(1, n_acc[:, None]), drafts], dim=1)
        return packed, next_start, next_ids

    # ---- capture -------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every capture size at start-up from padding-only batches (which write nothing)."""
        st = self.runner.static
        if not self.capture or st.graphs.failed is not None:
            return
        t0 = time.perf_counter()
        log.info("capturing %d whole-step decode graphs", len(st.sizes))
        counts = st.num_static, st.num_derived, st.shapes.copy()  # the static path's counters count serving only
        for size in st.sizes:
            self.cols[:, :size].zero_()
            self._capture(size, st.dummy(size, 1 + self.k), [0] * size)
            if self.failed is not None:
                break
        st.num_static, st.num_derived, st.shapes = counts
        if self.failed is not None:
            return
        torch.cuda.synchronize()
        log.info("captured %d whole-step decode graphs in %.1f s", len(st.sizes), time.perf_counter() - t0)

    def _capture(self, B_pad: int, batch, host_starts: list[int]) -> None:
        t = time.perf_counter()
        pool = self.runner.static.graphs.pool
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                self.body(batch, B_pad, host_starts)  # warm-up: Triton compiles outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outs = self.body(batch, B_pad, host_starts)
        except Exception as e:  # noqa: BLE001 - any capture error: the per-forward path serves, say why once
            self.failed = f"{B_pad}: {type(e).__name__}: {e}"
            log.warning("whole-step graph capture failed, decoding with per-forward graphs: %s", self.failed)
            torch.cuda.synchronize()
            return
        self.graphs[B_pad] = (graph, outs)
        self.num_captures += 1
        self.capture_seconds[B_pad] = time.perf_counter() - t
