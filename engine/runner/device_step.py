"""The decode step with no host sync (docs/async_scheduling.md): every request continues with one row and its
drafts, and its tokens stay on the device until the step's one read-back.

    target    the padded static forward (engine/runner/static_decode.py) over each request's 1 + d rows; a
              placeholder request's ids and start come from the last step's device outputs (LastStep)
    verify    engine/runner/speculative.py `verify`, the host path's own: greedy requests accept drafts while each
              equals the argmax of the row before it; sampled ones (temperature, top-k / top-p / min-p, with
              or without a seed) by rejection sampling against the distributions their drafts were drawn
              from, then one token from the residual or the last row (synthetic acceptance: a host draw per
              request, uploaded with the inputs); emitted = accepted drafts + one token. The sampling
              parameters travel with the step's inputs (`RowParams`, in the one host -> device copy)
    MTP       the catch-up over the same rows with the emitted tokens as input (rows past the accepted ones
              compute values nothing reads: later steps rewrite those positions before any read), draft 1
              from the row of the last emitted token, then one forward per further draft at position
              start + accepted + j, computed on the device; drafts are drawn as the host drafter draws them
              (`draw_rows`) and their distributions kept for the next step (`DraftDists`)
    output    [B, 3 + 2k] int64 (emitted | count | drafts | next start) to pinned memory behind an event
              (engine/runner/step_output.py)

Host lists of the metadata are exact where a backend sizes its work by them (not graph-safe: the torch
reference); reading the accepted counts for them costs nothing on the CPU and is a host sync on a GPU
(counted in `num_syncs`), and HiSparse's unpadded path on CUDA reads them too. A graph-safe backend (Triton,
HiSparse over it on its padded path) sizes its launches by `max_seq_len_bound` and device tensors, so its
lists are upper bounds and the step reads nothing back.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from engine.core.scheduler_output import RunnerOutput, SampledOutput, ScheduledChunk
from engine.runner.inputs import device_index
from engine.runner.sampler import RowParams, draw_rows, sampled_order
from engine.runner.speculative import DraftDists, StepRows, draft_dists, verify
from engine.runner.step_graph import StepGraphs
from engine.runner.step_output import LastStep, StepHandle


class DeviceDecode:
    def __init__(self, runner):
        self.runner = runner
        self.k = runner.cfg.num_spec_tokens if runner.mtp is not None else 0
        self.exact = not runner.static.graph_safe  # the metadata's host lists must be exact (see above)
        self.num_steps = 0  # steps that took this path
        self.num_placeholders = 0  # placeholder chunks filled in on the device
        self.num_syncs = 0  # host reads inside a step on a GPU (0 with a graph-safe backend)
        # greedy steps with full drafts as one graph each (engine/runner/step_graph.py)
        self.step_graphs = StepGraphs(self) if StepGraphs.supported(self) else None

    def eligible(self, chunks: list[ScheduledChunk]) -> bool:
        """Decode rows only, in a batch the static buffers hold, of requests with nothing host-side:
        no penalties, logprobs, grammar or prompt logits, past their min_tokens (as far as the host has read
        them), and a sampled request's drafts with the distributions they were drawn from."""
        st = self.static
        if not chunks or len(chunks) > st.sizes[-1]:
            return False
        for c in chunks:
            s = self.runner.states[c.req_id]
            p = s.sampling_params
            if not (c.sample and c.start > 0 and len(c.token_ids) == 1 + c.num_draft_tokens <= st.rows_per_req
                    and not p.needs_penalties and p.logprobs is None and len(s.output_token_ids) >= p.min_tokens
                    and s.grammar is None and not s.return_prompt_logits and len(s.block_ids) <= st.max_blocks
                    and (p.greedy or p.seed is not None or not c.num_draft_tokens
                         or (s.draft_probs is not None and s.draft_probs.shape[0] >= c.num_draft_tokens))):
                return False
        return True

    @property
    def static(self):
        return self.runner.static

    def run(self, chunks: list[ScheduledChunk], last: LastStep | None) -> tuple[StepHandle, LastStep]:
        with torch.inference_mode():
            return self._run(chunks, last)

    def _run(self, chunks: list[ScheduledChunk], last: LastStep | None) -> tuple[StepHandle, LastStep]:
        r, k = self.runner, self.k
        self.num_steps += 1
        states = [r.states[c.req_id] for c in chunks]
        size = self.step_graphs.key(chunks, states) if self.step_graphs is not None else None
        if size is not None:
            return self.step_graphs.run(chunks, states, last, size)
        nd = [c.num_draft_tokens for c in chunks]
        ph = [int(c.placeholder) for c in chunks]
        starts = [c.start for c in chunks]  # exact, or for a placeholder the largest it can be
        if any(ph) and self.exact:
            starts = [self._host_start(last, c) if c.placeholder else c.start for c in chunks]
        syn = [r.synthetic.num_accepted(d) if r.synthetic is not None and d else 0 for d in nd]
        row_start = list(accumulate([1 + d for d in nd], initial=0))[:-1]
        last_row = [last.row_of[c.req_id] if c.placeholder else 0 for c in chunks]
        params = [s.sampling_params for s in states]
        order = sampled_order(params)
        dists, q_off = draft_dists([s.draft_probs for s in states], order, nd)
        extras = (starts, ph, last_row, nd, row_start, syn, *RowParams.encode(params), q_off, order)
        batch = self.static.prepare([(s, p, c.token_ids) for s, p, c in zip(states, starts, chunks)], extras)
        if batch is None:
            raise RuntimeError("the device decode step got a batch the static buffers refuse (see eligible())")
        # the extras are views of the builder's buffer, which the draft steps' builds overwrite: one copy
        ext = torch.cat(batch.extras).split([len(e) for e in extras])
        starts_t, ph_t, last_row_t, nd_t, row_start_t, syn_t, q_off_t, order_t = *ext[:6], *ext[-2:]
        T, dev = sum(1 + d for d in nd), batch.input_ids.device
        row_req = batch.meta.token_req_idx[batch.real_idx].long()
        row_off = torch.arange(T, device=dev) - row_start_t[row_req]
        ids, start = batch.input_ids[batch.real_idx], starts_t
        if any(ph):
            self.num_placeholders += sum(ph)
            is_ph = ph_t.bool()
            ids = torch.where(is_ph[row_req], last.next_ids[last_row_t[row_req], row_off], ids)
            start = torch.where(is_ph, last.next_start[last_row_t], starts_t)
            batch.input_ids.copy_(ids[batch.src_idx])
            batch.place(start, starts_t)
        hidden = self.static.run("target", batch)
        step_rows = StepRows(ids=ids, row_start=row_start_t, nd=nd_t, nd_host=nd, k=k,
                             params=RowParams.decode(params, ext[6:10]), order=order, order_t=order_t, pos0=start + 1,
                             q=dists, q_off=q_off_t, syn=syn_t if r.synthetic is not None else None)
        n_acc, emitted = verify(r.sampler, r.model.compute_logits(hidden), step_rows)
        drafts = torch.zeros((len(chunks), k), dtype=torch.int64, device=dev)
        q = [min(c.max_drafts, k) for c in chunks]
        if r.mtp is not None:
            batch.input_ids.copy_(emitted[row_req, row_off][batch.src_idx])  # the catch-up's inputs
            out = self.static.run("mtp", batch, hidden)
            self._draft(states, starts, nd, q, out[row_start_t + n_acc], start + n_acc, n_acc, drafts, step_rows.params)
        next_start = start + 1 + n_acc
        packed = torch.cat([emitted, (n_acc + 1)[:, None], drafts, next_start[:, None]], dim=1)
        handle = StepHandle(packed=packed, finish=lambda rows: self._finish(chunks, states, q, rows))
        next_ids = torch.cat([emitted.gather(1, n_acc[:, None]), drafts], dim=1)
        return handle, LastStep([c.req_id for c in chunks], handle, lambda b: self._host_next(handle, q, b),
                                next_start, next_ids)

    def _draft(self, states, starts: list[int], nd: list[int], q: list[int], prev: torch.Tensor,
               pos0: torch.Tensor, n_acc: torch.Tensor, drafts: torch.Tensor, params: RowParams) -> None:
        """MTP drafts into `drafts` [B, k]: draft 1 from `prev` (the catch-up row at position `pos0` of each
        request), draft j + 1 from a forward at pos0 + j; request b proposes q[b] of them, drawn as the host
        path's MTP drafter draws them (`draw_rows`), their distributions kept for the next step's verify. Each
        draft forward is one row per request still drafting, derived on the device from the target pass's batch
        (`StaticDecode.next_rows`): no host build, no copy."""
        r = self.runner
        act = [b for b, n in enumerate(q) if n > 0]
        if not act:
            return
        dev = drafts.device
        act_t = device_index(act, dev)
        every = len(act) == len(q)  # every request, in order
        if not every:
            prev, pos0 = prev[act_t], pos0[act_t]
        gather = None if every else act_t  # the rows of the last forward's requests the next draft forward takes
        acc = self._read(n_acc) if self.exact else nd  # host: exact accepted counts, or their bound
        dists = DraftDists(self.k)
        for j in range(self.k):
            act_states = [states[b] for b in act]
            tok, probs, order = draw_rows(r.sampler, r.model.compute_logits(prev), params.select(act, act_t),
                                          pos0 + j + 1)  # draft j + 1: the token after position pos0 + j
            dists.add(j, act_states, order, probs)
            drafts[act_t, j] = tok
            keep = [i for i, b in enumerate(act) if q[b] > j + 1]
            if not keep:
                return
            if len(keep) < len(act):
                keep_t = device_index(keep, dev)
                tok, prev, pos0 = tok[keep_t], prev[keep_t], pos0[keep_t]
                act = [act[i] for i in keep]
                act_t = device_index(act, dev)
                gather = act_t if j == 0 else keep_t  # before the first draft forward: the target pass's order
            sb = self.static.next_rows(pos0 + j + 1, [starts[b] + acc[b] + j + 1 for b in act],
                                       [states[b].req_id for b in act], gather)
            gather = None
            sb.input_ids.index_copy_(0, sb.real_idx, tok)
            prev = self.static.run("mtp", sb, prev)

    def _finish(self, chunks, states, q: list[int], rows: list[list[int]]) -> RunnerOutput:
        k, out = self.k, RunnerOutput()
        for c, s, n_prop, row in zip(chunks, states, q, rows):
            n = row[k + 1]
            out.sampled[c.req_id] = SampledOutput(token_ids=row[:n], num_drafts=c.num_draft_tokens,
                                                  num_accepted=n - 1)
            if n_prop:
                out.drafts[c.req_id] = row[k + 2: k + 2 + n_prop]
            s.output_token_ids.extend(row[:n])
        return out

    def _host_next(self, handle: StepHandle, q: list[int], b: int) -> tuple[int, list[int]]:
        k, row = self.k, handle.rows()[b]
        n = row[k + 1]
        return row[-1], [row[n - 1]] + row[k + 2: k + 2 + q[b]]

    def _host_start(self, last: LastStep, c: ScheduledChunk) -> int:
        if not last.handle.ready:
            self.num_syncs += 1
        return last.host(c.req_id)[0]

    def _read(self, t: torch.Tensor) -> list[int]:
        if t.device.type == "cuda":
            self.num_syncs += 1
        return t.tolist()
