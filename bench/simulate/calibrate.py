r"""`pdserve bench calibrate`: measure a topology's engine steps on this machine and write a simulation profile.

    pdserve bench calibrate --config configs/topology.cpu.yaml --out configs/profiles/cpu-tiny-code.json \
        --transfer-gbs 2.0 --transfer-latency-s 0.002 --request-overhead-s 0.003 --source "how those were had"

For the topology's prefill and decode engines (one rank each: the layouts this machine can run), the real
engine (`EngineCore` on the topology's engine flags, on this machine's device) steps through a grid of
batches — prompts of several lengths, alone and after a cached prefix (prefill); with `--traces`, also the turns
of those traces as `bench agentx` would send them, each after its cached prefix; 1 to 16 requests decoding at
two contexts, with the topology's MTP (decode) — and every step's wall time is recorded with the chunks it ran.
The step cost's terms (bench/simulate/profile.py; `chunk_ctx_s` too) are the non-negative least-squares fit of
those steps, each step's error relative to its time, their total kept (`nnls_fit`); with `--traces` the prefill's
are fitted to the traces' steps, and the grid's show how the fit extrapolates. Each entry keeps its steps
(features and seconds), residual and the machine, commit and date. The transfer and per-request service costs
are not measured here: they are flags, each recorded with `--source`. `--through-services` measures them through
the running topology instead, and where its prefill and decode share a device, how much each slows while the other
steps (`shared_device`, `_sharing`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.serving.client import RequestRecord, make_session, server_info, stream_completion
from bench.serving.engine_counters import (
    STEP_COUNTERS,
    STEP_HISTOGRAMS,
    engine_counters,
    histogram_buckets,
    histogram_quantile,
    step_histograms,
)
from bench.serving.synth import PromptSynth
from bench.serving.target import FreshServer, wait_ready
from bench.serving.traces import load_traces
from bench.simulate.profile import MEASURED_TERMS, Profile, StepCost, decode_key, draft_passes
from bench.simulate.system import engine_cfg, hisparse_admits, model_dir, services_of
from engine.core.core import EngineCore
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.frontend.core_factory import make_engine_core
from services.launch import topology as topology_mod

FIT_TERMS = MEASURED_TERMS  # what a calibrated step is fitted over (bench/simulate/profile.py)


def _features(chunks) -> list[float]:
    n = sum(len(c.token_ids) for c in chunks)
    ctx = sum(len(c.token_ids) * (c.start + len(c.token_ids) / 2) for c in chunks)
    read = sum(c.start + len(c.token_ids) for c in chunks)
    return [1.0, float(n), ctx, float(len(chunks)), float(read), float(draft_passes(chunks))]


@dataclass(frozen=True)
class _Chunk:
    """A chunk's shape, as the scheduler's chunks give it to a step cost: its first position, its tokens and the
    drafts it proposes for the next step."""
    start: int
    token_ids: list[int]
    max_drafts: int = 0


def _cost(coef: list[float]) -> StepCost:
    return StepCost(**dict(zip(FIT_TERMS, coef)))


def _timed_steps(core: EngineCore, device: str) -> list[tuple[list[float], float]]:
    """Step the core until it is idle; every step that ran chunks: (features, seconds)."""
    seen = []
    schedule = core.scheduler.schedule

    def spy():
        out = schedule()
        seen.append(out)
        return out

    core.scheduler.schedule = spy
    rows = []
    try:
        while core.has_unfinished():
            seen.clear()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            core.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            chunks = [c for s in seen for c in s.chunks]
            if chunks:
                rows.append((_features(chunks), dt))
    finally:
        core.scheduler.schedule = schedule
    return rows


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(16, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure_prefill(core: EngineCore, device: str, lengths: list[int],
                    salt: int = 0) -> list[tuple[list[float], float]]:
    """The prefill grid's steps; `salt` > 0 draws other prompts (a warm-up pass that leaves no cached prefix the
    measured pass could hit)."""
    vocab = core.cfg.model.vocab_size
    rows = []
    s = 100_000 * salt
    for i, n in enumerate(lengths):
        prompt = _ids(n, s + 100 + i, vocab)
        turn2 = prompt + _ids(max(n // 4, 8), s + 200 + i, vocab)
        # fresh, then twice after a cached prefix: a quarter as many rows, then 32 (a short turn reads its context)
        for turn, p in enumerate((prompt, turn2, turn2 + _ids(32, s + 400 + i, vocab))):
            core.add_request(Request(f"p{salt}-{i}-{turn}", p, SamplingParams(max_tokens=1, ignore_eos=True)))
            rows += _timed_steps(core, device)
        for j in range(3):  # three fresh prompts in one step: the per-request term
            core.add_request(Request(f"p{salt}-{i}-b{j}", _ids(n // 2 + 8, s + 300 + 10 * i + j, vocab),
                                     SamplingParams(max_tokens=1, ignore_eos=True)))
        rows += _timed_steps(core, device)
    return rows


GROUPS = (1, 1, 2, 4)  # the traces' requests per step in the trace grid (measure_prefill_traces), in turn


def measure_prefill_traces(core: EngineCore, device: str, traces: list, turns: int,
                           salt: int = 0) -> list[tuple[list[float], float]]:
    """The prefill steps of the traces' own requests: each trace's first `turns` turns in order (subagents depth
    first; a turn over the engine's context limit skipped), prompts synthesised as `bench agentx` sends them, so
    every turn after the first finds its recorded prefix cached. The traces go in groups of GROUPS' sizes in turn:
    one request at a time, or a turn of each trace of the group in one step, each trace one turn behind the one
    before it (so a first turn's long fresh prompt meets the others' cached turns, as under concurrency, not the
    group's other first turns); the batches tell the per-request term from the fixed one. These are the chunk
    shapes a replay of those traces gives the engine, timed on an otherwise idle engine (no queueing, no other
    engine)."""
    vocab, limit = core.cfg.model.vocab_size, core.cfg.scheduler.max_model_len
    rows = []
    plans, i = [], 0
    for size in itertools.cycle(GROUPS):
        if i >= len(traces):
            break
        plans.append(traces[i:i + size])
        i += size
    for g, group in enumerate(plans):
        sessions = [(PromptSynth(t.trace_id, 1000 * salt + 10 * g + j, vocab_size=vocab),
                     [u for u in t.session.turns() if u.input_len + 1 <= limit][:turns]) for j, t in enumerate(group)]
        for r in range(max(j + len(us) for j, (_, us) in enumerate(sessions))):
            for j, (synth, us) in enumerate(sessions):
                if 0 <= r - j < len(us):  # trace j of the group one turn behind trace j - 1
                    core.add_request(Request(f"t{salt}-{g}-{j}-{r - j}", synth.prompt(us[r - j]),
                                             SamplingParams(max_tokens=1, ignore_eos=True)))
            rows += _timed_steps(core, device)
    return rows


def measure_decode(core: EngineCore, device: str, batches: list[int], contexts: list[int],
                   tokens: int, salt: int = 0) -> list[tuple[list[float], float]]:
    vocab = core.cfg.model.vocab_size
    rows = []
    for ctx in contexts:
        for b in batches:
            for j in range(b):
                core.add_request(Request(f"d{salt}-{ctx}-{b}-{j}",
                                         _ids(ctx, 100_000 * salt + 1000 * b + j + ctx, vocab),
                                         SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)))
            steps = _timed_steps(core, device)
            rows += [r for r in steps if r[0][1] <= b * (1 + core.cfg.num_spec_tokens)]  # decode steps only
    return rows


async def _served(url: str, batches: list[int], prompt_len: int, tokens: int, vocab: int,
                  redis_url: str | None = None) -> dict:
    """Through the running services: per batch B, B concurrent streams of `tokens` tokens after `prompt_len`-token
    prompts -> the median TPOT; and the median TTFT of single requests. With the deployment's `redis_url`, each
    single request's own engine work too (its prefill's and its decode's step seconds, from their counters): the
    service overhead is then TTFT less the prefill's measured steps, the handoff the second token's delay less the
    decode's, not less a fitted step."""
    async with make_session() as http:
        info = await server_info(http, url)
        model = info["model"]

        async def one(seed: int, n_out: int):
            rec = await stream_completion(http, url, model, _ids(prompt_len, seed, vocab), n_out)
            if rec.error:
                raise RuntimeError(f"calibration request failed: {rec.error}")
            return rec

        await one(1, 4)  # warm-up
        singles, work = [], []
        for i in range(5):
            if redis_url:  # the engines publish their step counters every 0.5 s: read them settled
                await asyncio.sleep(1.1)
            before = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS) if redis_url else None
            singles.append(await one(10 + i, 2))
            if before is not None:
                await asyncio.sleep(1.1)
                after = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS)
                work.append({r: after[r][STEP_COUNTERS[1]] - before[r][STEP_COUNTERS[1]]
                             for r in ("prefill", "decode")})
        ttft = [r.ttft_s for r in singles]
        second = [r.t_end - r.t_first for r in singles]  # the handoff to the decode and its first step
        measured = {}
        if work:
            measured = {"overhead_s": statistics.median(max(r.ttft_s - w["prefill"], 0.0)
                                                        for r, w in zip(singles, work)),
                        "handoff_s": statistics.median(max(s - w["decode"], 0.0) for s, w in zip(second, work)),
                        "prefill_step_s": statistics.median(w["prefill"] for w in work),
                        "prefill_steps_s": [w["prefill"] for w in work],
                        # the decode's step seconds over the request: its one forward (a 2-token request's
                        # decode proposes no draft) and the step that drops the finished request: the counters
                        # count two steps (under async scheduling the forward's time splits across the two)
                        "decode_step_s": statistics.median(w["decode"] for w in work)}
        tpot = {}
        for b in batches:
            recs = await asyncio.gather(*(one(100 * b + j, tokens) for j in range(b)))
            tpot[b] = statistics.median((r.t_end - r.t_first) / max(r.output_tokens - 1, 1) for r in recs)
        under = []
        if redis_url:
            long = max((info.get("max_model_len") or 4096) - prompt_len - 1, tokens)
            for k in sorted({max(max(batches) // 4, 1), max(batches)}):
                under.append(await _overhead_under_streams(http, url, model, vocab, redis_url, k, prompt_len, long))
    return {"ttft_s": statistics.median(ttft), "second_token_s": statistics.median(second), "tpot_s": tpot,
            "singles": measured, "under_streams": under}


PROBES = 5  # probe requests per stream count (bench calibrate --through-services)
PROBE_LEN = 128  # their prompts' tokens
SETTLE_S = 1.1  # the engines publish their step counters every 0.5 s: a read this long after a request has it


async def _overhead_under_streams(http, url: str, model: str, vocab: int, redis_url: str, k: int, prompt_len: int,
                                  long: int) -> dict:
    """The service overhead of a request while `k` other requests stream their tokens: `k` long streams kept
    going (each restarted when it ends), then PROBES single `prompt_len`-token requests one after another, each
    one's TTFT less its own prefill steps (the prefill engine's step counters over the probe; a probe during
    which a stream (re)started, whose prefill steps would be counted with it, is discarded and sent again). This
    is the host work the streams put on the router, the services and the client, which an idle measurement
    misses."""
    stop = asyncio.Event()
    starts: list[float] = []
    live: list[RequestRecord] = []

    async def stream(j: int) -> None:
        n = 0
        while not stop.is_set():
            rec = RequestRecord(prompt_len=prompt_len, max_tokens=long)
            live.append(rec)
            starts.append(time.perf_counter())
            await stream_completion(http, url, model, _ids(prompt_len, 700_000 + 1_000 * j + n, vocab), long, rec)
            live.remove(rec)
            n += 1
            if rec.error:
                raise RuntimeError(f"calibration stream failed: {rec.error}")

    tasks = [asyncio.create_task(stream(j)) for j in range(k)]
    try:
        while sum(r.t_first > 0 for r in live) < k:  # every stream past its first token
            if any(t.done() for t in tasks):
                await asyncio.gather(*tasks)  # a failed stream's error
            await asyncio.sleep(0.05)
        got, seed = [], 800_000 + 10_000 * k
        while len(got) < PROBES and seed < 800_000 + 10_000 * k + 4 * PROBES:
            await asyncio.sleep(SETTLE_S)
            t0 = time.perf_counter()
            before = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS)
            streaming = sum(r.t_first > 0 and r.t_end == 0.0 for r in live)
            rec = await stream_completion(http, url, model, _ids(prompt_len, seed, vocab), 2)
            seed += 1
            await asyncio.sleep(SETTLE_S)
            after = await asyncio.to_thread(engine_counters, redis_url, STEP_COUNTERS)
            if rec.error:
                raise RuntimeError(f"calibration probe failed: {rec.error}")
            if any(t >= t0 - SETTLE_S for t in starts):  # a stream's prefill fell in the probe's window
                continue
            step = after["prefill"][STEP_COUNTERS[1]] - before["prefill"][STEP_COUNTERS[1]]
            dec = {n: after["decode"][n] - before["decode"][n] for n in STEP_COUNTERS}
            got.append((streaming, max(rec.ttft_s - step, 0.0), step,
                        handoff_latency(rec.t_end - rec.t_first, dec[STEP_COUNTERS[1]], dec[STEP_COUNTERS[0]],
                                        time.perf_counter() - t0)))
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not got:
        raise RuntimeError(f"calibration: no probe under {k} streams ran without a stream starting beside it")
    return {"streams": statistics.median(g[0] for g in got), "overhead_s": statistics.median(g[1] for g in got),
            "prefill_step_s": statistics.median(g[2] for g in got), "prefill_steps_s": [g[2] for g in got],
            "handoff_s": statistics.median(g[3] for g in got), "probes": len(got)}


def handoff_latency(second_token_s: float, decode_secs: float, decode_steps: float, window_s: float) -> float:
    """The KV handoff's own latency from one 2-token probe while other requests stream: the delay of its second
    token (the decode's first output) less what the simulation adds to that latency on its own, the wait for the
    decode's step in progress (reserving the import, then joining a step: each half a step on average, at the
    decode's busy fraction u) and the probe's first decode step, i.e. (1 + u) mean steps. The mean step and u come
    from the decode's step counters over the probe's window. (The bytes' time, a 128-token prompt's, is left in.)"""
    if decode_steps <= 0 or window_s <= 0:
        return max(second_token_s, 0.0)
    step = decode_secs / decode_steps
    busy = min(decode_secs / window_s, 1.0)
    return max(second_token_s - (1.0 + busy) * step, 0.0)


def served_prefill(engines: dict, idle_step_s: float, under: list[dict], prompt_len: int,
                   idle_steps_s: list[float] | None = None) -> dict:
    """The profile's `prefill_served` entry: a `prompt_len`-token probe's prefill step in the running services
    (the engine's step counters), idle (`idle_step_s`) and under each stream count of `under`
    (`_overhead_under_streams`), beside the same prompt's step on the engine alone: measured (`probe_alone_s` of
    the prefill entry, `measure_probe_alone`), else what the entry's fit says it costs. Each probe's own step is
    kept too (`probe_steps_s`, by stream count), where it was measured: how much a lone step spreads."""
    entry = engines["prefill/pcp1-dcp1"]
    alone = entry.get("probe_alone_s")
    how = f"the median step of {PROBES} such prompts on the engine alone"
    if alone is None:
        alone = Profile({"version": 1, "engines": engines}).engine("prefill/pcp1-dcp1")([_Chunk(0, [0] * prompt_len)])
        how = "the engine-alone fit of that step"
    steps = {"0": idle_steps_s, **{f"{u['streams']:g}": u.get("prefill_steps_s") for u in under}}
    return {"alone_s": alone, "prompt_len": prompt_len,
            "by_streams": [[0, idle_step_s], *([u["streams"], u["prefill_step_s"]] for u in under)],
            "probe_steps_s": {k: v for k, v in steps.items() if v},
            "source": f"pdserve bench calibrate --through-services: the prefill engine's step counters over each "
                      f"{prompt_len}-token probe (median of {PROBES}), idle and while "
                      f"{', '.join(str(u['streams']) for u in under)} other requests streamed their tokens; "
                      f"alone_s: {how}"}


def busy_prefill(engines: dict, busy_s: float | None, longest: int | None, load: str,
                 buckets: list | None = None) -> dict | None:
    """`prefill_served`'s busy window: the prefill's mean step while kept busy through the services (`_sharing`'s
    window with the prefill alone, `busy_s`), beside the same prompts' step on the engine alone (`busy_alone_s`):
    the traces' turns' median step there (the prefill entry's `median_step_s`, measured on them) or, for fresh
    `longest`-token prompts, what the entry's fit says such a prompt costs. None where either is missing.
    `buckets`: the window's step histogram ([upper bound or None for +Inf, cumulative count]), kept as
    `busy_step_buckets` where it counted steps (the busy step's spread, Profile.served_prefill_spread)."""
    entry = engines.get("prefill/pcp1-dcp1") or {}
    if longest is None:
        alone, how = entry.get("median_step_s"), "the median of the same turns' steps on the engine alone"
    else:
        alone = Profile({"version": 1, "engines": engines}).engine("prefill/pcp1-dcp1")([_Chunk(0, [0] * longest)])
        how = f"the engine-alone fit of a {longest}-token prompt"
    if not busy_s or not alone:
        return None
    out = {"busy_s": busy_s, "busy_alone_s": alone,
           "busy_source": f"busy_s: the prefill engine's mean step while kept busy through the services ({load}; "
                          f"the shared_device window with the decode idle); busy_alone_s: {how}"}
    if buckets and buckets[-1][1] > 0:
        out["busy_step_buckets"] = buckets
        out["busy_source"] += "; busy_step_buckets: that window's step-duration histogram (steps that ran a forward)"
    return out


def measure_probe_alone(core: EngineCore, device: str, salt: int = 0) -> float:
    """The median step of a fresh PROBE_LEN-token prompt alone on the engine, no service around it: what the
    through-services probes' prefill steps are set beside (`served_prefill`)."""
    vocab, times = core.cfg.model.vocab_size, []
    for j in range(PROBES):
        core.add_request(Request(f"probe{salt}-{j}", _ids(PROBE_LEN, 900_000 + 100 * salt + j, vocab),
                                 SamplingParams(max_tokens=1, ignore_eos=True)))
        times += [t for _, t in _timed_steps(core, device)]
    return statistics.median(times)


WINDOW_S = 8.0  # the shortest sharing window (bench calibrate --through-services)


def sharing_slowdown(alone_s: float, shared_s: float, other_busy: float) -> float:
    """An engine's slowdown on a device it shares, from its mean step alone (`alone_s`) and while the other engine
    was in a step a fraction `other_busy` of the time (`shared_s`), under processor sharing (engines.SharedDevice):
    work W lasts W / (1 - u + u / s), so s = u / (alone / shared - 1 + u). At least 1; 1 when the other was never
    busy; capped at 10 (a step that slowed more than sharing can explain)."""
    u = min(max(other_busy, 0.0), 1.0)
    if u <= 0.0 or shared_s <= alone_s:
        return 1.0
    denom = alone_s / shared_s - 1.0 + u
    return min(max(u / denom, 1.0), 10.0) if denom > 0 else 10.0


def fresh_prompts(n: int, vocab: int, seed: int) -> Iterator[list[int]]:
    """Fresh `n`-token prompts, none sharing a prefix."""
    for s in itertools.count(seed):
        yield _ids(n, s, vocab)


def trace_prompts(traces: list, vocab: int, loop: int, loops: int) -> Iterator[list[int]]:
    """The prompts of loop `loop` of `loops`: the turns of every loops-th trace in order, as `bench agentx` sends
    them (a new session copy of each trace every pass, so each copy's later turns find their prefix cached)."""
    mine = traces[loop::loops] or traces
    for n in itertools.count():
        for t in mine:
            synth = PromptSynth(t.trace_id, 1_000_000 + n * loops + loop, vocab_size=vocab)
            for turn in t.session.turns():
                yield synth.prompt(turn)


async def _sharing(url: str, redis_url: str, vocab: int, prompts: list[Iterator[list[int]]], batch: int,
                   tokens: int) -> dict:
    """Each engine's mean step (its own step counters) alone and with the other engine busy at the same time. The
    prefill is kept busy by one loop per iterator of `prompts` (`fresh_prompts`, or `trace_prompts`: the traces'
    turns after their cached prefixes), each a request of one token (no decode work); the decode by `batch` streams
    of 64 x `tokens` tokens after 128-token prompts, admitted before any window opens (so the decode's batch is the
    same in its windows; a stream that ends is followed by another, whose 128-token prefill is the only prefill work
    of theirs that can fall in a window). Three windows: the prefill alone, the decode alone, both; each closes once
    its engines have run enough steps, and WINDOW_S (the engines publish their counters every 0.5 s: the busy
    fractions' error is at most about 1 / 16). Returns each role's slowdown (`sharing_slowdown`) and the windows it
    came from."""
    seeds = itertools.count(900_000)  # the decode streams (fresh_prompts draws from 500,000 up)
    async with make_session() as http:
        model = (await server_info(http, url))["model"]

        async def one(ids: list[int], n_out: int) -> None:
            rec = await stream_completion(http, url, model, ids, n_out)
            if rec.error:
                raise RuntimeError(f"calibration request failed: {rec.error}")

        def read() -> dict:
            return engine_counters(redis_url, STEP_COUNTERS)

        async def steps_after(role: str, n: int, tasks: list) -> None:
            """Wait for `role` to run `n` more steps (the load under way); a finished load task ends the wait."""
            start = (await asyncio.to_thread(read))[role][STEP_COUNTERS[0]]
            while (await asyncio.to_thread(read))[role][STEP_COUNTERS[0]] < start + n:
                if any(t.done() for t in tasks):
                    return
                await asyncio.sleep(0.05)

        async def window(need: dict[str, int], tasks: list) -> dict:
            hist = await asyncio.to_thread(step_histograms, redis_url)
            before, t0 = await asyncio.to_thread(read), time.monotonic()
            while True:
                await asyncio.sleep(0.05)
                after, wall = await asyncio.to_thread(read), time.monotonic() - t0
                ran = {r: after[r][STEP_COUNTERS[0]] - before[r][STEP_COUNTERS[0]] for r in ("prefill", "decode")}
                ended = any(t.done() for t in tasks)
                if ended or (wall >= WINDOW_S and all(ran[r] >= n for r, n in need.items())):
                    break
            hist_after = await asyncio.to_thread(step_histograms, redis_url)
            out = {"wall_s": wall, "load_ended_early": ended}
            for role in ("prefill", "decode"):
                secs = after[role][STEP_COUNTERS[1]] - before[role][STEP_COUNTERS[1]]
                buckets = histogram_buckets(hist.get(role, {}), hist_after.get(role, {}), STEP_HISTOGRAMS[0][0])
                out[role] = {"steps": ran[role], "mean_step_s": secs / ran[role] if ran[role] else None,
                             "busy": secs / wall,
                             # the steps' spread in the window (the step histogram: its quantiles, and its
                             # buckets, [upper bound, cumulative count] with +Inf written as null)
                             "step_quantiles_s": {f"p{q}": histogram_quantile(q / 100, buckets) for q in (50, 90, 99)},
                             "step_buckets": [[None if le == float("inf") else le, n] for le, n in buckets]}
            return out

        async def busy_handoffs() -> dict:
            """PROBES single PROBE_LEN-token requests of two tokens while the prefill is kept busy (the decode idle
            besides): each one's second-token delay less the decode's step seconds over it (its counters), as
            `_served` measures the handoff in the idle services."""
            handoffs = []
            for j in range(PROBES):
                await asyncio.sleep(SETTLE_S)
                before = await asyncio.to_thread(read)
                rec = await stream_completion(http, url, model, _ids(PROBE_LEN, 800_000 + j, vocab), 2)
                if rec.error:
                    raise RuntimeError(f"calibration request failed: {rec.error}")
                await asyncio.sleep(SETTLE_S)
                after = await asyncio.to_thread(read)
                decode = after["decode"][STEP_COUNTERS[1]] - before["decode"][STEP_COUNTERS[1]]
                handoffs.append(max(rec.t_end - rec.t_first - decode, 0.0))
            return {"median_s": statistics.median(handoffs), "handoffs_s": handoffs}

        stop, stop_streams = asyncio.Event(), asyncio.Event()

        async def prefill_loop(source: Iterator[list[int]]) -> None:
            while not stop.is_set():
                await one(next(source), 1)

        async def stream_loop() -> None:  # a stream that ends is followed by another (a fast decode outlives one)
            while not stop_streams.is_set():
                await one(_ids(128, next(seeds), vocab), 64 * tokens)

        await one(next(prompts[0]), 1)  # warm-up: first-call costs stay out of the windows
        got = {}
        load = [asyncio.create_task(prefill_loop(p)) for p in prompts]
        await steps_after("prefill", 2, load)
        got["prefill_alone"] = await window({"prefill": 6}, load)
        got["handoff_busy"] = await busy_handoffs()
        stop.set()
        await asyncio.gather(*load)
        streams = [asyncio.create_task(stream_loop()) for _ in range(batch)]
        await steps_after("decode", 5, streams)
        got["decode_alone"] = await window({"decode": 40}, streams)
        stop.clear()
        load = [asyncio.create_task(prefill_loop(p)) for p in prompts]
        await steps_after("prefill", 2, load + streams)
        got["both"] = await window({"prefill": 6, "decode": 40}, load + streams)
        stop.set()
        stop_streams.set()
        for t in streams:
            t.cancel()
        await asyncio.gather(*load, *streams, return_exceptions=True)
    out = {"measurements": got}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        alone, shared = got[f"{role}_alone"][role]["mean_step_s"], got["both"][role]["mean_step_s"]
        if not alone or not shared:
            raise RuntimeError(f"calibration: the {role} engine ran no step in a sharing window ({got})")
        out[role] = sharing_slowdown(alone, shared, got["both"][other]["busy"])
    return out


CONTEXT_TERMS = ("token_ctx_s", "chunk_ctx_s")  # the step cost's terms that grow with the context
# what served_decode_fit takes from the engine-alone fit: the context terms, and the draft passes' (every served
# step at steady state proposes k drafts, so their cost cannot be told from the step's own there)
ENGINE_ALONE_TERMS = (*CONTEXT_TERMS, "draft_pass_s")
# with a served step that proposes no draft (served_single_row): the draft passes' cost is the served steps' own,
# and the per-token term the engine alone's (the served steps' tokens are proportional to their requests but for
# that one step, which also sets the draft term)
ENGINE_ALONE_TERMS_WITH_SINGLE = (*CONTEXT_TERMS, "token_s")


def served_decode_fit(rows: list[tuple[list[float], float]], engine_only: dict | None,
                      single: tuple[list[float], float] | None = None) -> tuple[list[float], float]:
    """The served decode steps' fit: `rows` (served_decode_rows) are all at one context, so they cannot tell a
    per-request cost from one that grows with the context (their features are proportional), nor the draft passes'
    cost from the step's own (each proposes k drafts). Those terms (ENGINE_ALONE_TERMS) are taken from the
    engine-alone fit (`engine_only`, measured at several contexts, down to a request's last drafts) and the other
    terms fitted to what remains; without it, all terms are fitted. `single` (served_single_row): a served step of
    one request that proposes no draft, measured through the services too: then the draft passes' cost is fitted
    to the served steps with it (a service whose host work overlaps the device runs them cheaper than the engine
    alone does, or for nothing) and the per-token term is held instead (ENGINE_ALONE_TERMS_WITH_SINGLE).
    -> (coefficients in FIT_TERMS order, the median relative error over the rows, `single` among them)."""
    held_terms = ENGINE_ALONE_TERMS_WITH_SINGLE if single else ENGINE_ALONE_TERMS
    rows = rows + ([single] if single else [])
    if not engine_only:
        return nnls_fit(rows)
    fixed = {t: float(engine_only.get(t, 0.0)) for t in held_terms}
    free = [i for i, t in enumerate(FIT_TERMS) if t not in fixed]
    held = [(i, fixed[t]) for i, t in enumerate(FIT_TERMS) if t in fixed]
    rest = [([f[i] for i in free], max(t - sum(f[i] * c for i, c in held), 0.0)) for f, t in rows]
    part, _ = nnls_fit(rest)
    coef = [fixed[t] if t in fixed else part[free.index(i)] for i, t in enumerate(FIT_TERMS)]
    rel = statistics.median(abs(sum(c * x for c, x in zip(coef, f)) - t) / t for f, t in rows)
    return coef, rel


def served_single_row(step_s: float, context: int) -> tuple[list[float], float]:
    """The decode step of a lone 2-token request through the services (`step_s`, the decode engine's step seconds
    over it, from its counters: the one forward it needs and the step that drops it once finished): one request,
    one token at `context`, and no draft proposed (its last token is the step's)."""
    return _features([_Chunk(context, [0], 0)]), step_s


def served_decode_rows(tpot: dict[int, float], k: int, acceptance: float, context: int) -> list:
    """A served decode step of B requests, from its TPOT: step = TPOT x tokens per step per request."""
    chunk = _Chunk(context, [0] * (1 + k), k)  # each request's rows: its token and its drafts; k drafts next
    return [(_features([chunk] * b), t * acceptance) for b, t in tpot.items()]


TOTAL_WEIGHT = 100.0  # nnls_fit(relative=True): the total's equation against the steps' (almost a constraint)


def nnls_fit(rows: list[tuple[list[float], float]], relative: bool = False) -> tuple[list[float], float]:
    """Non-negative least squares of seconds over the features (drop a term fitted negative, refit).

    relative: each step's error relative to its own seconds, and one more equation, as heavy as all the steps
    together, for their total: steps whose times span orders of magnitude (a short turn's tens of milliseconds, a
    long fresh prompt's seconds) are each fitted, not only the longest, and the fit still spends the measured
    seconds in all (the simulated engine is as busy as the measured one)."""
    X = torch.tensor([f for f, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for _, t in rows], dtype=torch.float64)
    A, b = X, y
    if relative:
        A = torch.cat([X / y[:, None], X.sum(dim=0, keepdim=True) / y.sum() * TOTAL_WEIGHT * len(rows)])
        b = torch.cat([torch.ones_like(y), torch.tensor([TOTAL_WEIGHT * len(rows)], dtype=torch.float64)])
    keep = [i for i in range(X.shape[1]) if X[:, i].abs().max() > 0] or [0]  # a feature no step has: 0
    while True:
        cols = A[:, keep]
        scale = cols.abs().amax(dim=0).clamp(min=1e-12)
        sol = torch.linalg.lstsq(cols / scale, b[:, None]).solution[:, 0] / scale
        if (sol >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(torch.argmin(sol)))
    coef = [0.0] * X.shape[1]
    for k, v in zip(keep, sol.tolist()):
        coef[k] = max(v, 0.0)
    pred = X @ torch.tensor(coef, dtype=torch.float64)
    rel = ((pred - y).abs() / y).median().item()
    return coef, rel


def extrapolation(coef: list[float], rows: list[tuple[list[float], float]]) -> dict:
    """How a fit does on steps it was not fitted to: their median relative error and predicted / measured seconds."""
    pred = [sum(c * f for c, f in zip(coef, feat)) for feat, _ in rows]
    return {"steps": len(rows),
            "median_relative_error": statistics.median(abs(p - t) / t for p, (_, t) in zip(pred, rows)),
            "seconds_predicted_over_measured": sum(pred) / sum(t for _, t in rows)}


def _measure_traces(core: EngineCore, device: str, a: argparse.Namespace, salt: int) -> list:
    """The trace grid twice (other session copies: nothing cached from the first pass), against the noise of
    one."""
    traces = _traces(a)
    return [r for s in (salt, salt + 2) for r in measure_prefill_traces(core, device, traces, a.turns, s)]


def _traces(a: argparse.Namespace) -> list:
    """The calibration's traces (--traces, --token-scale, --max-context, --max-traces)."""
    traces = load_traces(a.traces, token_scale=a.token_scale)
    if a.max_context:  # the traces `bench agentx --fit-traces --max-context` replays
        traces = [t for t in traces if t.max_request_tokens <= a.max_context]
    if not traces:
        raise ValueError(f"--traces {a.traces}: no trace there" + (f" fits in {a.max_context} tokens"
                                                                  if a.max_context else ""))
    return traces[:a.max_traces]


def _measure(kind: str, core: EngineCore, device: str, a: argparse.Namespace, salt: int) -> list:
    """The grid of `kind` (prefill or decode) from the command's flags; salt > 0: other prompts (unrecorded)."""
    if kind == "prefill":
        return measure_prefill(core, device, [int(x) for x in a.prompt_lens.split(",")], salt)
    return measure_decode(core, device, [int(x) for x in a.batches.split(",")],
                          [int(x) for x in a.contexts.split(",")], a.decode_tokens, salt)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="TOPOLOGY")
    p.add_argument("--model", help="model instead of the topology's (preset or checkpoint folder)")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-lens", default="64,256,1024,2048")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--traces", default=None, help="also time the prefill steps of these traces' turns "
                   "(AgentX format, as `bench agentx --traces`), one request at a time and in pairs")
    p.add_argument("--token-scale", type=float, default=1.0, help="with --traces: as `bench agentx --token-scale`")
    p.add_argument("--max-context", type=int, default=None, help="with --traces: only the traces whose every request "
                   "fits in this many tokens (as `bench agentx --fit-traces --max-context`)")
    p.add_argument("--max-traces", type=int, default=8, help="with --traces: at most this many traces")
    p.add_argument("--turns", type=int, default=16, help="with --traces: each trace's first this many turns")
    p.add_argument("--transfer-gbs", type=float, required=True)
    p.add_argument("--transfer-latency-s", type=float, required=True)
    p.add_argument("--request-overhead-s", type=float, required=True)
    p.add_argument("--kvstore-gbs", type=float, default=None, help="kvstore load/offload bandwidth (default: the "
                   "transfer's)")
    p.add_argument("--kvstore-latency-s", type=float, default=None,
                   help="kvstore call latency (default: the transfer's, measured with --through-services)")
    p.add_argument("--source", required=True, help="where the transfer, kvstore and overhead figures come from")
    p.add_argument("--through-services", action="store_true",
                   help="also start the topology (`pdserve up`) and time decode steps as the services run them (B "
                        "concurrent streams: TPOT x tokens per step) and the per-request overhead (TTFT of one short "
                        "request less its prefill step): the decode entry is then the served one")
    return p


