"""`python -m bench.simulate.step_gap`: where a lone prompt's prefill step gains time between the engine alone and
the running prefill service.

`bench calibrate --through-services` found a fresh 128-token prompt's prefill step (the engine's own step counter)
at 18.3 ms in the idle services on an H100 against 11.2 ms on the engine alone (tiny-code; 16.9 against ~12 ms for
the GLM-5.3-width model), and the measured `bench agentx` levels agree (about 22 ms a request at c = 4). This
times the same prompt's step on the topology's prefill engine in steps that add one difference of the service at a
time:

    back_to_back   the engine core alone, one prompt after another (as `bench calibrate` times its steps)
    idle_gap       the same, each prompt after `--gap-s` of idle (the device and the host idle between requests,
                   as a lone request finds them)
    engine_thread  each prompt after the gap through AsyncEngine, whose loop runs the core in a thread of its own
                   beside an event loop (the service's process shape), that loop otherwise idle
    polling        the same with a task on the event loop waking every `--poll-s` (a NIXL agent's progress task
                   polls every 2 ms while busy)
    beside_services  back to back on the engine alone again, now with the whole topology started and idle beside
                   it (its processes, their CUDA contexts and threads on the same host and device)
    served         each prompt after the gap as a request through the running topology's router (max_tokens 2),
                   the prefill service's own step counters over it (as `bench calibrate --through-services` reads
                   them), with that step split by phase

Each probe's step time is the core's step-seconds counter over it (its prefill, and the step that then hands the
finished request to the runner). The last two modes start the topology once (`pdserve up`), after the others.
With `--py-spy FILE`, `py-spy record` samples the prefill service's threads while the served probes run (raw
collapsed stacks, for where a served step's time goes). Writes the medians and spreads as JSON.

    python -m bench.simulate.step_gap --config configs/topology.gpu-1.yaml --out step-gap.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.serving.client import make_session, server_info, stream_completion
from bench.serving.engine_counters import PHASES, STEP_COUNTERS, engine_counters
from bench.serving.target import FreshServer, wait_ready
from bench.simulate.system import engine_cfg, model_dir
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.core_factory import make_engine_core
from services.launch import topology as topology_mod

MODES = ("back_to_back", "idle_gap", "engine_thread", "polling", "beside_services", "served")
SERVICE_MODES = ("beside_services", "served")  # the topology started for these
SETTLE_S = 1.1  # the least idle before a served probe (as `bench calibrate --through-services` leaves its probes)
PHASE_COUNTERS = tuple(f'pdserve:engine_step_phase_seconds_total{{phase="{p}"}}' for p in PHASES)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(16, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=1, ignore_eos=True)


def _core_probe(core, prompt: list[int], rid: str) -> float:
    """One prompt through the core alone until it is idle again: the step seconds it took."""
    before = core.step_seconds
    core.add_request(Request(rid, prompt, _params()))
    while core.has_unfinished() or core.has_finished_to_drop():
        core.step()
    return core.step_seconds - before


async def _thread_probes(core, config, prompts: list[list[int]], gap_s: float, poll_s: float | None) -> list[float]:
    """Each prompt after the gap through AsyncEngine (its core in the engine thread), with a polling task on the
    event loop when `poll_s` is given."""
    engine = AsyncEngine(config, core=core, text=False, cumulative=False)
    engine.start()
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            await asyncio.sleep(poll_s)

    poller = asyncio.create_task(poll()) if poll_s else None
    marks = []  # the step seconds before each probe, after its gap (nothing else steps the core meanwhile)
    try:
        for i, p in enumerate(prompts):
            await asyncio.sleep(gap_s)
            marks.append(core.step_seconds)
            async for _ in engine.add_request(p, _params(), f"t{poll_s}-{i}"):
                pass
        await asyncio.sleep(min(gap_s, 0.2))  # the last probe's drop step, run right after its output
        marks.append(core.step_seconds)
    finally:
        stop.set()
        if poller is not None:
            await poller
        await engine.shutdown()
    return [b - a for a, b in zip(marks, marks[1:])]


async def _served_probes(url: str, redis_url: str, prompts: list[list[int]], gap_s: float) -> tuple[list, list]:
    """Each prompt after the gap as a request through the router: the prefill service's step seconds over it, and
    those seconds by phase."""
    names = STEP_COUNTERS + PHASE_COUNTERS
    steps, phases = [], []
    async with make_session() as http:
        model = (await server_info(http, url))["model"]
        for p in prompts:
            await asyncio.sleep(max(gap_s, SETTLE_S))
            before = (await asyncio.to_thread(engine_counters, redis_url, names))["prefill"]
            rec = await stream_completion(http, url, model, p, 2)
            if rec.error:
                raise RuntimeError(f"step_gap: a served probe failed: {rec.error}")
            after = await _counted(redis_url, names, before[STEP_COUNTERS[0]] + 2)
            steps.append(after[STEP_COUNTERS[1]] - before[STEP_COUNTERS[1]])
            phases.append({ph: after[n] - before[n] for ph, n in zip(PHASES, PHASE_COUNTERS)})
    return steps, phases


async def _counted(redis_url: str, names: tuple[str, ...], steps: float, timeout_s: float = 60.0) -> dict:
    """The prefill's counters once they count `steps` steps (a probe's prefill and the step that hands it to the
    runner; the services publish their counters every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = (await asyncio.to_thread(engine_counters, redis_url, names))["prefill"]
        if got[STEP_COUNTERS[0]] >= steps:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"step_gap: the prefill's step counters stayed at {got[STEP_COUNTERS[0]]:g} steps "
                               f"for {timeout_s:g} s, waiting for {steps:g}")
        await asyncio.sleep(0.1)


