r"""`python -m bench.simulate.fidelity`: a measured `bench agentx` run against `pdserve simulate` of the same run.

    pdserve bench agentx --fresh-server configs/topology.gpu-1.yaml --traces DIR --concurrency 4,16 ... \
        --output-dir real
    python -m bench.simulate.fidelity --real real/result.json --profile PROFILE.json --out compare.json

The simulation gets the measured run's own topology, traces, levels, client flags and seed (read from its
result.json `config`; `--traces` when the folder has moved), and, where the run recorded it, the MTP acceptance its
decode engines reported (an input as the traces are: how often the model's drafts match on these prompts), so the
two differ only in what the profile costs.
For every level it sets the five figures the issue bounds side by side — TTFT p50 and p90, TPOT p50, throughput
per GPU and interactivity — with sim / real and whether each is within `--bound` (0.15 on a GPU, 0.25 on the CPU
topology). Writes the comparison (JSON, with the simulated run's result beside it) and prints a markdown table.

`--real` takes several result.json files of one command (the same topology, traces, levels, flags and seed): each
figure is then compared with their median, and the table shows the runs' own spread (largest / smallest), since a
short level's tail figures may not repeat to the bound between two runs of the measurement itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

FIGURES = (("p50_ttft_ms", "TTFT p50 ms"), ("p90_ttft_ms", "TTFT p90 ms"), ("p50_tpot_ms", "TPOT p50 ms"),
           ("throughput_per_gpu", "tok/s per GPU"), ("interactivity", "interactivity (tok/s/user)"))
# the replay flags both commands share, as `bench agentx` stores them in result.json's config
_FLAGS = ("max_traces", "duration", "warmup", "ramp_up", "drain_timeout", "think_time_scale", "max_think_time",
          "token_scale", "max_context", "min_token_id", "seed")


def simulate_argv(real: dict, profile: str, out_dir: str, traces: str | None = None,
                  config: str | None = None) -> list[str]:
    """`pdserve simulate`'s arguments for the measured run `real` (its result.json)."""
    c = real["config"]
    topo = config or c.get("fresh_server")
    if not topo:
        raise ValueError("the measured run has no --fresh-server topology; name it with --config")
    traces = traces or c.get("traces")
    if not traces or not Path(traces).exists():
        raise ValueError(f"traces {traces!r} not found; name the folder with --traces")
    argv = ["--config", topo, "--profile", profile, "--traces", traces, "--output-dir", out_dir,
            "--concurrency", ",".join(str(x) for x in c["concurrency"]), "--label", f"sim-{c.get('label') or 'run'}"]
    for key in _FLAGS:
        if c.get(key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(c[key])]
    if c.get("fit_traces"):
        argv.append("--fit-traces")
    acceptance = measured_acceptance(real)
    if acceptance is not None:  # the decode's MTP acceptance as the measured run's prompts met it: an input
        argv += ["--set", f"services.decode.args.speculative-config.synthetic_acceptance_length={acceptance:.4f}"]
    return argv


def measured_acceptance(real: dict) -> float | None:
    """The MTP acceptance length the measured run's decode engines reported over all its levels (`decode_mtp`,
    recorded by `bench agentx --fresh-server`), or None when the run recorded none."""
    got = [lv["decode_mtp"] for lv in real.get("levels", []) if lv.get("decode_mtp")]
    rounds = sum(g["full_rounds"] for g in got)
    return sum(g["tokens"] for g in got) / rounds if rounds else None


_SAME = ("fresh_server", "traces", "concurrency", *_FLAGS, "fit_traces")


def median_run(runs: list[dict]) -> dict:
    """Several measured runs of one command as one: each level's figures (FIGURES, the mean TTFT, the services'
    figures, the TPOT's parts) the median over the runs, their values kept (`runs`), the MTP counters summed.
    ValueError when the runs are not of one command."""
    first = runs[0]
    for r in runs[1:]:
        diff = [k for k in _SAME if r["config"].get(k) != first["config"].get(k)]
        if diff:
            raise ValueError(f"--real: the runs are not of one command (they differ in {', '.join(diff)})")
    if len(runs) == 1:
        return first
    levels = []
    for i, lv in enumerate(first["levels"]):
        group = [r["levels"][i] for r in runs]
        out = dict(lv)
        for key in [k for k, _ in FIGURES] + ["mean_ttft_ms", *TPOT_PARTS]:
            vals = [g.get(key) for g in group]
            out[key] = statistics.median(vals) if None not in vals else None
            out.setdefault("runs", {})[key] = vals
        servers = [g["server"] for g in group if g.get("server")]
        if servers:
            numeric = [k for k, v in servers[0].items()
                       if isinstance(v, (int, float)) and all(isinstance(s.get(k), (int, float)) for s in servers)]
            out["server"] = {k: statistics.median(s[k] for s in servers) for k in numeric}
        mtp = [g["decode_mtp"] for g in group if g.get("decode_mtp")]
        if mtp:
            out["decode_mtp"] = {"full_rounds": sum(m["full_rounds"] for m in mtp),
                                 "tokens": sum(m["tokens"] for m in mtp)}
        out["valid"] = all(g.get("valid", True) for g in group)
        levels.append(out)
    return {**first, "levels": levels}