def run(a: argparse.Namespace) -> dict:
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    topo = topology_mod.load(a.config)
    hardware = torch.cuda.get_device_name() if device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    prof = {"version": 1, "hardware": hardware, "hbm_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                                                            if device.startswith("cuda") else None),
            "commit": _commit(), "date": time.strftime("%Y-%m-%d"), "model": "", "engines": {},
            "transfer": {"latency_s": a.transfer_latency_s, "gbs": a.transfer_gbs, "source": a.source},
            "request_overhead_s": {"value": a.request_overhead_s, "source": a.source}}
    with tempfile.TemporaryDirectory() as tmp:
        mdir = model_dir(a.model or topo.model, Path(a.config), Path(tmp))
        prof["model"] = str(a.model or topo.model)
        for kind in ("prefill", "decode"):
            spec = topo.service(kind)
            core = make_engine_core(engine_cfg(spec, mdir, device=device))
            cfg = core.cfg
            core.add_request(Request("warmup", _ids(300, 7, cfg.model.vocab_size),
                                     SamplingParams(max_tokens=8, ignore_eos=True)))
            _timed_steps(core, device)  # first-call costs (allocations, kernel builds) stay out of the fit
            traced = kind == "prefill" and a.traces
            if device.startswith("cuda"):  # a GPU compiles kernels at each new shape: one unrecorded pass first
                _measure(kind, core, device, a, salt=1)
                if traced:
                    _measure_traces(core, device, a, salt=1)
            rows = _measure(kind, core, device, a, salt=0)
            grid = None
            if traced:  # fitted on the traces' own steps; the grid's steps show how that fit extrapolates
                grid, rows = rows, _measure_traces(core, device, a, salt=0)
            if kind == "prefill":
                key = "prefill/pcp1-dcp1"
            else:
                key = decode_key(1, hisparse_admits(cfg))
                if cfg.speculative is not None:
                    st = core.stats()
                    prof["mtp_acceptance_length"] = st.spec_emitted / st.spec_steps if st.spec_steps else None
            coef, rel = nnls_fit(rows, relative=True)
            what = f"{len(rows)} steps" + (f" of the turns of {a.traces} (token scale {a.token_scale})" if grid else "")
            prof["engines"][key] = {**dict(zip(FIT_TERMS, coef)), "median_relative_error": rel, "steps": len(rows),
                                    "median_step_s": statistics.median(t for _, t in rows),
                                    "source": f"pdserve bench calibrate on {hardware} ({device}), {what}"}
            # the steps themselves ([features of _features..., seconds]): the fit can be checked or redone offline
            prof["engines"][key]["measured"] = [[*f, t] for f, t in rows]
            if grid:
                prof["engines"][key]["grid"] = extrapolation(coef, grid)
            if kind == "prefill" and a.through_services:  # the probes' prompt alone, set beside it in the services
                if device.startswith("cuda"):
                    measure_probe_alone(core, device, salt=1)
                prof["engines"][key]["probe_alone_s"] = measure_probe_alone(core, device)
            print(f"{key}: {_cost(coef)} median |error| {rel:.1%} over {len(rows)} steps", file=sys.stderr)
            del core, cfg
            gc.collect()  # the next engine sizes its KV pool from the device's free memory
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    if a.through_services:
        _calibrate_served(a, prof)
    same = [f for f, v in (("latency", a.kvstore_latency_s), ("bandwidth", a.kvstore_gbs)) if v is None]
    latency = prof["transfer"]["latency_s"] if a.kvstore_latency_s is None else a.kvstore_latency_s
    prof["kvstore"] = {"latency_s": latency, "gbs": a.transfer_gbs if a.kvstore_gbs is None else a.kvstore_gbs,
                       "source": a.source + (f"; {' and '.join(same)} taken from the transfer entry (the same NIXL "
                                             f"path on this machine)" if same else "")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(prof, indent=1) + "\n")
    Profile.load(a.out)  # what it wrote reads back
    return prof


