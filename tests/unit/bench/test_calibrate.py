"""`pdserve bench calibrate --traces`: the prefill steps of the traces' own turns, timed on the real engine."""

from __future__ import annotations

import pytest

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


def test_the_service_overhead_is_measured_again_while_other_requests_stream(monkeypatch):
    """_overhead_under_streams: k long streams kept going, then single probes; each probe's TTFT less the prefill
    seconds its window adds to the engine counters, with the number of streams live during it; and each probe's
    handoff, its second token's delay less the decode steps it waited for (none counted here: the whole delay)."""
    import asyncio
    import time

    from bench.serving.client import make_session
    from bench.serving.engine_counters import STEP_COUNTERS
    from bench.simulate import calibrate
    from tests.helpers.fake_openai import FakeOpenAI, RunningFake

    fake = FakeOpenAI(decode_s_per_token=0.01, prefill_s_per_token=1e-4)  # a 128-token prompt: 12.8 ms to its token
    step_s = 0.004  # what the fake "prefill engine" counts per request it has seen

    def counters(redis_url, names):
        assert redis_url == "redis://x" and names == STEP_COUNTERS
        return {"prefill": {STEP_COUNTERS[1]: step_s * len(fake.log)},
                "decode": {STEP_COUNTERS[0]: 0.0, STEP_COUNTERS[1]: 0.0}}

    monkeypatch.setattr(calibrate, "engine_counters", counters)
    monkeypatch.setattr(calibrate, "SETTLE_S", 0.05)

    async def go(url):
        async with make_session() as http:
            return await calibrate._overhead_under_streams(http, url, "fake-model", 4096, "redis://x", 3, 128, 4000)

    with RunningFake(fake) as srv:
        got = asyncio.run(go(srv.url))
        deadline = time.monotonic() + 30
        while fake.in_flight and time.monotonic() < deadline:  # the server sees the closed connections
            time.sleep(0.01)
        assert fake.in_flight == 0  # the streams end with the measurement
    assert got["probes"] == calibrate.PROBES and got["streams"] == 3
    assert abs(got["prefill_step_s"] - step_s) < 1e-9  # each window counted its probe alone
    assert got["prefill_steps_s"] == pytest.approx([step_s] * calibrate.PROBES)  # and each probe's own is kept
    assert 0.0128 - step_s <= got["overhead_s"] < 1.0  # the probe's TTFT (at least its fake prefill) less that
    assert 0.01 <= got["handoff_s"] < 1.0  # the fake's second token comes a token's 10 ms after the first
    long = [e for e in fake.log if e.max_tokens == 4000]
    assert len(long) == 3 and len(fake.log) >= 3 + calibrate.PROBES


def test_the_served_prefill_step_is_kept_beside_the_same_prompts_step_on_the_engine_alone(tiny_code):
    """served_prefill: the probes' own prefill steps (idle, then per stream count) beside the probe's prompt on the
    engine alone: measured (measure_probe_alone, on the real engine here), else what the entry's fit says."""
    from bench.simulate.calibrate import PROBE_LEN, measure_probe_alone, served_prefill
    from bench.simulate.profile import Profile

    engines = {"prefill/pcp1-dcp1": {"step_s": 0.010, "token_s": 1e-5, "token_ctx_s": 0.0, "request_s": 0.0}}
    under = [{"streams": 4, "prefill_step_s": 0.021, "overhead_s": 0.006, "probes": 5},
             {"streams": 16, "prefill_step_s": 0.019, "overhead_s": 0.006, "probes": 5}]
    entry = served_prefill(engines, 0.018, under, 128)
    assert entry["alone_s"] == pytest.approx(0.010 + 128e-5) and "fit" in entry["source"]
    assert entry["probe_steps_s"] == {}  # no probe's own step was given
    assert entry["by_streams"] == [[0, 0.018], [4, 0.021], [16, 0.019]]
    prof = Profile({"version": 1, "engines": engines, "prefill_served": entry})
    assert prof.served_prefill_extra(4) == pytest.approx(0.021 - 0.01128)

    core = make_engine_core(EngineArgs(model=str(tiny_code), device="cpu", num_blocks=64).create_engine_config())
    alone = measure_probe_alone(core, "cpu")
    assert 0 < alone < 10 and not core.has_unfinished()
    measured = {"prefill/pcp1-dcp1": {**engines["prefill/pcp1-dcp1"], "probe_alone_s": alone}}
    under[0]["prefill_steps_s"] = [0.020, 0.021, 0.025]
    entry = served_prefill(measured, 0.018, under, PROBE_LEN, [0.017, 0.018, 0.030])
    assert entry["alone_s"] == alone and "engine alone" in entry["source"]
    assert entry["probe_steps_s"] == {"0": [0.017, 0.018, 0.030], "4": [0.020, 0.021, 0.025]}


