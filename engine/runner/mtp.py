"""The MTP drafter (docs/mtp.md, "Drafting"), run after the target pass of every step.

    catch-up:  for every row whose next token is now known (prompt rows, accepted drafts, the newly
               sampled token), run the MTP layer on (embed(next token), target hidden) at that row's
               position. This (re)writes the MTP layer's own KV for those positions — stale entries
               from rejected drafts are overwritten here, which is the rollback.
    draft 1:   the last catch-up row's output -> lm_head -> d1
    draft j:   (embed(d_{j-1}), previous MTP output after shared_head.norm) at the next position -> d_j
Draft-step KV beyond the verified tokens is rewritten by the next step's catch-up. A request with a
grammar drafts from masked rows (its matcher moves over the drafts, then rolls back before verification).
"""

from __future__ import annotations

import torch

from engine.core.scheduler_output import ScheduledChunk
from engine.runner.inputs import BatchRows, device_index
from engine.runner.sampler import RowParams, RowSpec, draw_rows
from engine.runner.speculative import DraftDists


class MTPProposer:
    def __init__(self, runner):
        self.runner = runner
        self.num_steps = runner.cfg.num_spec_tokens

    def run(self, chunks: list[ScheduledChunk], layout: BatchRows, hidden: torch.Tensor,
            emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        rows, hid_idx, last = [], [], []
        for c, start in zip(chunks, layout.row_starts):
            n_known = len(c.token_ids) - c.num_draft_tokens
            if c.sample:
                seq = c.token_ids[:n_known] + emitted[c.req_id]
            else:
                seq = c.token_ids + [c.next_token_id]
            n_valid = len(seq) - 1
            rows.append((self.runner.states[c.req_id], c.start, seq[1:]))
            hid_idx.extend(range(start, start + n_valid))
            if c.sample and c.max_drafts > 0:
                last.append((c, len(hid_idx) - 1, c.start + n_valid - 1))
        # the catch-up pass writes the MTP cache for every row; only the last rows' outputs are drafted from
        prev = self.runner.mtp_forward(rows, hidden[device_index(hid_idx, hidden.device)], keep=[i for _, i, _ in last])
        if not last:
            return {}
        counts = {c.req_id: 0 for c, _, _ in last}
        advanced = dict.fromkeys(counts, 0)  # drafts each grammar matcher moved over (rolled back below)
        constrained = any(self.runner.states[c.req_id].grammar is not None for c, _, _ in last)
        steps = []  # per draft step: (request ids in row order, their draft tokens on the device)
        active = [(c, pos) for c, _, pos in last]
        dists = DraftDists(self.num_steps)
        try:
            for step in range(self.num_steps):
                tokens = self._draw(active, prev, step, dists)
                steps.append(([c.req_id for c, _ in active], tokens))
                if constrained:  # the matchers move over every draft: this step's tokens are read now
                    for (c, _), t in zip(active, tokens.tolist()):
                        advanced[c.req_id] += self.runner.structured.advance_draft(self.runner.states[c.req_id], t)
                for c, _ in active:
                    counts[c.req_id] += 1
                keep = [i for i, (c, _) in enumerate(active) if counts[c.req_id] < min(c.max_drafts, self.num_steps)]
                if not keep:
                    break
                if len(keep) < len(active):
                    idx = torch.tensor(keep, dtype=torch.int64, device=tokens.device)
                    tokens, prev = tokens[idx], prev[idx]
                active = [(active[i][0], active[i][1] + 1) for i in keep]
                step_rows = [(self.runner.states[c.req_id], pos, [0]) for c, pos in active]  # ids: `tokens`
                prev = self.runner.mtp_forward(step_rows, prev, input_ids=tokens)
        finally:
            for rid, n in advanced.items():
                self.runner.structured.rollback_drafts(self.runner.states[rid], n)
        return _read_back(steps)

    def _draw(self, active, mtp_hidden: torch.Tensor, step: int, dists: DraftDists) -> torch.Tensor:
        r = self.runner
        with torch.inference_mode():
            logits = r.model.compute_logits(mtp_hidden)
        states = [r.states[c.req_id] for c, _ in active]
        r.structured.mask_drafts(states, logits)  # constrained requests draft within their grammar
        specs = [RowSpec(st.sampling_params, st.prompt_token_ids, st.output_token_ids, r.eos_ids,
                         grammar=st.grammar is not None) for st in states]
        rp = RowParams.of([st.sampling_params for st in states], logits.device)
        with torch.inference_mode():
            x = r.sampler.penalise(logits, specs)
            # active: (chunk, position of the row drafted from): the draft is the token one position on
            positions = torch.tensor([pos + 1 for _, pos in active], dtype=torch.int64).to(x.device)
            tokens, probs, order = draw_rows(r.sampler, x, rp, positions)
        dists.add(step, states, order, probs)
        return tokens


def _read_back(steps: list[tuple[list[str], torch.Tensor]]) -> dict[str, list[int]]:
    """Every draft step's tokens -> {request: drafts}, with one device -> host read for all of them."""
    flat = torch.cat([t.reshape(-1) for _, t in steps]).tolist()
    drafts: dict[str, list[int]] = {}
    at = 0
    for rids, _ in steps:
        for rid in rids:
            drafts.setdefault(rid, []).append(flat[at])
            at += 1
    return drafts
