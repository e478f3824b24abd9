"""The runner's side of structured outputs: a matcher per constrained request, the step's bitmask
applied to the logits before sampling, and every emitted token accepted into the matcher.

The matcher state lives in the runner's request state; the scheduler sees only plain results
(`SampledOutput.grammar_terminated`). A request arriving with tokens already generated (a decode
engine continuing after prefill, a request recomputed after preemption) replays them first, so
the grammar state follows the request across engines.
"""

from __future__ import annotations

import logging

import torch

from engine.core.scheduler_output import SampledOutput, ScheduledChunk
from engine.runner.state import RunnerRequest
from engine.structured.grammar import GrammarBackend, engine_backend
from engine.structured.matcher import RequestGrammar, apply_bitmask, build_bitmask

log = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, cfg):
        self.cfg = cfg
        self.max_rollback = cfg.num_spec_tokens + 1
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = engine_backend(self.cfg)
        return self._backend

    def attach(self, state: RunnerRequest) -> None:
        """Give a new request its matcher, advanced through the tokens it already has."""
        spec = state.sampling_params.structured_outputs
        if spec is None:
            return
        g = RequestGrammar(self.backend, spec, state.prompt_token_ids, self.max_rollback)
        if g.replay(state.output_token_ids):
            state.grammar = g

    def mask(self, todo: list[ScheduledChunk], states: dict[str, RunnerRequest],
             logits: torch.Tensor) -> dict[str, int]:
        """Mask the step's logits rows in place (rows laid out as in the sampler: per sampled chunk, its
        drafts + 1). Returns, per constrained request, how many of its drafts the grammar accepts."""
        entries, ids, r = [], [], 0
        for c in todo:
            g = states[c.req_id].grammar
            drafts = c.token_ids[len(c.token_ids) - c.num_draft_tokens:] if c.num_draft_tokens else []
            # a complete grammar ended its request; a step planned before that was known (async scheduling)
            # still runs for it, and its outputs are dropped
            if g is not None and not g.is_terminated:
                entries.append((r, g, drafts))
                ids.append(c.req_id)
            r += len(drafts) + 1
        if not entries:
            return {}
        bitmask, rows, valid = build_bitmask(entries, logits.shape[0], logits.shape[-1])
        if bitmask is not None:
            with torch.inference_mode():
                apply_bitmask(logits, bitmask, rows)
        return dict(zip(ids, valid))

    def mask_drafts(self, states: list[RunnerRequest], logits: torch.Tensor) -> None:
        """MTP: mask row i (request states[i]'s next draft) with its matcher advanced through the drafts
        proposed so far in this step (`advance_draft`), so drafts follow the grammar too."""
        entries = [(i, st.grammar, []) for i, st in enumerate(states)
                   if st.grammar is not None and not st.grammar.is_terminated]
        if not entries:
            return
        bitmask, rows, _ = build_bitmask(entries, logits.shape[0], logits.shape[-1])
        if bitmask is not None:
            with torch.inference_mode():
                apply_bitmask(logits, bitmask, rows)

    @staticmethod
    def advance_draft(state: RunnerRequest, token: int) -> bool:
        """Move the matcher over a proposed draft (undone by `rollback_drafts` once proposing ends)."""
        g = state.grammar
        return g is not None and not g.is_terminated and g.advance(token)

    @staticmethod
    def rollback_drafts(state: RunnerRequest, num_tokens: int) -> None:
        if state.grammar is not None and num_tokens:
            state.grammar.rollback(num_tokens)

    def accept(self, state: RunnerRequest, res: SampledOutput) -> None:
        """Accept the emitted tokens into the matcher. Once it accepts a stop token the grammar is complete:
        later tokens of the step (a bonus token after an accepted stop draft) are dropped and the request
        stops (`grammar_terminated`)."""
        g = state.grammar
        if g is None or g.is_terminated:  # the request ended with its grammar: these outputs are dropped
            return
        for n, t in enumerate(res.token_ids, 1):
            if not g.advance(t):  # cannot happen for masked rows; logged and left unconstrained
                log.error("request %s emitted token %d outside its grammar", state.req_id, t)
                state.grammar = None
                return
            if g.is_terminated:
                res.token_ids = res.token_ids[:n]
                res.num_accepted = min(res.num_accepted, n - 1)
                if res.logprobs is not None:
                    res.logprobs = res.logprobs[:n]
                res.grammar_terminated = True
                return