def compare_levels(real: list[dict], sim: list[dict], bound: float) -> list[dict]:
    """Per concurrency present in both: {concurrency, figures: {key: {real, sim, ratio, within}}}."""
    by_c = {lv["concurrency"]: lv for lv in sim}
    out = []
    for lv in real:
        s = by_c.get(lv["concurrency"])
        if s is None:
            continue
        figs = {}
        gpus = (lv.get("num_gpus"), s.get("num_gpus"))
        counted_apart = all(gpus) and gpus[0] != gpus[1]
        for key, _ in FIGURES:
            r, v = lv.get(key), s.get(key)
            regpu = key == "throughput_per_gpu" and counted_apart
            if regpu and v is not None:
                v = v * gpus[1] / gpus[0]  # over the measured run's GPU count (its `--num-gpus`), like with like
            ratio = v / r if r and v is not None else None
            figs[key] = {"real": r, "sim": v, "ratio": ratio,
                         "within": ratio is not None and abs(ratio - 1.0) <= bound}
            if regpu:
                figs[key]["gpus"] = {"real": gpus[0], "sim": gpus[1]}
            runs = lv.get("runs", {}).get(key)
            if runs and None not in runs and min(runs) > 0:  # the measurement's own spread over its runs
                figs[key].update(runs=runs, spread=max(runs) / min(runs))
        out.append({"concurrency": lv["concurrency"], "real_valid": lv.get("valid", True),
                    "sim_valid": s.get("valid", True), "figures": figs,
                    "within": sum(f["within"] for f in figs.values()), "of": len(figs),
                    "bottleneck": s.get("sim", {}).get("bottleneck"), "ttft_split": ttft_split(lv, s),
                    "tpot_split": tpot_split(lv, s), "steps": step_split(lv, s)})
    return out


def step_split(real: dict, sim: dict) -> dict | None:
    """The engines' steps that ran a forward, p50 and p90 (ms), measured (the services' step histograms over the
    measured window, `server`) against simulated (`sim.step_ms`); None when the measured level predates them."""
    sv, steps = real.get("server") or {}, sim.get("sim", {}).get("step_ms") or {}
    keys = [(role, q) for role in ("prefill", "decode") for q in (50, 90)]
    if all(sv.get(f"{role}_step_p{q}_ms") is None for role, q in keys):
        return None
    return {f"{role}_p{q}": {"real": sv.get(f"{role}_step_p{q}_ms"), "sim": steps.get(role, {}).get(f"p{q}")}
            for role, q in keys}


TPOT_PARTS = ("p50_handoff_ms", "p90_handoff_ms", "p50_decode_itl_ms", "p90_decode_itl_ms")


def tpot_split(real: dict, sim: dict) -> dict | None:
    """Where a request's TPOT went, measured against simulated (ms): the first gap after the first token (the KV
    handoff to the decode and its first step) and the decode's gaps after it, p50 and p90; None when the measured
    level predates these figures."""
    if any(real.get(k) is None for k in TPOT_PARTS):
        return None
    return {k.removesuffix("_ms"): {"real": real[k], "sim": sim.get(k)} for k in TPOT_PARTS}


def ttft_split(real: dict, sim: dict) -> dict | None:
    """Where the mean TTFT went, measured against simulated (ms), when the measured level recorded its services'
    figures (`server`, read by `bench agentx --fresh-server` at the measured window's edges): `before_prefill` is
    the client's mean TTFT less the prefill service's own (HTTP, router, gRPC; simulated: the profile's service
    overhead and any kvstore load), `prefill_service` the prefill service's (its queue and steps),
    `prefill_steps_per_request` the prefill engine's step time over the requests it prefilled (the measured engine
    also counts a step that only hands finished requests to the runner, so its mean step is no step's time)."""
    sv, phases = real.get("server"), sim.get("sim", {}).get("time_by_phase_s")
    if not sv or not phases or sv.get("prefill_mean_ttft_ms") is None or real.get("mean_ttft_ms") is None:
        return None
    mean = {k: 1e3 * v["mean"] for k, v in phases.items()}
    busy, n = sim["sim"].get("prefill_busy_s"), sim["sim"].get("prefill_requests")
    return {"before_prefill": {"real": real["mean_ttft_ms"] - sv["prefill_mean_ttft_ms"],
                               "sim": mean["service"] + mean["kvstore_load"]},
            "prefill_service": {"real": sv["prefill_mean_ttft_ms"], "sim": mean["prefill_queue"] + mean["prefill"]},
            "prefill_steps_per_request": {"real": sv.get("prefill_step_ms_per_request"),
                                          "sim": 1e3 * busy / n if n and busy is not None else None},
            "router": {"real": sv.get("router_mean_ttft_ms"), "sim": None}}


