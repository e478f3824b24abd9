"""MTP speculative decoding: verifying drafts against the target, and the synthetic-acceptance mode.

Verification of drafts d1..dk with target distributions p_0..p_k (rows of the verify pass) and the
draft distributions q_1..q_k they were drawn from:
  greedy:    accept d_i while d_i == argmax p_{i-1}; emit the accepted drafts + argmax of the next row;
  sampled:   accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection emit a
             token from norm(max(0, p_{i-1} - q_i)); if all pass, a bonus token from p_k. This leaves the
             output distribution exactly p (standard speculative sampling).
  seeded:    row i's token is the keyed draw t_i from p_i (engine/runner/sampler.py: a function of the seed
             and the position alone); accept d_i while d_i == t_{i-1}, emit the accepted drafts + t at the
             first mismatch, as greedy does with argmax. Each emitted token is the keyed draw at its position,
             an exact draw from p there, whatever the drafts were: the same tokens with or without MTP, in
             any batch, on any engine the request moves to.

`verify` does this for every request of a step at once, on the device and without reading anything back
(the device decode step and the host path run the same code). The unseeded sampled requests draw their k
uniforms up front, then one Exp(1) row for whichever token they emit (the residual's or the bonus one), in
one call of the engine's generator whatever the drafts' fate, so nothing on the host has to know where
they stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.runner.inputs import device_index
from engine.runner.sampler import RowParams, Sampler, filtered_probs, keyed_draws, seeded_rows


@dataclass
class StepRows:
    """A step's sampling rows: request b has rows row_start[b] .. row_start[b] + nd[b] (the row of its last
    known token, then one per draft), and row r's input token is ids[r] (its drafts at rows row_start[b] + 1..).
    `order` (host, `sampled_order`) lists the non-greedy requests without a seed, `order_t` the same on the
    device; the seeded ones (`seeded_rows`) draw keyed at `pos0` + row offset."""

    ids: torch.Tensor  # [N]
    row_start: torch.Tensor  # [B]
    nd: torch.Tensor  # [B]
    nd_host: list[int]
    k: int  # width of the emitted tokens - 1 (the engine's speculative tokens)
    params: RowParams  # per request
    order: list[int]  # the unseeded sampled requests (`sampled_order`): rejection sampling
    order_t: torch.Tensor
    pos0: torch.Tensor | None = None  # [B] sequence position of the token row 0 of each request draws
    q: torch.Tensor | None = None  # [D, V] the drafts' distributions of the sampled requests with drafts
    q_off: torch.Tensor | None = None  # [B] request b's first row of q
    syn: torch.Tensor | None = None  # [B] synthetic acceptance: accepted drafts per request


def draft_dists(dists: list[torch.Tensor], order: list[int], nd: list[int]) -> tuple[torch.Tensor | None, list[int]]:
    """The distributions the verified drafts were drawn from, of the sampled requests with drafts, as one
    tensor [D, V] (one copy), and each request's first row in it (0 for the others)."""
    parts, off, at = [], [0] * len(nd), 0
    for b in order:
        if nd[b]:
            parts.append(dists[b][: nd[b]])
            off[b] = at
            at += nd[b]
    return (torch.cat(parts) if parts else None), off