def _calibrate_served(a, prof: dict) -> None:
    prompt_len, tokens = PROBE_LEN, 48
    batches = [int(x) for x in a.batches.split(",")]
    topo = topology_mod.load(a.config)
    shares = services_of([a.config])[4]
    busy = busy_handoff = None  # the prefill kept busy through the services: its step, a handoff then
    with FreshServer(a.config) as ep:
        info = asyncio.run(wait_ready(ep.url))
        vocab = info.get("vocab_size") or 4096
        got = asyncio.run(_served(ep.url, batches, prompt_len, tokens, vocab, ep.handle.redis_url))
        if shares:  # the two engines on one device: how much each slows while the other steps
            if a.traces:
                traces = _traces(a)
                prompts = [trace_prompts(traces, vocab, i, 2) for i in range(2)]
                load = f"the turns of {len(traces)} traces of {a.traces}, two loops"
            else:
                longest = max(int(x) for x in a.prompt_lens.split(","))
                prompts = [fresh_prompts(longest, vocab, 500_000 + 100_000 * i) for i in range(2)]
                load = f"two loops of {longest}-token prompts"
            sharing = asyncio.run(_sharing(ep.url, ep.handle.redis_url, vocab, prompts, max(batches) // 2 or 1,
                                           tokens))
            window = sharing["measurements"]["prefill_alone"]["prefill"]
            busy = busy_prefill(prof["engines"], window["mean_step_s"], None if a.traces else longest, load,
                                window["step_buckets"])
            busy_handoff = sharing["measurements"].pop("handoff_busy", None)
            prof["shared_device"] = {"prefill": sharing["prefill"], "decode": sharing["decode"],
                                     "measurements": sharing["measurements"],
                                     "source": f"pdserve bench calibrate --through-services: each engine's mean "
                                               f"step (its step counters) alone and with the other kept busy "
                                               f"({load}; {max(batches) // 2 or 1} decode streams)"}
            print(f"shared device: prefill x{sharing['prefill']:.2f}, decode x{sharing['decode']:.2f}",
                  file=sys.stderr)
            for name, w in sharing["measurements"].items():  # the steps' spread in each window (recorded only)
                spread = {r: w[r]["step_quantiles_s"] for r in ("prefill", "decode") if w[r]["steps"]}
                print(f"{name} window steps: " + "; ".join(
                    f"{r} " + " ".join(f"{q} {v * 1e3:.1f} ms" for q, v in qs.items() if v is not None)
                    for r, qs in spread.items()), file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = engine_cfg(topo.service("decode"), model_dir(a.model or topo.model, Path(a.config), Path(tmp)))
    k = cfg.num_spec_tokens if cfg.with_mtp else 0
    key = decode_key(1, hisparse_admits(cfg))
    acceptance = (cfg.speculative.synthetic_acceptance_length if cfg.speculative else None) or \
        prof.get("mtp_acceptance_length") or 1.0
    rows = served_decode_rows(got["tpot_s"], k, acceptance, prompt_len + tokens // 2)
    engine_only = prof["engines"].get(key)
    single = got["singles"]
    one = served_single_row(single["decode_step_s"], prompt_len) if single and k else None
    coef, rel = served_decode_fit(rows, engine_only, one)
    fitted = rows + ([one] if one else [])
    held = "context and per-token" if one else "context and draft-pass"
    prof["engines"][key] = {**dict(zip(FIT_TERMS, coef)), "median_relative_error": rel, "steps": len(fitted),
                            "measured": [[*f, t] for f, t in fitted],
                            "engine_only": engine_only,
                            "source": f"pdserve bench calibrate --through-services: TPOT of 1-{max(batches)} "
                                      f"concurrent streams x {acceptance:.2f} tokens per step, at one context "
                                      f"({prompt_len + tokens // 2} tokens)"
                                      + (f", and a lone 2-token request's decode step (no draft proposed, "
                                         f"{one[1] * 1e3:.1f} ms, counters)" if one else "")
                                      + (f"; the {held} terms are the engine-alone fit's" if engine_only else "")}
    if single:  # each request's own engine steps, read from the engines' counters
        overhead, handoff = single["overhead_s"], single["handoff_s"]
        less = (f"its prefill's steps (median {single['prefill_step_s'] * 1e3:.1f} ms, the prefill engine's step "
                f"counters)", f"its decode's steps (median {single['decode_step_s'] * 1e3:.1f} ms, counters)")
    else:
        pre = Profile({"version": 1, "engines": prof["engines"]}).engine("prefill/pcp1-dcp1")
        chunk = _Chunk(0, [0] * prompt_len)
        overhead = max(got["ttft_s"] - pre([chunk]), 0.0)
        dec = Profile({"version": 1, "engines": prof["engines"]}).engine(key)
        handoff = max(got["second_token_s"] - dec([_Chunk(prompt_len, [0], k)]), 0.0)
        less = ("the prefill engine's fitted step", "the decode's fitted first step")
    prof["request_overhead_s"] = {"value": overhead, "source": f"median over 5 single {prompt_len}-token requests "
                                  f"through the services (median TTFT {got['ttft_s'] * 1e3:.1f} ms) of TTFT less "
                                  f"{less[0]}"}
    if got["under_streams"]:  # the same while other requests stream: the host work their tokens put on the path
        under = got["under_streams"]
        prof["request_overhead_s"].update(
            by_streams=[[u["streams"], u["overhead_s"]] for u in under], under_streams=under,
            source=prof["request_overhead_s"]["source"] + f"; by_streams: the median over {PROBES} such requests "
            f"while {', '.join(str(u['streams']) for u in under)} other requests streamed their tokens (median "
            f"streams during the probes), each TTFT less its prefill's steps (counters)")
    if single and got["under_streams"]:  # the probes' own prefill steps, beside the engine-alone fit of that step
        prof["prefill_served"] = served_prefill(prof["engines"], single["prefill_step_s"], got["under_streams"],
                                                prompt_len, single["prefill_steps_s"])
        if busy is not None:
            prof["prefill_served"].update(busy)
        print("served prefill step: " + ", ".join(f"{y * 1e3:.1f} ms at {x:g} streams"
                                                   for x, y in prof["prefill_served"]["by_streams"])
              + f" (engine alone: {prof['prefill_served']['alone_s'] * 1e3:.1f} ms)", file=sys.stderr)
    # the KV handoff: from the first token (prefill) to the second (the decode's first step), less that step
    prof["transfer"] = {"latency_s": handoff, "gbs": a.transfer_gbs,
                        "source": f"latency: median over 5 single {prompt_len}-token requests of the time from the "
                                  f"first to the second token ({got['second_token_s'] * 1e3:.1f} ms median) less "
                                  f"{less[1]}; bandwidth: {a.source}"}
    if busy_handoff is not None:  # measured beside the busy window; simulated with `--busy-handoff`
        prof["transfer"]["busy_s"] = busy_handoff["median_s"]
        prof["transfer"]["busy_handoffs_s"] = busy_handoff["handoffs_s"]
        prof["transfer"]["source"] += (f"; busy_s (simulated with --busy-handoff): the median over {PROBES} such "
                                       f"requests' handoffs while the prefill was kept busy (the shared_device "
                                       f"window's load), each less the decode's step seconds over it")
        print(f"handoff while the prefill is busy: {busy_handoff['median_s'] * 1e3:.1f} ms", file=sys.stderr)
    if got["under_streams"]:  # the same latency while other requests stream (handoff_latency)
        prof["transfer"]["by_streams"] = [[u["streams"], u["handoff_s"]] for u in got["under_streams"]]
        prof["transfer"]["source"] += (f"; by_streams: the median over {PROBES} such requests while other requests "
                                       f"streamed, each second token's delay less (1 + u) of the decode's mean step "
                                       f"over its window (u: the decode's busy fraction there; step counters)")
    print(f"served decode: {_cost(coef)} median |error| {rel:.1%}; request overhead {overhead * 1e3:.1f} ms, "
          f"handoff {handoff * 1e3:.1f} ms", file=sys.stderr)
    for u in got["under_streams"]:
        print(f"request overhead with {u['streams']:g} streams: {u['overhead_s'] * 1e3:.1f} ms (prefill step "
              f"{u['prefill_step_s'] * 1e3:.1f} ms, handoff {u['handoff_s'] * 1e3:.1f} ms, {u['probes']} probes)",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(a)
    except ValueError as e:
        print(f"pdserve bench calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