def table(rows: list[dict], bound: float) -> str:
    several = any("spread" in f for row in rows for f in row["figures"].values())
    head = "| c | figure | real | simulated | sim / real |" + (" runs' spread |" if several else "")
    lines = [head, "|---" * (6 if several else 5) + "|"]
    for row in rows:
        for key, name in FIGURES:
            f = row["figures"][key]
            ratio = "-" if f["ratio"] is None else (f"**{f['ratio']:.2f}**" if f["within"] else f"{f['ratio']:.2f}")
            fmt = (lambda x: "-" if x is None else f"{x:,.1f}")
            spread = (f" {f['spread']:.2f} |" if "spread" in f else " - |") if several else ""
            lines.append(f"| {row['concurrency']} | {name} | {fmt(f['real'])} | {fmt(f['sim'])} | {ratio} |{spread}")
    lines.append(f"\nBold: within {bound:.0%}." + (" Real: the median of the runs; spread: their largest over their "
                                                      "smallest." if several else ""))
    regpu = {(f["gpus"]["real"], f["gpus"]["sim"]) for row in rows for f in row["figures"].values() if "gpus" in f}
    for real_gpus, sim_gpus in sorted(regpu):
        lines.append(f"tok/s per GPU: the simulated run's total over the measured run's {real_gpus} GPU(s) (the "
                     f"simulation counts {sim_gpus} for this topology; the measured run's `--num-gpus` decides).")
    fmt = (lambda x: "-" if x is None else f"{x:.1f}")
    for row in rows:
        for name, split in (("mean TTFT", row.get("ttft_split")), ("TPOT's parts", row.get("tpot_split")),
                            ("engine steps", row.get("steps"))):
            if split:
                lines.append(f"c = {row['concurrency']}, {name} ms, real / sim: " + ", ".join(
                    f"{k.replace('_', ' ')} {fmt(v['real'])} / {fmt(v['sim'])}" for k, v in split.items()))
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict:
    from bench.simulate import cli

    runs = []
    for path in a.real:
        run = json.loads(Path(path).read_text())
        if run.get("simulated"):
            raise ValueError(f"{path} is a simulated run; --real takes a measured `bench agentx` result")
        runs.append(run)
    real = median_run(runs)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = a.sim_output_dir or tmp
        argv = simulate_argv(real, a.profile, out_dir, a.traces, a.config)
        argv.append("--step-dispersion" if a.step_dispersion else "--no-step-dispersion")
        if a.no_served_prefill:
            argv.append("--no-served-prefill")
        if a.served_prefill_by_streams:
            argv.append("--served-prefill-by-streams")
        if a.busy_handoff:
            argv.append("--busy-handoff")
        if cli.main(argv) != 0:
            raise RuntimeError("pdserve simulate failed (its error is above)")
        sim = json.loads((Path(out_dir) / "result.json").read_text())
    rows = compare_levels(real["levels"], sim["levels"], a.bound)
    out = {"real": a.real, "profile": a.profile, "bound": a.bound, "simulate_argv": argv, "levels": rows,
           "mtp_acceptance": {"measured_run": measured_acceptance(real),
                              "profile": json.loads(Path(a.profile).read_text()).get("mtp_acceptance_length")},
           "simulated": sim}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(table(rows, a.bound))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate.fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", required=True, nargs="+",
                   help="result.json of a measured `pdserve bench agentx --fresh-server` run; several runs of one "
                        "command: compared with their median")
    p.add_argument("--profile", required=True)
    p.add_argument("--traces", help="the trace folder, when it is not where the measured run read it")
    p.add_argument("--config", help="the topology, when the measured run's is not at its recorded path")
    p.add_argument("--bound", type=float, default=0.15, help="relative bound per figure (default 0.15)")
    p.add_argument("--out", help="comparison JSON")
    p.add_argument("--sim-output-dir", help="keep the simulated run's outputs here")
    p.add_argument("--step-dispersion", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate with `--step-dispersion` (the default) or `--no-step-dispersion`")
    p.add_argument("--no-served-prefill", action="store_true", help="simulate with `--no-served-prefill`")
    p.add_argument("--served-prefill-by-streams", action="store_true",
                   help="simulate with `--served-prefill-by-streams`")
    p.add_argument("--busy-handoff", action="store_true", help="simulate with `--busy-handoff`")
    a = p.parse_args(argv)
    try:
        run(a)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"fidelity: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
