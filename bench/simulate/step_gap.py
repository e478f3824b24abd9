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

Each probe's step time is the core's step-seconds counter over it (its prefill, and the step that then hands the
finished request to the runner). Writes the medians and spreads as JSON.

    python -m bench.simulate.step_gap --config configs/topology.gpu-1.yaml --out step-gap.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.simulate.system import engine_cfg, model_dir
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.core_factory import make_engine_core
from services.launch import topology as topology_mod

MODES = ("back_to_back", "idle_gap", "engine_thread", "polling")


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


def run(a: argparse.Namespace) -> dict:
    unknown = [m for m in a.modes.split(",") if m not in MODES]
    if unknown:  # before any engine is built
        raise ValueError(f"unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}")
    topo = topology_mod.load(a.config)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = engine_cfg(topo.service("prefill"), model_dir(a.model or topo.model, Path(a.config), Path(tmp)),
                         device=device)
        core = make_engine_core(cfg)
    vocab = cfg.model.vocab_size
    seeds = iter(range(1_000, 100_000))
    for i in range(a.probes):  # kernels compile at the probe's shape: an unrecorded pass first
        _core_probe(core, _prompt(a.prompt_len, next(seeds), vocab), f"w{i}")
    out = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "prompt_len": a.prompt_len, "probes": a.probes, "gap_s": a.gap_s,
           "poll_s": a.poll_s, "date": time.strftime("%Y-%m-%d"), "modes": {}}
    for mode in a.modes.split(","):
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
        ms = sorted(1e3 * s for s in got)
        out["modes"][mode] = {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "steps_ms": ms}
        print(f"{mode:>14}: median {statistics.median(ms):.2f} ms (min {ms[0]:.2f}, max {ms[-1]:.2f})",
              file=sys.stderr)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


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
