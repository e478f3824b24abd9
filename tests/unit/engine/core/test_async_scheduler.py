"""The async scheduler's bookkeeping, without a model: step N+1 planned before step N's result is applied
(placeholder chunks, their starts, WAIT near the end of a request), and preemption while a step runs."""

from __future__ import annotations

from engine.config.engine import SchedulerConfig
from engine.core.async_scheduler import AsyncScheduler
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import RunnerOutput, SampledOutput
from engine.kv.manager import KVCacheManager


def _scheduler(num_blocks: int = 16, k: int = 3) -> AsyncScheduler:
    cfg = SchedulerConfig(max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8, async_scheduling=True)
    return AsyncScheduler(cfg, KVCacheManager(num_blocks, 64), num_spec_tokens=k)


def _req(rid: str, n: int, max_tokens: int = 50, **kw) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True), **kw)


def _result(sampled: dict[str, list[int]], accepted: dict[str, int] | None = None,
            drafts: dict[str, list[int]] | None = None, num_drafts: dict[str, int] | None = None) -> RunnerOutput:
    out = RunnerOutput(drafts=dict(drafts or {}))
    for rid, toks in sampled.items():
        out.sampled[rid] = SampledOutput(token_ids=toks, num_drafts=(num_drafts or {}).get(rid, 0),
                                         num_accepted=(accepted or {}).get(rid, 0))
    return out


def test_placeholders_follow_the_running_step():
    s = _scheduler()
    r = _req("a", 10)
    s.add_request(r)
    s0 = s.schedule()  # the prompt, sampling its first token and proposing 3 drafts
    (c0,) = s0.chunks
    assert c0.sample and c0.max_drafts == 3 and not c0.placeholder
    s1 = s.schedule()  # before step 0's result: the first token + 3 drafts, all unknown, starting at 10
    (c1,) = s1.chunks
    assert c1.placeholder and c1.token_ids == [-1] * 4 and c1.num_draft_tokens == 3 and c1.start == 10
    s.update(s0, _result({"a": [7]}, drafts={"a": [8, 9, 10]}))
    assert (r.num_computed_tokens, r.num_tokens, r.spec_token_ids) == (10, 11, [8, 9, 10])
    s2 = s.schedule()  # step 1 may accept 0..3 drafts: the start is bounded by 10 + 4
    (c2,) = s2.chunks
    assert c2.placeholder and c2.start == 14 and len(c2.token_ids) == 4
    assert s.kv.block_ids("a") and len(s.kv.block_ids("a")) * 64 >= 14 + 4 + 3, "slots for the largest outcome"
    s.update(s1, _result({"a": [8, 5]}, accepted={"a": 1}, drafts={"a": [1, 2, 3]}, num_drafts={"a": 3}))
    assert (r.num_computed_tokens, r.output_token_ids) == (12, [7, 8, 5])  # placeholder start = 10 (applied)
    s.update(s2, _result({"a": [1, 2, 3, 4]}, accepted={"a": 3}, drafts={"a": [6, 6, 6]}, num_drafts={"a": 3}))
    assert (r.num_computed_tokens, r.num_tokens, r.inflight) == (16, 17, None)


def test_waits_when_the_outcome_decides_the_next_chunk():
    s = _scheduler()
    r = _req("a", 10, max_tokens=6)
    s.add_request(r)
    s.update(s.schedule(), _result({"a": [7]}, drafts={"a": [1, 2, 3]}))
    s1 = s.schedule()  # 1 output + 1..4 from this step: the next one's drafts depend on how many
    assert s1.chunks[0].num_draft_tokens == 3 and not s1.chunks[0].placeholder
    s2 = s.schedule()
    assert not s2.chunks, "the request waits for its step's result"
    s.update(s1, _result({"a": [1, 9]}, accepted={"a": 1}, drafts={"a": [4, 4, 4]}, num_drafts={"a": 3}))
    (c,) = s.schedule().chunks  # 3 outputs, 3 to go: 2 drafts to verify, planned from the applied result
    assert not c.placeholder and c.token_ids == [9, 4, 4] and c.max_drafts == 0


def test_not_scheduled_when_every_outcome_finishes_it():
    s = _scheduler(k=0)
    r = _req("a", 10, max_tokens=2)
    s.add_request(r)
    s.update(s.schedule(), _result({"a": [7]}))
    s1 = s.schedule()
    assert s1.chunks[0].placeholder is False and s1.chunks[0].token_ids == [7]
    assert not s.schedule().chunks  # its step emits its last token whatever it is
    out = s.update(s1, _result({"a": [3]}))
    assert out[0].finish_reason == "length" and r.output_token_ids == [7, 3]


def test_preempted_while_its_step_runs_keeps_its_tokens():
    s = _scheduler(num_blocks=3, k=0)
    a, b = _req("a", 64), _req("b", 64)
    s.add_request(a)
    s.add_request(b)
    s0 = s.schedule()  # both prompts: one block each
    s1 = s.schedule()  # position 64 needs a second block each, one is free: b (the newest) is preempted
    assert [c.req_id for c in s1.chunks] == ["a"] and s1.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.inflight is not None
    assert [c.req_id for c in s.schedule().chunks] == ["a"], "b is not admitted again while its step runs"
    s.update(s0, _result({"a": [5], "b": [6]}))
    assert b.output_token_ids == [6] and b.num_computed_tokens == 0 and b.inflight is None
    s.update(s1, _result({"a": [7]}))
    s.running.remove(a)  # make room: b comes back with the token it sampled before its preemption
    s.kv.free("a")
    new = s.schedule().new_requests
    assert [(d.req_id, d.output_token_ids) for d in new] == [("b", [6])]


def test_a_request_holding_its_kv_is_not_preempted_while_its_step_runs():
    s = _scheduler(num_blocks=3, k=0)
    a, b = _req("a", 64), _req("b", 64, hold_kv_on_finish=True)
    s.add_request(a)
    s.add_request(b)
    s0 = s.schedule()
    s1 = s.schedule()
    assert [c.req_id for c in s1.chunks] == ["a"] and not s1.preempted_req_ids
    assert b.status == RequestStatus.RUNNING
    s.update(s0, _result({"a": [5], "b": [6]}))
    assert b.output_token_ids == [6] and b.num_computed_tokens == 64
