"""The replay scheduler with a fake `send`: think time, subagents, concurrency, overflow, warm-up."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from bench.serving.client import RequestRecord
from bench.serving.replay import ReplayConfig, Replayer
from bench.serving.traces import Session, SubagentGroup, Trace, Turn

# Lower bounds on waits are exact (asyncio never wakes early); upper bounds get generous slack for
# a loaded 2-core machine: they only check that nothing waits the *unscaled* think time.


class FakeSend:
    """Sleeps `latency_s` per request and logs (session, turn length, start, end)."""

    def __init__(self, latency_s: float = 0.02):
        self.latency_s = latency_s
        self.log: list[tuple[str, int, float, float, list[int]]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, prompt: list[int], max_tokens: int, rec: RequestRecord) -> RequestRecord:
        rec.t_start = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        rec.t_first = rec.t_start + self.latency_s / 2
        rec.t_end = time.perf_counter()
        rec.output_tokens = max_tokens
        self.log.append((rec.session, len(prompt), rec.t_start, rec.t_end, prompt))
        return rec


def _turn(i: int, n_in: int, think: float = 0.0) -> Turn:
    return Turn(turn_id=i, input_len=n_in, output_len=3, hash_ids=tuple(range(n_in // 64)), think_s=think)


def _run(traces, send, **cfg) -> tuple[Replayer, object]:
    replayer = Replayer(traces, send, ReplayConfig(**cfg))
    return replayer, asyncio.run(replayer.run())


def test_think_time_is_waited_after_the_previous_turn_completes():
    # a distinct prompt length per turn identifies it in the log
    trace = Trace("a", Session((_turn(0, 100), _turn(1, 101, think=5.0), _turn(2, 102, think=2.0))))
    send = FakeSend(latency_s=0.02)
    # a copy takes ~0.13 s (three turns and two scaled think times): 1 s leaves room for a second on a slow machine
    _run([trace], send, concurrency=1, duration_s=1.0, think_time_scale=0.01)
    first = [e for e in send.log if e[0] == send.log[0][0]]
    assert [e[1] for e in first] == [100, 101, 102]
    assert first[1][2] - first[0][3] >= 0.05 - 1e-4 and first[2][2] - first[1][3] >= 0.02 - 1e-4
    assert first[1][2] - first[0][3] < 1.0  # scaled: the recorded 5 s would be 5 s
    assert len({e[0] for e in send.log}) >= 2  # the slot moved on to a second copy of the trace


def test_subagents_run_in_parallel_and_the_parent_waits_for_all():
    sub_a = Session((_turn(1, 201), _turn(2, 202, think=1.0)))
    sub_b = Session((_turn(3, 301),))
    trace = Trace("s", Session((_turn(0, 100), SubagentGroup((sub_a, sub_b), 0.0), _turn(4, 400, think=1.0))))
    send = FakeSend(latency_s=0.1)
    replayer, result = _run([trace], send, concurrency=1, duration_s=1.0, think_time_scale=0.01)
    by_len = {e[1]: e for e in send.log if e[0] == send.log[0][0]}
    parent_end = by_len[100][3]
    assert by_len[201][2] >= parent_end and by_len[301][2] >= parent_end
    assert by_len[201][2] < by_len[301][3] and by_len[301][2] < by_len[201][3]  # they overlapped
    assert by_len[400][2] >= max(by_len[202][3], by_len[301][3]) + 0.01 - 1e-4
    assert send.max_in_flight == 2  # one session, two requests in flight: concurrency counts sessions
    depths = {r.prompt_len: r.depth for r in result.records}
    assert depths[100] == 0 and depths[201] == 1 and depths[301] == 1


def test_concurrency_counts_sessions_and_copies_never_repeat():
    traces = [Trace(f"t{i}", Session(tuple(_turn(j, 64 + j) for j in range(3)))) for i in range(3)]
    send = FakeSend(latency_s=0.01)
    replayer, result = _run(traces, send, concurrency=4, duration_s=0.3)
    assert send.max_in_flight == 4  # four sessions, no think time: always exactly four requests
    active = defaultdict(list)
    for session, _, start, end, _ in send.log:
        active[session].append((start, end))
    spans = sorted((min(s for s, _ in v), max(e for _, e in v)) for v in active.values())
    worst = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert worst <= 4
    assert len(result.sessions) == len(set(result.sessions)) >= 8
    # copies of one trace get different prompts from the very first block
    firsts = defaultdict(set)
    for session, _, _, _, prompt in send.log:
        firsts[session.split("#")[0]].add(tuple(prompt[:64]))
    assert all(len(v) >= 2 for v in firsts.values())


def test_overflow_is_counted_not_sent_and_warmup_is_not_measured():
    trace = Trace("o", Session((_turn(0, 100), _turn(1, 5000), _turn(2, 120))))
    send = FakeSend(latency_s=0.01)
    _, result = _run([trace], send, concurrency=2, duration_s=0.2, warmup_s=0.1, max_context=1000)
    assert all(e[1] != 5000 for e in send.log)
    over = [r for r in result.records if r.overflow]
    assert over and all(r.prompt_len == 5000 and r.error is None for r in over)
    early = [r for r in result.records if r.t_start < result.t_measure - 1e-6 and not r.overflow]
    assert early and not any(r.measured for r in early)
    assert all(r.measured for r in result.records if r.t_start >= result.t_measure and not r.overflow)


def test_slow_requests_are_cancelled_after_the_drain_timeout():
    trace = Trace("slow", Session((_turn(0, 100),)))
    send = FakeSend(latency_s=5.0)
    t0 = time.perf_counter()
    _, result = _run([trace], send, concurrency=2, duration_s=0.1, drain_timeout_s=0.1)
    assert time.perf_counter() - t0 < 2.0
    assert len(result.records) == 2 and all(r.cancelled and not r.ok for r in result.records)


def test_failing_server_aborts_the_session_copy():
    async def failing(prompt, max_tokens, rec):
        rec.t_start = rec.t_end = time.perf_counter()
        rec.error = "HTTP 500"
        return rec

    trace = Trace("f", Session(tuple(_turn(i, 64) for i in range(20))))
    _, result = _run([trace], failing, concurrency=1, duration_s=0.3, max_consecutive_errors=3)
    first = [r for r in result.records if r.session == result.sessions[0]]
    assert len(first) == 3  # abandoned after three consecutive errors instead of 20


def test_bad_config_raises():
    with pytest.raises(ValueError, match="concurrency"):
        ReplayConfig(concurrency=0, duration_s=1)
    with pytest.raises(ValueError, match="duration"):
        ReplayConfig(concurrency=1, duration_s=0)
