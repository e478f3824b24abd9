"""AsyncEngine with async scheduling: every stream gets what the offline synchronous engine gives (tokens,
text, finish and stop reasons: stop strings, stop tokens, max_tokens), a client that leaves stops its
request, and output processing runs on the event loop while the engine thread keeps stepping."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from tests.helpers.pace import until

KW = dict(num_blocks=96, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], enforce_eager=False,
          num_speculative_tokens=3, device="cpu")


def _prompts(tok, n: int) -> list[list[int]]:
    import difflib

    ids = tok.encode(inspect.getsource(difflib))
    return [ids[i * 250: i * 250 + 19 + 6 * i] for i in range(n)]


@pytest.mark.timeout(120)
def test_streams_equal_offline_and_processing_overlaps_steps(tiny_code):
    offline = LLM(str(tiny_code), **KW)
    prompts = _prompts(offline.tokenizer, 5)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = offline.generate(prompts, greedy)
    text = plain[1].text
    params = [greedy, dataclasses.replace(greedy, stop=[text[len(text) // 2: len(text) // 2 + 3]]),
              dataclasses.replace(greedy, stop_token_ids=[plain[2].token_ids[8]]),
              dataclasses.replace(greedy, max_tokens=5), greedy]
    ref = LLM(str(tiny_code), **KW).generate(prompts, params)

    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), async_scheduling=True, **KW))
        process, overlap, threads = engine.processor.process, [], set()

        def slow_process(outputs):  # a slow front end: the engine must keep stepping meanwhile
            threads.add(threading.current_thread().name)
            n0 = engine.core.num_steps
            # busy until the engine has stepped, or has nothing left to step (a fixed delay can pass without a
            # step when a loaded machine makes one step longer than the delay); the bound only stops a hang
            deadline = time.monotonic() + 60
            while (engine.core.num_steps == n0 and engine.core.has_unfinished()
                   and time.monotonic() < deadline):
                time.sleep(0.005)
            overlap.append(engine.core.num_steps - n0)
            return process(outputs)

        engine.processor.process = slow_process
        engine.start()
        try:
            outs = await asyncio.gather(*[_last(engine.generate(p, sp)) for p, sp in zip(prompts[:4], params[:4])])
            left = await _leave_after(engine.generate(prompts[4], dataclasses.replace(greedy, max_tokens=2000)), 6)
            stats = await until(lambda: _idle_stats(engine), "the aborted stream's blocks", period=0.05)
            return outs, left, overlap, threads, stats
        finally:
            await engine.shutdown()

    outs, left, overlap, threads, stats = asyncio.run(run())
    for o, r in zip(outs, ref):
        assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == \
            (r.token_ids, r.text, r.finish_reason, r.stop_reason)
    assert [o.finish_reason for o in outs] == ["length", "stop", "stop", "length"]
    assert left == ref[4].token_ids[: len(left)] and 6 <= len(left) < 24
    assert threads == {"MainThread"}, "outputs are processed on the event loop"
    assert max(overlap) > 0, "the engine stepped while the front end was busy with outputs"
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0, "the stream that left was aborted"


async def _idle_stats(engine):
    """The engine's stats once nothing runs and every block is free; None before."""
    st = await engine.call(lambda core: core.stats())
    return st if st.num_running == 0 and st.num_free_blocks == st.num_blocks else None