def _py_spy(pid: int, out: str) -> subprocess.Popen | None:
    """`py-spy record` of a process's threads until stopped (SIGINT makes it write `out`), when py-spy is here."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("step_gap: py-spy not found, no samples taken", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--threads",
                             "--nonblocking", "--output", out], stdout=subprocess.DEVNULL)


def _record(out: dict, mode: str, got: list[float]) -> None:
    ms = sorted(1e3 * s for s in got)
    out["modes"][mode] = {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "steps_ms": ms}
    print(f"{mode:>16}: median {statistics.median(ms):.2f} ms (min {ms[0]:.2f}, max {ms[-1]:.2f})", file=sys.stderr)


def run(a: argparse.Namespace) -> dict:
    unknown = [m for m in a.modes.split(",") if m not in MODES]
    if unknown:  # before any engine is built
        raise ValueError(f"unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}")
    topo = topology_mod.load(a.config)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = engine_cfg(topo.service("prefill"), model_dir(a.model or topo.model, Path(a.config), Path(tmp)),
                         device=device)
        if a.gpu_memory_utilization is not None:  # the probe's own engine beside the topology's on one device
            cfg = dataclasses.replace(cfg, cache=dataclasses.replace(
                cfg.cache, gpu_memory_utilization=a.gpu_memory_utilization))
        core = make_engine_core(cfg)
    vocab = cfg.model.vocab_size
    seeds = iter(range(1_000, 100_000))
    for i in range(a.probes):  # kernels compile at the probe's shape: an unrecorded pass first
        _core_probe(core, _prompt(a.prompt_len, next(seeds), vocab), f"w{i}")
    out = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "prompt_len": a.prompt_len, "probes": a.probes, "gap_s": a.gap_s,
           "poll_s": a.poll_s, "date": time.strftime("%Y-%m-%d"), "modes": {}}
    modes = a.modes.split(",")
    for mode in [m for m in modes if m not in SERVICE_MODES]:
        prompts = [_prompt(a.prompt_len, next(seeds), vocab) for _ in range(a.probes)]
        if mode == "back_to_back":
            got = [_core_probe(core, p, f"b{i}") for i, p in enumerate(prompts)]
        elif mode == "idle_gap":
            got = []
            for i, p in enumerate(prompts):
                time.sleep(a.gap_s)
                got.append(_core_probe(core, p, f"g{i}"))
        else:  # engine_thread, polling
            got = asyncio.run(_thread_probes(core, cfg, prompts, a.gap_s, a.poll_s if mode == "polling" else None))
        _record(out, mode, got)
        _write(a.out, out)
    if any(m in SERVICE_MODES for m in modes):
        with FreshServer(a.config) as ep:
            asyncio.run(wait_ready(ep.url))
            if "beside_services" in modes:
                prompts = [_prompt(a.prompt_len, next(seeds), vocab) for _ in range(a.probes)]
                _record(out, "beside_services", [_core_probe(core, p, f"s{i}") for i, p in enumerate(prompts)])
                _write(a.out, out)
            if "served" in modes:
                prompts = [_prompt(a.prompt_len, next(seeds), vocab) for _ in range(a.probes + 1)]
                pid = next(p.pid for p in ep.handle.processes if p.kind == "prefill")
                asyncio.run(_served_probes(ep.url, ep.handle.redis_url, prompts[:1], 0.0))  # its first request
                spy = _py_spy(pid, a.py_spy) if a.py_spy else None
                try:
                    got, phases = asyncio.run(_served_probes(ep.url, ep.handle.redis_url, prompts[1:], a.gap_s))
                finally:
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(timeout=60)
                _record(out, "served", got)
                out["modes"]["served"]["phases_ms"] = {
                    ph: statistics.median(1e3 * p[ph] for p in phases) for ph in PHASES}
    _write(a.out, out)
    return out


def _write(path: str, out: dict) -> None:
    """After every mode: what was measured survives a later mode's failure."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.simulate.step_gap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="TOPOLOGY", help="the topology whose prefill engine to time")
    p.add_argument("--model", help="model instead of the topology's")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--gap-s", type=float, default=1.0, help="idle before each probe (idle_gap and after)")
    p.add_argument("--poll-s", type=float, default=0.002, help="the polling mode's wake-up interval")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="this bench's own engine's share of the device (default: the topology's prefill flag); the "
                        "service modes start the topology's engines beside it, on the same device")
    p.add_argument("--py-spy", metavar="FILE", help="served mode: py-spy's samples of the prefill service to FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    for name, v in (("--prompt-len", a.prompt_len), ("--probes", a.probes)):
        if v < 1:
            print(f"step_gap: error: {name} must be at least 1, got {v}", file=sys.stderr)
            return 2
    try:
        run(a)
    except ValueError as e:
        print(f"step_gap: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
