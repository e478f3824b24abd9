r"""`pdserve simulate`: `pdserve bench agentx` against a simulated deployment instead of a running one.

    pdserve simulate --config configs/topology.cpu.yaml --profile configs/profiles/cpu-tiny-code.json \
        --traces ../traces --concurrency 2,4 --duration 120 --warmup 20 --token-scale 0.01

The same traces, client (bench/serving/replay.py: sessions, turns, subagents, think times) and flags as
`bench agentx --fresh-server TOPOLOGY`, and the same outputs (result.json with the same per-level keys,
levels.csv, interactivity_vs_throughput.png, ttft_cdf.png) — each level on a fresh simulated system
(bench/simulate/system.py) on a virtual clock (bench/simulate/clock.py), so an hour of traffic takes what its
Python work takes and the same inputs and seed give the same result. Each level also gets `sim`: the engines'
busy fractions, KV use, transfer time, decode admission waits, and the part of the system that limits it.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.serving import results
from bench.serving.agentx import COPIES_PER_LEVEL, add_replay_args, select_traces, write_outputs
from bench.serving.metrics import measured_window, percentile, summarize
from bench.serving.replay import ReplayConfig, Replayer
from bench.serving.traces import load_traces
from bench.simulate import clock
from bench.simulate.profile import Profile, ProfileError
from bench.simulate.system import PHASES, SimSystem, engine_specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, action="append", metavar="TOPOLOGY",
                   help="the topology file to simulate; repeat it for a deployment of one file per host "
                        "(configs/h200x16/: prefill-host.yaml and decode-host.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="a what-if: change the topology before simulating it, PATH dotted keys into it, VALUE YAML "
                        "(services.decode.args.attention-config.hisparse_config.host_pool_gib=96, "
                        "services.decode.replicas=2); repeatable")
    p.add_argument("--profile", required=True, help="calibration profile (JSON, bench/simulate/profile.py)")
    p.add_argument("--model", help="model instead of the topology's: a preset name or a checkpoint folder")
    add_replay_args(p, context_from="the decode engine's max_model_len")  # bench agentx's, same meaning
    p.add_argument("--label", help="configuration name on plots (default: the topology's name)")
    p.add_argument("--output-dir", help="default: results/simulate-<label>-<time>")
    p.add_argument("--seed", type=int, default=0, help="trace order, prompt salt, acceptance draws, placement ties")
    p.add_argument("--no-served-prefill", action="store_true",
                   help="cost each prefill step by its engine-alone fit only, leaving out the profile's "
                        "`prefill_served` (what the running services added to a probe's step)")
    p.add_argument("--served-prefill-by-streams", action="store_true",
                   help="cost what the services add to a prefill step as the lone probes under the streams live "
                        "at its start, even where the profile measured a busy prefill's step (`prefill_served.busy_s`)")
    p.add_argument("--busy-handoff", action="store_true",
                   help="cost a handoff whose prefill has more work when it starts at the profile's busy handoff "
                        "(`transfer.busy_s`, measured by `bench calibrate --through-services` with the prefill kept "
                        "busy), where the profile has it")
    p.add_argument("--step-dispersion", action=argparse.BooleanOptionalAction, default=True,
                   help="draw each engine step around its cost as the profile's measured steps spread around their "
                        "fit (entries that kept them: `measured`; a busy served prefill step from the busy window's "
                        "histogram), not one cost per shape (default: on; --no-step-dispersion: one cost per shape)")
    return p


def _bottleneck(sim: dict) -> str:
    """What limits a level: requests refused for their size, decode admission (KV capacity), the busiest engine
    role, or nothing (clients)."""
    if sim.get("refused"):
        return f"KV capacity: {sim['refused']} requests refused (no pool can hold them)"
    if sim["decode_admission_waits"]:
        return "decode KV capacity (requests waited for blocks)"
    role, busy = max(sim["busy_fraction"].items(), key=lambda kv: kv[1])
    if busy >= 0.85:
        return f"{role} steps ({busy:.0%} busy)"
    queue = sim.get("time_by_phase_s", {}).get("prefill_queue", {}).get("p90", 0.0)
    if queue > max(1.0, sim["time_by_phase_s"].get("prefill", {}).get("p90", 0.0)):
        return (f"prefill queue in bursts (p90 wait {queue:.1f} s; prefill "
                f"{sim['busy_fraction'].get('prefill', 0.0):.0%} busy on average)")
    return f"none: the engines are {busy:.0%} busy at most (think time and the sessions' pace)"


def _phases(recorded) -> dict[str, dict[str, float]]:
    """Where the measured, completed requests' time went: mean, p50 and p90 seconds of each phase."""
    out = {}
    done = [p for rec, p in recorded if rec.measured and rec.ok]
    for name in PHASES:
        v = sorted(p[name] for p in done if name in p)
        if v:
            out[name] = {"mean": sum(v) / len(v), "p50": v[len(v) // 2], "p90": v[min(len(v) - 1, int(0.9 * len(v)))]}
    return out


def _step_quantiles(system: SimSystem, window) -> dict[str, dict[str, float | None]]:
    """Per role, the p50 / p90 / p99 (ms) of the steps that ran a forward and ended in the measured window: what a
    measured run reads from the services' step histograms (`server`: `decode_step_p90_ms`, ...)."""
    out = {}
    for role in ("prefill", "decode"):
        secs = [s for iid, e in system.engines.items() if system.specs[iid].role == role
                for end, s in e.step_log if window.start <= end <= window.end]
        out[role] = {f"p{q}": 1e3 * percentile(secs, q) if secs else None for q in (50, 90, 99)}
    return out


async def _level(args, level_idx: int, concurrency: int, traces, specs, profile: Profile) -> dict:
    random.seed(args.seed * 1000 + level_idx)  # the router breaks placement ties with random()
    system = SimSystem(specs, profile, args.seed, dispersion=args.step_dispersion,
                       served_prefill=not args.no_served_prefill, served_by_streams=args.served_prefill_by_streams,
                       busy_handoff=args.busy_handoff)
    dec = next(s for s in specs if s.role == "decode")
    cfg = ReplayConfig(concurrency=concurrency, duration_s=args.duration, warmup_s=args.warmup,
                       think_time_scale=args.think_time_scale, max_think_s=args.max_think_time,
                       max_context=args.max_context or dec.cfg.scheduler.max_model_len, ramp_up_s=args.ramp_up,
                       drain_timeout_s=args.drain_timeout, seed=args.seed,
                       copy_offset=(args.seed << 32) | ((level_idx + 1) * COPIES_PER_LEVEL),
                       vocab_size=dec.cfg.model.vocab_size, min_token_id=args.min_token_id)
    used = select_traces(traces, cfg, args.fit_traces)
    try:
        result = await Replayer(used, system.send, cfg, clock=system.loop.time, big_prompt=float("inf")).run()
    finally:
        await system.close()
    span = max(result.t_end - result.t_begin, 1e-9)
    by_role: dict[str, list[float]] = {}
    for iid, e in system.engines.items():
        by_role.setdefault(system.specs[iid].role, []).append(e.busy_s / span)
    sim = {"busy_fraction": {r: sum(v) / len(v) for r, v in by_role.items()},
           "steps": {iid: e.num_steps for iid, e in system.engines.items()},
           "kv_usage_end": {iid: e.kv.usage() for iid, e in system.engines.items()},
           "prefix_hit_rate": {iid: e.kv.prefix_hits / e.kv.prefix_queries if e.kv.prefix_queries else None
                               for iid, e in system.engines.items() if system.specs[iid].role == "prefill"},
           "transfer_s": system.transfer_s, "busy_handoffs": system.busy_handoffs if system.busy_handoff else None,
           "decode_admission_waits": system.admission_waits,
           "refused": system.refusals, "shared_device": system.shared_device,
           "kvstore": {i: {"usage": st.pool.usage, "loaded_blocks": st.loaded_blocks,
                           "offloaded_blocks": st.offloaded_blocks} for i, st in system.stores.items()},
           "host_kv_tier": {iid: {"stored_blocks": st.num_stored, "loaded_blocks": st.num_loaded,
                                  "hit_tokens": st.hits, "usage": st.usage, "copies_in_steps": e.offload_copies}
                            for iid, e in system.engines.items() if (st := e.kv.offload_stats()) is not None},
           "simulated_s": span,
           "prefill_busy_s": sum(e.busy_s for iid, e in system.engines.items() if system.specs[iid].role == "prefill"),
           "prefill_requests": sum("prefill" in p for _, p in system.phases)}
    sim["time_by_phase_s"] = _phases(system.phases)
    sim["bottleneck"] = _bottleneck(sim)
    window = measured_window(result.records, result.t_measure, result.t_stop)
    sim["step_ms"] = _step_quantiles(system, window)
    level = {"concurrency": concurrency, **summarize(result.records, window, num_gpus=system.num_gpus,
                                                    percentiles=args.percentiles)}
    level.update(sessions_started=len(result.sessions), num_traces=len(used), model=str(dec.cfg.model_path),
                 max_context=cfg.max_context, vocab_size=cfg.vocab_size,
                 ttft_s=sorted(r.ttft_s for r in result.records if r.measured and r.ok), sim=sim)
    return level


def run(args: argparse.Namespace) -> dict:
    if args.token_scale <= 0 or args.duration <= 0:
        raise ValueError("--token-scale and --duration must be > 0")
    args.label = args.label or "+".join(Path(c).stem for c in args.config)
    args.output_dir = args.output_dir or f"results/simulate-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}"
    profile = Profile.load(args.profile)
    traces = load_traces(args.traces, token_scale=args.token_scale, max_traces=args.max_traces)
    config = {k: v for k, v in vars(args).items() if k != "command"}
    out = {"benchmark": "agentx", "simulated": True, "version": 1, "label": args.label,
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": getattr(args, "command", None),
           "config": config, "profile": {k: profile.raw.get(k) for k in ("hardware", "commit", "date", "model")},
           "traces": [t.trace_id for t in traces], "valid": False, "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        specs = engine_specs(args.config, profile, args.model, Path(tmp), args.set)
        for i, c in enumerate(args.concurrency):
            t0 = time.perf_counter()
            level = clock.run(_level(args, i, c, traces, specs, profile))
            level["sim"]["wall_s"] = time.perf_counter() - t0
            out["levels"].append(level)
            out["valid"] = all(lv["valid"] for lv in out["levels"])
            write_outputs(out, Path(args.output_dir))
            print(results.format_table(out["levels"][-1:]) + f"\n  limited by: {level['sim']['bottleneck']} "
                  f"(simulated {level['sim']['simulated_s']:.0f} s in {level['sim']['wall_s']:.1f} s)",
                  file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = ["pdserve", "simulate", *argv]
    try:
        out = run(args)
    except (ValueError, ProfileError, RuntimeError) as e:
        print(f"pdserve simulate: error: {e}", file=sys.stderr)
        return 2
    print(results.format_table(out["levels"]))
    print(f"results in {args.output_dir}/ (result.json, levels.csv, interactivity_vs_throughput.png, ttft_cdf.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