async def _last(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def _leave_after(stream, n: int) -> list[int]:
    try:
        async for out in stream:
            if len(out.token_ids) >= n:
                return list(out.token_ids)
    finally:
        await stream.aclose()  # the client goes away: its request is aborted
    raise AssertionError("the stream ended before the client left")


@pytest.mark.timeout(120)
def test_a_service_engine_streams_token_id_deltas(tiny_code):
    """AsyncEngine(text=False, cumulative=False), as the services build it: the same tokens, finish reasons, stop
    strings and logprobs as the offline engine; a detokenizer only for the request with stop strings; each output
    carries its step's tokens and their logprobs, and the whole token list only on the final one."""
    offline = LLM(str(tiny_code), **KW)
    prompts = _prompts(offline.tokenizer, 4)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = offline.generate(prompts[1], greedy)[0].text
    params = [greedy, dataclasses.replace(greedy, stop=[text[len(text) // 2: len(text) // 2 + 3]]),
              dataclasses.replace(greedy, max_tokens=5), dataclasses.replace(greedy, logprobs=2)]
    ref = offline.generate(prompts, params)

    async def collect(stream):
        return [out async for out in stream]

    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), **KW), text=False, cumulative=False)
        engine.start()
        try:
            streams = [engine.add_request(p, sp, req_id=f"t{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
            tracked = [engine.processor.tracked[f"t{i}"].detok is not None for i in range(4)]
            return await asyncio.gather(*[collect(s) for s in streams]), tracked
        finally:
            await engine.shutdown()

    runs, tracked = asyncio.run(run())
    assert tracked == [False, True, False, False], "a detokenizer only where a stop string needs the text"
    for outs, r in zip(runs, ref):
        last = outs[-1]
        assert (last.token_ids, last.finish_reason, last.stop_reason) == (r.token_ids, r.finish_reason, r.stop_reason)
        assert [t for o in outs for t in o.delta_token_ids] == r.token_ids
        assert all(o.token_ids == [] for o in outs[:-1]), "nothing cumulative before the end"
    assert runs[1][-1].finish_reason == "stop" and runs[1][-1].text == ref[1].text
    assert runs[0][-1].text == "" and runs[2][-1].text == ""
    lps = [lp for o in runs[3] for lp in o.logprobs]
    assert len(lps) == len(ref[3].logprobs) == 24
    assert [sorted(a) for a in lps] == [sorted(b) for b in ref[3].logprobs]
    assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(lps, ref[3].logprobs) for t in a)


def test_a_held_requests_last_output_carries_its_kv_pages(tiny_code):
    """A request that finishes with its KV held for export (the prefill service's) gets its ranks and blocks on its
    last output, read in the step that finished it, so the service's export waits for no later step; they are what
    the core answers between steps; a request that holds nothing gets none."""
    prompts = _prompts(LLM(str(tiny_code), **KW).tokenizer, 3)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), **KW), text=False, cumulative=False)
        engine.start()
        try:
            long = engine.add_request(prompts[0], dataclasses.replace(first, max_tokens=40), req_id="busy")
            held = engine.add_request(prompts[1], first, req_id="held", hold_kv_on_finish=True)
            plain = engine.add_request(prompts[2], first, req_id="plain")
            outs = await asyncio.gather(*[until_last(s) for s in (held, plain, long)])
            asked = await engine.call(lambda core: core.kv_exports("held"))
            await engine.call(lambda core: core.release_held("held"))
            return outs, asked
        finally:
            await engine.shutdown()

    async def until_last(stream):
        return [out async for out in stream][-1]

    (held, plain, long), asked = asyncio.run(run())
    assert held.kv_exports == asked and asked and asked[0].block_ids
    assert plain.kv_exports is None and long.kv_exports is None


def test_each_forward_step_is_logged_with_the_threads_gap_before_it(tiny_code):
    """`drain_step_times`: one entry per step that ran a forward (not the step that only hands finished requests to
    the runner), its seconds and the engine thread's seconds since the previous step ended; None after an idle
    wait. The steps' seconds are the core's own step counter's."""
    prompts = _prompts(LLM(str(tiny_code), **KW).tokenizer, 2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), **KW), text=False, cumulative=False)
        engine.start()
        try:
            engine.drain_step_times()
            logs, forwards = [], []
            for i, p in enumerate(prompts):  # one request at a time, the engine idle in between
                before, steps = engine.core.step_seconds, engine.core.num_steps
                async for _ in engine.add_request(p, params, req_id=f"r{i}"):
                    pass
                await until(lambda: not engine.core.has_finished_to_drop(), "the drop step")
                await engine.call(lambda core: None)  # between two steps: the drop step has ended
                forwards.append((engine.core.step_seconds - before, engine.core.num_steps - steps))
                logs.append(engine.drain_step_times())
            return logs, forwards
        finally:
            await engine.shutdown()

    logs, forwards = asyncio.run(run())
    for log, (total, steps) in zip(logs, forwards):
        assert len(log) == steps - 1 >= 2, "every step but the one that only drops the finished request"
        assert log[0][1] is None, "the first step after idle has no gap"
        assert all(secs > 0 for secs, _ in log) and all(gap is not None and gap >= 0 for _, gap in log[1:])
        # the drop step is left out: the logged steps take what the core counted, less that one short step
        assert sum(secs for secs, _ in log) <= total + 1e-3
        assert sum(secs for secs, _ in log) >= 0.5 * total