def test_the_busy_prefill_window_is_set_beside_the_same_prompts_on_the_engine_alone():
    """busy_prefill: the prefill's mean step while kept busy through the services, beside the traces' turns' median
    step on the engine alone (the entry measured it on them) or the fit of the fresh prompts it was kept busy
    with; nothing where either is missing."""
    from bench.simulate.calibrate import busy_prefill

    engines = {"prefill/pcp1-dcp1": {"step_s": 0.010, "token_s": 1e-5, "token_ctx_s": 0.0, "request_s": 0.0,
                                     "median_step_s": 0.0115}}
    got = busy_prefill(engines, 0.016, None, "the turns of 70 traces")
    assert (got["busy_s"], got["busy_alone_s"]) == (0.016, 0.0115) and "same turns" in got["busy_source"]
    got = busy_prefill(engines, 0.016, 512, "two loops of 512-token prompts")
    assert got["busy_alone_s"] == pytest.approx(0.010 + 512e-5) and "512-token" in got["busy_source"]
    assert "busy_step_buckets" not in got  # no histogram given
    hist = [[0.01, 0], [0.02, 7], [None, 9]]
    got = busy_prefill(engines, 0.016, None, "the turns of 70 traces", hist)
    assert got["busy_step_buckets"] == hist and "histogram" in got["busy_source"]
    assert "busy_step_buckets" not in busy_prefill(engines, 0.016, None, "x", [[0.01, 0], [None, 0]])  # no step
    assert busy_prefill(engines, None, None, "x") is None
    assert busy_prefill({"prefill/pcp1-dcp1": {**engines["prefill/pcp1-dcp1"], "median_step_s": None}}, 0.016,
                        None, "x") is None


def test_the_served_decode_fit_takes_its_context_terms_from_the_engine_alone_fit():
    """served_decode_fit: the served steps are all at one context, where a per-request cost and one growing with
    the context look alike; the context terms come from the engine-alone fit (measured at several contexts), the
    rest is fitted to the served steps, so a long context costs what the engine alone says it adds."""
    from bench.simulate.calibrate import FIT_TERMS, _Chunk, _features, served_decode_fit, served_decode_rows

    truth = {"step_s": 0.007, "token_s": 2e-5, "token_ctx_s": 1e-8, "request_s": 1e-4, "chunk_ctx_s": 0.0,
             "draft_pass_s": 1e-3}
    cost = (lambda f: sum(truth[t] * x for t, x in zip(FIT_TERMS, f)))
    k, acceptance, context = 3, 2.0, 152
    tpot = {b: cost(_features([_Chunk(context, [0] * (1 + k), k)] * b)) / acceptance for b in (1, 2, 4, 8, 16)}
    rows = served_decode_rows(tpot, k, acceptance, context)
    engine_only = {"step_s": 0.005, "token_s": 1e-5, "token_ctx_s": 1e-8, "request_s": 0.0, "chunk_ctx_s": 0.0,
                   "draft_pass_s": 1e-3}
    coef, rel = served_decode_fit(rows, engine_only)
    got = dict(zip(FIT_TERMS, coef))
    assert got["token_ctx_s"] == 1e-8 and got["chunk_ctx_s"] == 0.0 and got["draft_pass_s"] == 1e-3 and rel < 1e-6
    long = _features([_Chunk(4000, [0] * (1 + k), k)] * 4)  # four requests at a 4K context
    last = _features([_Chunk(152, [0])] * 4)  # four requests' last steps: no drafts proposed, 3 ms less
    # (within 1%: the served steps' tokens are 4 per request, so their fit cannot split the two per-request terms)
    assert sum(c * x for c, x in zip(coef, last)) == pytest.approx(cost(last), rel=1e-2)
    assert sum(c * x for c, x in zip(coef, long)) == pytest.approx(cost(long), rel=1e-6)
    plain, _ = served_decode_fit(rows, None)  # no engine-alone fit: every term fitted to the one context
    assert sum(c * x for c, x in zip(plain, rows[2][0])) == pytest.approx(rows[2][1], rel=1e-3)


