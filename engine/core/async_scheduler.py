"""Async scheduling (vLLM's `--async-scheduling`): step N+1 is planned while step N still runs on the GPU.

    EngineCore.step:  schedule N+1 ─▶ launch N+1 ─▶ read N's tokens (pinned buffer) ─▶ update(N) ─▶ N's outputs
    GPU:              ··· N ··················▶ N+1 ·········································▶

A request whose step N is still running is planned from what N will leave behind, known before its result:

* a prompt chunk that samples nothing: its update only moves `num_computed_tokens`, so that is applied now;
* a chunk that samples emits e tokens, 1 <= e <= 1 + its drafts (unknown with MTP until read back). The next
  chunk is one row block of known length — the token N samples last, then the drafts N proposes — whose
  token ids and start the runner takes from N's outputs (a `placeholder` chunk: ids -1, `start` the
  largest it can be). How many drafts it verifies and may propose depends on e only near `max_tokens` /
  `max_model_len`; when the values of e that leave the request running disagree on them, the request waits
  one step (WAIT) and is planned from N's applied result instead; when every e finishes it, likewise.

Blocks are allocated for the largest e. N's result is applied after N+1 is planned, so a request that N
finishes (EOS, a stop token, its length) runs one wasted step whose outputs are dropped; a stop string, an
abort or a preemption in between behave the same way. The wasted step writes only into the request's own
blocks, and any reuse of them is queued on the GPU after it. A request whose KV outlives it (prefill:
`hold_kv_on_finish`) is never preempted while its sampling step runs: its blocks are what it exports.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import WAIT, Scheduler
from engine.core.scheduler_output import ScheduledChunk, SchedulerOutput


class AsyncScheduler(Scheduler):
    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput):
        p = req.inflight
        if p is None:
            return super()._schedule_running(req, budget, out)
        start = req.num_computed_tokens if p.placeholder else p.start  # the previous result is applied
        if not p.sample:  # a prompt chunk: its update is known already
            req.num_computed_tokens = start + len(p.token_ids)
            return super()._schedule_running(req, budget, out)
        plan = self._plan_ahead(req, p, budget)
        if plan is None:
            return WAIT
        num_drafts, max_drafts, lookahead = plan
        hi = start + len(p.token_ids)  # where the next chunk starts if every draft of p is accepted
        new_ids = self._allocate(req, hi - req.num_computed_tokens + 1 + num_drafts, lookahead, out)
        if new_ids is None or new_ids is WAIT:
            return new_ids
        return ScheduledChunk(req_id=req.req_id, start=hi, token_ids=[-1] * (1 + num_drafts),
                              num_draft_tokens=num_drafts, sample=True, new_block_ids=new_ids,
                              max_drafts=max_drafts, placeholder=True)

    def _plan_ahead(self, req: Request, p: ScheduledChunk, budget: int) -> tuple[int, int, int] | None:
        """(drafts to verify, drafts to propose, lookahead slots) of the chunk after the sampling chunk `p`,
        when they are the same whatever p emits (among the outcomes that leave the request running);
        None otherwise."""
        sp, k, max_len = req.sampling_params, self.num_spec_tokens, self.cfg.max_model_len
        proposed = min(p.max_drafts, k)  # what the runner drafts in p's step
        plans = set()
        for e in range(1, 2 + p.num_draft_tokens):
            n_out, n_tok = req.num_output_tokens + e, req.num_tokens + e
            if n_out >= sp.max_tokens or n_tok >= max_len:
                break  # e tokens (and more) finish the request: its next chunk would be dropped
            drafts = min(proposed, max(min(max_len - n_tok, sp.max_tokens - n_out - 1), 0))
            if 1 + drafts > budget:
                drafts = 0
            left = min(sp.max_tokens - n_out, max_len - n_tok) - 1 - drafts
            plans.add((drafts, max(0, min(k, left))))
        if len(plans) != 1:
            return None
        lookahead = min(k, max(max_len - req.num_tokens - 1, 0))  # the largest, at e = 1
        return (*plans.pop(), lookahead)

    def _allocate(self, req: Request, num_new_tokens: int, lookahead: int, out: SchedulerOutput):
        while True:
            new_ids = self.kv.allocate_slots(req, num_new_tokens, num_lookahead=lookahead)
            if new_ids is not None:
                return new_ids
            victim = self.running[-1]
            if victim.hold_kv_on_finish and victim.inflight is not None and victim.inflight.sample:
                return WAIT  # its blocks are exported once that step ends: try again after it
            self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return None