def verify(sampler: Sampler, logits: torch.Tensor, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] of every row -> (accepted drafts [B], emitted tokens [B, 1 + k]: valid up to accepted + 1)."""
    k, dev = rows.k, logits.device
    rs, nd = rows.row_start, rows.nd
    best = logits.argmax(dim=-1)  # per row: the greedy token, or a seeded request's keyed draw
    seeded = seeded_rows(rows.params.params) if rows.params is not None else []  # (greedy step graphs: none)
    if seeded:  # every row of a seeded request: its keyed draw at that row's position
        starts = list(accumulate([1 + n for n in rows.nd_host], initial=0))
        req_of = [b for b in seeded for _ in range(1 + rows.nd_host[b])]
        off = [i for b in seeded for i in range(1 + rows.nd_host[b])]
        idx = device_index([starts[b] + i for b, i in zip(req_of, off)], dev)
        req_t = device_index(req_of, dev)
        pos = rows.pos0[req_t] + device_index(off, dev)
        best.index_copy_(0, idx, keyed_draws(logits[idx], rows.params.select(req_of, req_t),
                                             list(range(len(req_of))), pos))
    j = torch.arange(k + 1, device=dev)[None, :]
    valid = j[:, :k] < nd[:, None]
    cur = torch.where(valid, rs[:, None] + j[:, :k], 0)  # row i verifies draft i + 1
    drafts = rows.ids[rs[:, None] + torch.minimum(j + 1, nd[:, None])]  # [B, 1 + k]: draft j + 1 for j < nd
    emitted = best[rs[:, None] + torch.minimum(j, nd[:, None])]
    if rows.syn is not None:  # the accepted drafts themselves, then the target's token
        n_acc = rows.syn
        emitted = torch.where(j < n_acc[:, None], drafts, emitted)
    match = (drafts[:, :k] == best[cur]) & valid
    if not rows.order:
        if rows.syn is None:
            n_acc = match.long().cumprod(dim=1).sum(dim=1)
        return n_acc, emitted
    order, s = rows.order, rows.order_t
    nd_s_host = [rows.nd_host[b] for b in order]
    # the sampled requests' rows, in their order: request order[i]'s at pstart[i] .. pstart[i] + nd
    req_of_row = [b for b in order for _ in range(1 + rows.nd_host[b])]
    nd_s = nd[s]
    r = nd_s + 1
    pstart = r.cumsum(0) - r
    req_t = s.repeat_interleave(r, output_size=len(req_of_row))
    local = torch.arange(len(req_of_row), device=dev) - pstart.repeat_interleave(r, output_size=len(req_of_row))
    probs = filtered_probs(logits[rs[req_t] + local], rows.params.select(req_of_row, req_t))
    drafts_s, valid_s = drafts[s], valid[s]
    rejecting = rows.syn is None and max(nd_s_host) > 0
    if rejecting:
        u = sampler.uniforms(len(order), k)
        p_d = probs[pstart[:, None] + torch.where(valid_s, j[:, :k], 0), drafts_s[:, :k]]
        q_d = rows.q[torch.where(valid_s, rows.q_off[s][:, None] + j[:, :k], 0), drafts_s[:, :k]]
        ratio = p_d.double() / q_d.double().clamp_min(1e-30)
        match[s] = (u.double() < ratio.clamp(max=1.0)) & valid_s
    if rows.syn is None:
        n_acc = match.long().cumprod(dim=1).sum(dim=1)
    n_s = n_acc[s]
    final = probs[pstart + n_s]
    if rejecting:  # at the first rejection: the residual max(0, p - q), if any of it is left
        rej = n_s < nd_s
        resid = (final - rows.q[torch.where(rej, rows.q_off[s] + n_s, 0)]).clamp_min(0.0)
        final = torch.where((rej & (resid > 0).any(dim=-1))[:, None], resid, final)
    tok = (final / sampler.exponentials(len(order), logits.shape[-1])).argmax(dim=-1)
    emitted[s] = torch.where(j < n_s[:, None], drafts_s, tok[:, None])
    return n_acc, emitted


def acceptance_rate_for_length(mean_length: float, k: int) -> float:
    """Per-position acceptance a with 1 + a + a^2 + ... + a^k = mean_length (bisection; monotone in a)."""
    target = mean_length - 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticAcceptance:
    """Benchmark mode: each draft position is accepted with a fixed probability, whatever the weights,
    so every configuration gets the same speculative speed-up (mean accepted length L incl. the bonus)."""

    def __init__(self, mean_length: float, k: int, seed: int):
        self.rate = acceptance_rate_for_length(mean_length, k)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed ^ 0xACCE)

    def num_accepted(self, num_drafts: int) -> int:
        n = 0
        while n < num_drafts and float(torch.rand((), generator=self.generator)) < self.rate:
            n += 1
        return n


class DraftDists:
    """The distributions a step's sampled drafts are drawn from, in one [S, k, V] tensor for the S requests
    that sample drafts at the first draft step; each request's `draft_probs` is its [k, V] view (rows past
    the drafts it proposes are never read: the next step verifies at most those)."""

    def __init__(self, k: int):
        self.k = k
        self.buf: torch.Tensor | None = None
        self.slot: dict[str, int] = {}

    def add(self, step: int, states: list, order: list[int], probs: torch.Tensor | None) -> None:
        """Draft step `step` drew the rows `order` of `states` (the active requests) from `probs`."""
        if step == 0:
            for st in states:
                st.draft_probs = None
            if not order:
                return
            self.buf = probs.new_empty((len(order), self.k, probs.shape[-1]))
            for i, b in enumerate(order):
                self.slot[states[b].req_id] = i
                states[b].draft_probs = self.buf[i]
        if not order:
            return
        slots = [self.slot[states[b].req_id] for b in order]
        if slots == list(range(len(slots))):
            self.buf[: len(slots), step] = probs
        else:
            self.buf[device_index(slots, probs.device), step] = probs
