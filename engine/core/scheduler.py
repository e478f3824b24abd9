"""Continuous batching with chunked prefill, prefix caching, preemption by recompute and MTP drafts.

No prefill/decode modes: each step a request computes tokens from `num_computed_tokens` towards
`num_tokens` (plus the drafts it is verifying), within a per-step token budget. Running requests go
first (FCFS); when blocks run out the most recently admitted request is preempted: its blocks are
freed and it is recomputed later from its prompt and the tokens it had generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config.engine import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import NewRequestData, RunnerOutput, ScheduledChunk, SchedulerOutput
from engine.kv.manager import KVCacheManager

WAIT = object()  # _schedule_running: not this step (its next chunk depends on the step still running)


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logits: object | None = None


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, num_spec_tokens: int = 0):
        self.cfg = cfg
        self.kv = kv
        self.num_spec_tokens = num_spec_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished, KV kept for export (prefill service)
        self.importing: dict[str, tuple[Request, int]] = {}  # KV arriving from outside: (req, up to token)
        self._finished_ids: list[str] = []  # runner must drop these
        self.num_preemptions = 0
        self.spec_drafts = 0
        self.spec_accepted = 0
        # verification steps with all k drafts (request x step), and the tokens they produced
        # (accepted drafts + bonus): the mean acceptance length is spec_emitted / spec_steps
        self.spec_steps = 0
        self.spec_emitted = 0

    # ---- admission -----------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if req.num_tokens + 1 > self.cfg.max_model_len:
            raise ValueError(f"the prompt has {req.num_tokens} tokens; with at least one output token it exceeds "
                             f"max_model_len {self.cfg.max_model_len}")
        if self.kv.blocks_needed(req.num_tokens + 1) > self.kv.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the engine has ({self.kv.num_blocks})")

    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests or req.req_id in self.held:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.validate(req)
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def release_held(self, req_id: str) -> bool:
        """Free the KV a finished request kept for export (after decode pulled it, or its lease expired)."""
        req = self.held.pop(req_id, None)
        if req is None:
            return False
        self.kv.free(req_id)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_finished_to_drop(self) -> bool:
        """Finished requests whose ids the runner has not been handed yet (the next step does)."""
        return bool(self._finished_ids)

    def held_block_ids(self, req_id: str) -> list[int]:
        if req_id not in self.held:
            raise KeyError(f"request {req_id!r} holds no exported KV (finished without hold, released or unknown)")
        return self.kv.block_ids(req_id)

    # ---- KV imported from outside (decode: from a prefill engine; prefill: prefix from kvstore) ---
    def reserve_import(self, req: Request, num_import_tokens: int) -> tuple[list[int], int] | None:
        """Admit `req` with its first `num_import_tokens` tokens' KV to be written by the caller.

        Local prefix hits are used first. Returns (all block ids of the request, first token to import
        = tokens already cached locally), or None when the pool is short (nothing changes). The request
        waits in WAITING_FOR_KV until `import_done`; its blocks are never freed while a transfer may
        still write them (an abort in between is deferred to `import_done`).
        """
        if req.req_id in self.requests or req.req_id in self.held:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.validate(req)
        if not 0 < num_import_tokens < req.num_tokens:
            raise ValueError(f"can import between 1 and {req.num_tokens - 1} tokens of KV, not {num_import_tokens}")
        hits, n_hit = self.kv.get_computed_blocks(req)
        rest = req.num_tokens - n_hit
        if self.kv.allocate_slots(req, rest, hits, num_lookahead=self._lookahead(req, req.num_tokens)) is None:
            return None
        req.num_cached_tokens = n_hit
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.req_id] = req
        self.importing[req.req_id] = (req, num_import_tokens)
        return self.kv.block_ids(req.req_id), n_hit

    def import_done(self, req_id: str, ok: bool, num_tokens: int | None = None) -> None:
        """The caller finished writing (ok; `num_tokens` if only a leading part arrived) or gave up
        (the missing tokens are then computed locally)."""
        req, n_import = self.importing.pop(req_id)
        if req.is_finished:  # aborted while the transfer ran: only now may its blocks be reused
            self.kv.free(req_id)
            return
        got = min(n_import if num_tokens is None else num_tokens, n_import) if ok else 0
        req.num_computed_tokens = max(got, req.num_cached_tokens)
        req.num_cached_tokens = req.num_computed_tokens  # tokens whose KV this engine did not compute
        if got:
            self.kv.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.cfg.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chunk = self._schedule_running(req, budget, out)
            if chunk is None:  # req itself was preempted
                preempted = True
                break
            preempted = preempted or bool(out.preempted_req_ids)
            if chunk is not WAIT:
                out.chunks.append(chunk)
                req.inflight = chunk
                budget -= len(chunk.token_ids)
            i += 1
        if not preempted:
            self._schedule_waiting(budget, out)
        if out.chunks or out.finished_req_ids:  # else they wait for the next step the runner runs
            out.kv_copies = self.kv.take_copies()
        return out

    def _plan(self, req: Request, budget: int) -> tuple[int, list[int]]:
        """How many known tokens and which drafts to compute for `req` within `budget`."""
        n_known = req.num_tokens - req.num_computed_tokens
        drafts = req.spec_token_ids if n_known == 1 else []
        room = self.cfg.max_model_len - req.num_tokens
        room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
        drafts = drafts[: max(room, 0)]
        if n_known + len(drafts) > budget:
            drafts = []
        if n_known > budget:
            if not self.cfg.enable_chunked_prefill:
                return 0, []
            n_known = budget
        return n_known, drafts

    def _make_chunk(self, req: Request, n_known: int, drafts: list[int], new_block_ids: list[int]) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + n_known
        done = end == req.num_tokens
        room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                   self.cfg.max_model_len - req.num_tokens) - 1 - len(drafts)
        return ScheduledChunk(req_id=req.req_id, start=start, token_ids=req.all_token_ids[start:end] + drafts,
                              num_draft_tokens=len(drafts), sample=done, new_block_ids=new_block_ids,
                              next_token_id=None if done else req.all_token_ids[end],
                              max_drafts=max(0, min(self.num_spec_tokens, room)) if done else 0)

    def _lookahead(self, req: Request, end: int) -> int:
        """Extra slots for the MTP draft steps, once a chunk reaches the end of the known tokens."""
        if not self.num_spec_tokens or end < req.num_tokens:
            return 0
        return min(self.num_spec_tokens, max(self.cfg.max_model_len - req.num_tokens, 0))

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> ScheduledChunk | None:
        """The request's chunk, None when it was preempted itself (async scheduling may also return WAIT)."""
        n_known, drafts = self._plan(req, budget)
        lookahead = self._lookahead(req, req.num_computed_tokens + n_known)
        new_ids = self._allocate(req, n_known + len(drafts), lookahead, out)
        if new_ids is None or new_ids is WAIT:
            return new_ids
        return self._make_chunk(req, n_known, drafts, new_ids)

    def _allocate(self, req: Request, num_new_tokens: int, lookahead: int, out: SchedulerOutput) -> list[int] | None:
        """Slots for a running request, preempting the most recently admitted ones until they fit (None:
        `req` itself was preempted; async scheduling may answer WAIT)."""
        while True:
            new_ids = self.kv.allocate_slots(req, num_new_tokens, num_lookahead=lookahead)
            if new_ids is not None:
                return new_ids
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return None

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.inflight is not None:  # preempted while its last step runs: admitted once that one is applied
                return
            # prefix-cache hits only for a request holding no blocks: one whose import gave up computes into the
            # blocks it reserved (hits appended after them would leave its first positions in its own blocks)
            fresh = req.num_computed_tokens == 0 and not self.kv.block_ids(req.req_id)
            hits, n_hit = self.kv.get_computed_blocks(req) if fresh else ([], 0)
            n_known = req.num_tokens - req.num_computed_tokens - n_hit
            if n_known > budget and not self.cfg.enable_chunked_prefill:
                return
            n_known = min(n_known, budget)
            lookahead = self._lookahead(req, req.num_computed_tokens + n_hit + n_known)
            new_ids = self.kv.allocate_slots(req, n_known, hits, num_lookahead=lookahead)
            if new_ids is None:
                return
            req.num_computed_tokens += n_hit
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.new_requests.append(NewRequestData(
                req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params, block_ids=self.kv.block_ids(req.req_id),
                num_computed_tokens=req.num_computed_tokens, return_prompt_logits=req.return_prompt_logits))
            chunk = self._make_chunk(req, n_known, [], [])
            out.chunks.append(chunk)
            req.inflight = chunk
            budget -= n_known

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.req_id)

    # ---- results -------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for chunk in sched.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            if req.inflight is chunk:
                req.inflight = None
            if req.status == RequestStatus.PREEMPTED:  # async scheduling preempted it while this step ran
                outputs.extend(self._update_preempted(req, chunk, result))
                continue
            n_known = len(chunk.token_ids) - chunk.num_draft_tokens
            # a placeholder chunk starts where the previous step's result (applied just before) left it
            start = req.num_computed_tokens if chunk.placeholder else chunk.start
            emitted, logprobs = [], None
            if chunk.sample:
                s = result.sampled[chunk.req_id]
                req.num_computed_tokens = start + n_known + s.num_accepted
                # publish full blocks before outputs are appended: finishing may free the blocks
                self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
                self.spec_drafts += s.num_drafts
                self.spec_accepted += s.num_accepted
                if s.num_drafts and s.num_drafts == self.num_spec_tokens:
                    self.spec_steps += 1
                    self.spec_emitted += s.num_accepted + 1
                emitted, logprobs = self._append_checked(req, s.token_ids, s.logprobs, s.grammar_terminated)
            else:
                req.num_computed_tokens = start + n_known
            self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            if not req.is_finished:
                req.spec_token_ids = result.drafts.get(req.req_id, [])
            outputs.append(self._output(req, emitted, logprobs, result))
        return outputs

    def _update_preempted(self, req: Request, chunk: ScheduledChunk, result: RunnerOutput) -> list[EngineCoreOutput]:
        """The tokens a preempted request sampled in its last step are still its outputs (it recomputes
        them with the rest later); its KV, drafts and progress are gone."""
        if not chunk.sample:
            return []
        s = result.sampled[chunk.req_id]
        emitted, logprobs = self._append_checked(req, s.token_ids, s.logprobs, s.grammar_terminated)
        return [self._output(req, emitted, logprobs, result)]

    def _output(self, req: Request, emitted: list[int], logprobs, result: RunnerOutput) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.req_id, new_token_ids=emitted, new_logprobs=logprobs,
            finish_reason=req.status.value if req.is_finished else None, stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), prompt_logits=result.prompt_logits.get(req.req_id))

    def _append_checked(self, req: Request, tokens: list[int], logprobs,
                        grammar_done: bool = False) -> tuple[list[int], list | None]:
        sp = req.sampling_params
        emitted = []
        for i, t in enumerate(tokens):
            req.append_output([t])
            emitted.append(t)
            n_out = req.num_output_tokens
            if not sp.ignore_eos and t in req.eos_token_ids and n_out > sp.min_tokens:
                req.stop_reason = None
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif t in sp.stop_token_ids and n_out > sp.min_tokens:
                req.stop_reason = t
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif n_out >= sp.max_tokens or req.num_tokens >= self.cfg.max_model_len:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
            elif grammar_done and i == len(tokens) - 1:
                req.stop_reason = None
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                break
        return emitted, (logprobs[: len(emitted)] if logprobs is not None else None)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.requests.pop(req.req_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finished_ids.append(req.req_id)
        if req.req_id in self.importing:
            return  # a transfer may still write its blocks: import_done frees them
        if req.hold_kv_on_finish and status != RequestStatus.FINISHED_ABORTED:
            self.held[req.req_id] = req
        else:
            self.kv.free(req.req_id)