def test_a_lone_served_step_sets_the_draft_passes_cost_the_service_pays():
    """A service whose host work overlaps the device runs the MTP draft passes cheaper than the engine alone (or
    for nothing): with the decode step of a lone 2-token request through the services (one token, no draft
    proposed: served_single_row), the served fit takes the draft passes' cost from the served steps, and holds
    the per-token term from the engine alone instead; without that step it keeps the engine alone's draft cost."""
    from bench.simulate.calibrate import (
        FIT_TERMS,
        _Chunk,
        _features,
        served_decode_fit,
        served_decode_rows,
        served_single_row,
    )

    served = {"step_s": 0.004, "token_s": 2e-5, "token_ctx_s": 1e-8, "request_s": 1e-4, "chunk_ctx_s": 0.0,
              "draft_pass_s": 2e-4}
    cost = (lambda f: sum(served[t] * x for t, x in zip(FIT_TERMS, f)))
    engine_only = {**served, "step_s": 0.003, "request_s": 0.0, "draft_pass_s": 1e-3}  # drafts 5x dearer alone
    k, acceptance, context = 3, 1.9, 152
    tpot = {b: cost(_features([_Chunk(context, [0] * (1 + k), k)] * b)) / acceptance for b in (1, 2, 4, 8, 16)}
    rows = served_decode_rows(tpot, k, acceptance, context)
    lone = served_single_row(cost(_features([_Chunk(128, [0], 0)])), 128)
    assert lone[0][-1] == 0.0 and lone[0][1] == 1.0  # no draft pass, one token
    coef, rel = served_decode_fit(rows, engine_only, lone)
    got = dict(zip(FIT_TERMS, coef))
    assert got["draft_pass_s"] == pytest.approx(2e-4, rel=1e-6) and got["step_s"] == pytest.approx(0.004, rel=1e-6)
    assert got["token_s"] == engine_only["token_s"] and got["token_ctx_s"] == 1e-8 and rel < 1e-6
    last = _features([_Chunk(900, [0])] * 2)  # two requests' last steps: what the run's short requests end with
    assert sum(c * x for c, x in zip(coef, last)) == pytest.approx(cost(last), rel=1e-6)
    held, _ = served_decode_fit(rows, engine_only)  # no lone step: the engine alone's draft cost, 5x too dear
    assert dict(zip(FIT_TERMS, held))["draft_pass_s"] == 1e-3
    assert sum(c * x for c, x in zip(held, last)) < 0.8 * cost(last)
    free = dict(zip(FIT_TERMS, served_decode_fit(rows, engine_only, (lone[0], lone[1] * 1.5))[0]))
    assert free["draft_pass_s"] == 0.0  # a lone step dearer than the drafting one: the passes cost nothing
