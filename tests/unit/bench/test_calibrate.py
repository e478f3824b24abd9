"""`pdserve bench calibrate --traces`: the prefill steps of the traces' own turns, timed on the real engine."""

from __future__ import annotations

from engine.config.arg_utils import EngineArgs
from engine.frontend.core_factory import make_engine_core
from tests.helpers.agent_traces import write_traces


def test_the_traces_turns_are_timed_after_their_cached_prefixes_alone_and_in_pairs(tiny_code, tmp_path):
    from bench.serving.traces import load_traces
    from bench.simulate.calibrate import measure_prefill_traces

    core = make_engine_core(EngineArgs(model=str(tiny_code), device="cpu", num_blocks=256,
                                       max_num_batched_tokens=512).create_engine_config())
    traces = load_traces(str(write_traces(tmp_path / "traces")), token_scale=0.25) * 2  # 4: 2 alone, 2 as a pair
    rows = measure_prefill_traces(core, "cpu", traces, turns=3, salt=0)
    # features: 1, rows, rows x mean context, requests, context read (bench/simulate/calibrate.py, _features)
    requests = [int(f[3]) for f, _ in rows]
    # the singles' six steps; the pair's second trace one turn behind its first: 1, 2, 2, 1 requests a step
    assert requests == [1] * 6 + [1, 2, 2, 1], rows
    assert all(t > 0 for _, t in rows)
    cached = [f for f, _ in rows if f[4] > f[1]]  # a chunk that starts after a cached prefix
    assert len(cached) >= 4, rows  # every turn after the first of a trace reuses its recorded prefix
    assert not core.has_unfinished()


def test_the_sharing_windows_prefill_load_replays_the_traces_turns_in_order(tmp_path):
    """trace_prompts: loop i of n sends the turns of every n-th trace in order, a new session copy each pass, so a
    copy's later turns extend its earlier prompts (their cached prefixes) and no two passes share a prefix."""
    import itertools

    from bench.serving.traces import load_traces
    from bench.simulate.calibrate import trace_prompts

    traces = load_traces(str(write_traces(tmp_path / "traces")), token_scale=0.25)
    turns = [[u.input_len for u in t.session.turns()] for t in traces]
    got = list(itertools.islice(trace_prompts(traces, 4096, 1, 2), 2 * len(turns[1])))
    assert [len(p) for p in got] == turns[1] * 2  # loop 1 of 2: the second trace, twice
    first, again = got[: len(turns[1])], got[len(turns[1]):]
    assert first[3][:64] == first[0][:64]  # the copy's last turn extends its first (their shared blocks)
    assert all(a[:64] != b[:64] for a, b in zip(first, again))  # a new copy each pass: nothing cached from the last
    assert [len(p) for p in itertools.islice(trace_prompts(traces, 4096, 0, 2), len(turns[0]))] == turns[0]
