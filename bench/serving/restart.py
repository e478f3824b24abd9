r"""`pdserve bench restart`: a rolling restart of every engine service under load, once with SIGTERM (each
drains) and once with SIGKILL, checking that no client sees an error and no stream loses, repeats or changes a
token (docs/failures.md, "Drain and migration").

    pdserve bench restart                                  # 64 sessions, configs/topology.cpu.yaml x 2
    pdserve bench restart --concurrency 8 --steady 10 --settle 5 --services prefill-0,decode-0

It starts the topology with 2 prefills and 2 decodes (and its kvstore and router) in a private run directory on
free ports with a private Redis, computes every turn's greedy answer with the offline engine (the checkpoint and
KV dtype of the decodes), then runs `--concurrency` closed-loop sessions of growing, agent-like prompts
(bench/serving/restart_workload.py). Schedule, after every stream completed its first request:

    steady | term: prefill-0, prefill-1, decode-0, decode-1 | steady | kill: the same | steady | stop, drain

Each restart: the signal, the process's exit (SIGTERM: its drain, up to its --shutdown-timeout), the same command
started again (same ports, instance id and environment), serving and registered again, then `--settle` seconds
before the next. Then the in-flight requests finish, every KV block must be given back, and each prompt whose
stream differed from the reference is looked into (the offline logits where they part; the prompt served again,
undisturbed). Written to --output-dir: result.json (every figure, each restart's times, tokens/s per second, errors
and differences with the service log lines around them), summary.txt, throughput.png, the services' logs. Exit
status 1 when a client saw an error, a stream differed from the reference, the schedule stopped early or a service
stopped by SIGTERM exited non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.serving import restart_control as control
from bench.serving import restart_report as report
from bench.serving.loadtest import started_topology
from bench.serving.restart_figures import Schedule, figures
from bench.serving.restart_workload import Load, OfflineEngine, Workload, build_sessions, replay

ENGINE_KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class RestartConfig:
    """What one run does: the load, the schedule around the restarts, the deployment's shape."""

    concurrency: int = 64
    workload: Workload = field(default_factory=Workload)
    steady_s: float = 30.0  # each steady window: before, between and after the rolling restarts
    settle_s: float = 10.0  # after a service serves again, before the next one is signalled
    modes: tuple[str, ...] = ("term", "kill")
    services: tuple[str, ...] = ()  # () = every prefill and decode, in the topology's order
    replicas: int = 2
    shutdown_timeout_s: float | None = None  # the engines' and the kvstore's --shutdown-timeout (None: theirs)

    def __post_init__(self):
        if self.concurrency < 1 or self.steady_s <= 0 or self.settle_s < 0 or self.replicas < 1:
            raise ValueError("need concurrency >= 1, steady > 0, settle >= 0 and replicas >= 1")
        if not self.modes or set(self.modes) - set(control.SIGNALS):
            raise ValueError(f"modes must be some of {sorted(control.SIGNALS)}, got {self.modes}")


def topology(config: str, run_dir: Path, cfg: RestartConfig) -> dict:
    """The soak test's topology (its own run dir, free ports, a private Redis) with `replicas` prefills and
    decodes."""
    topo = started_topology(config, run_dir)
    for kind, spec in topo["services"].items():
        if kind in ENGINE_KINDS:
            spec["replicas"] = cfg.replicas
        if cfg.shutdown_timeout_s is not None and kind != "router":
            spec.setdefault("args", {})["shutdown-timeout"] = cfg.shutdown_timeout_s
    return topo


def engine_flags(topo: dict) -> tuple[str, str]:
    """(checkpoint dir, KV cache dtype) the decodes run with: what the reference must use too."""
    from services.launch.topology import ROOT

    model = Path(topo["model"])
    args = topo["services"]["decode"].get("args") or {}
    return str(model if model.is_absolute() else ROOT / model), str(args.get("kv-cache-dtype", "auto"))


def reference(topo: dict, w: Workload, echo) -> tuple[list, OfflineEngine]:
    """Every session's turns with their greedy answers, computed before the deployment starts (so that the two
    never share the CPU), and the engine that gave them (kept for looking into differences afterwards)."""
    model, dtype = engine_flags(topo)
    vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    longest = w.system_len + w.turns * (w.user_len[1] + w.max_tokens)
    echo(f"offline greedy reference: {w.sessions} sessions x {w.turns} turns ({Path(model).name}, kv {dtype})")
    engine = OfflineEngine(model, dtype, num_blocks=w.sessions * (longest // 64 + 2))
    return build_sessions(w, vocab, engine.generate), engine


MAX_DIAGNOSED = 5  # prompts whose differences are looked into after the run


def diagnose(url: str, model: str, check: dict, sessions: list, engine: OfflineEngine, echo) -> list[dict]:
    """For each prompt with a stream that differs from the reference: the offline engine's logits of the two
    tokens where they part (along the served ids: a near-tie flips on the last bits of a different computation
    order), and the same prompt served again undisturbed after the restarts, after its session's earlier turns
    (does it stream what the disturbed stream did, or the reference?). Figures beside the check; it stays failed."""
    out, seen = [], set()
    for d in check["differences"]:
        session, turn = _session_turn(d["req_id"])
        if "got" not in d or (session, turn) in seen or len(seen) >= MAX_DIAGNOSED:
            continue
        seen.add((session, turn))
        want, got, f = d["want"], d["got"], d["first_difference"]
        item = {"prompt": f"s{session}t{turn}", "position": f, "served_token": got[f] if f < len(got) else None,
                "reference_token": want[f] if f < len(want) else None}
        try:
            parting = [t for t in (item["served_token"], item["reference_token"]) if t is not None]
            item["offline_logits"] = engine.logits(sessions[session][turn].prompt + got[:f], parting)
            again = asyncio.run(replay(url, model, sessions[session][:turn + 1]))
            item.update(replayed_error=again.error, replayed_equals_served=again.token_ids == got,
                        replayed_equals_reference=again.token_ids == want)
        except (RuntimeError, OSError, ValueError) as e:
            item["diagnosis_error"] = f"{type(e).__name__}: {e}"
        echo(f"  differs: {item}")
        out.append(item)
    return out


def _session_turn(req_id: str) -> tuple[int, int]:
    """(session, turn) of a request id `s<session>t<turn>n<seq>`."""
    session, rest = req_id[1:].split("t", 1)
    return int(session), int(rest.split("n", 1)[0])


def _steady(s: Schedule, seconds: float) -> None:
    a = time.perf_counter()
    time.sleep(seconds)
    s.steady.append((a, time.perf_counter()))


def drive(dep, load: Load, cfg: RestartConfig, router: str, echo) -> Schedule:
    """The restart schedule, on the calling thread, while `load` runs on its own. A failure ends the schedule
    and the load, and is kept for the report with what the streams saw until then."""
    s = Schedule(time.perf_counter())
    try:
        if not control.wait_until(load.warmed_up, control.START_TIMEOUT_S, period_s=0.5):
            raise RuntimeError("the streams did not all complete a first request")
        echo(f"warmed up after {time.perf_counter() - s.t0:.0f} s; steady {cfg.steady_s:.0f} s")
        _steady(s, cfg.steady_s)
        names = cfg.services or tuple(p.name for p in dep.processes if p.kind in ENGINE_KINDS)
        exit_timeout = (cfg.shutdown_timeout_s or 600.0) + 60
        for mode in cfg.modes:
            echo(f"rolling restart, SIG{mode.upper()}: {', '.join(names)}")
            for name in names:
                before = control.counter(router, control.MIGRATIONS)
                r = control.restart_one(dep, name, mode, exit_timeout, echo)
                time.sleep(cfg.settle_s)
                r.migrations = control.counter(router, control.MIGRATIONS) - before
                s.restarts.append(r)
            _steady(s, cfg.steady_s)
    except (RuntimeError, OSError, ValueError) as e:
        s.failure = f"{type(e).__name__}: {e}"
        echo(f"restart schedule stopped: {s.failure}")
    finally:
        s.t_stop = time.perf_counter()
        load.stop()
    return s


def run(config: str, cfg: RestartConfig, echo=print) -> tuple[dict, dict[str, str]]:
    """The whole benchmark: reference, deployment, load and restarts; (figures, service logs by name)."""
    from bench.serving import loadcheck
    from bench.serving.target import wait_ready
    from services.launch import launcher

    topo = topology(config, Path(tempfile.mkdtemp(prefix="pdserve-restart-")), cfg)
    sessions, engine = reference(topo, cfg.workload, echo)
    dep = launcher.up(topo, timeout_s=control.START_TIMEOUT_S, die_with_parent=True, echo=echo)
    try:
        info = asyncio.run(wait_ready(dep.url, timeout_s=120))
        router = control.router_metrics_address(dep.redis_url)
        echo(f"{cfg.concurrency} sessions against {dep.url}")
        load = Load(dep.url, info["model"], sessions, cfg.concurrency).start()
        sched = drive(dep, load, cfg, router, echo)
        streams = load.join()
        echo(f"{len(streams)} requests; waiting for every KV block to be given back")
        blocks = loadcheck.wait_blocks_freed(dep.redis_url)
        migrations_total = control.counter(router, control.MIGRATIONS)
        turns = {(t.session, t.turn): t for sess in sessions for t in sess}
        diagnosis = diagnose(dep.url, info["model"], report.check_streams(streams, turns), sessions, engine, echo)
        logs = {p.name: Path(p.log).read_text(errors="replace") for p in dep.processes if Path(p.log).exists()}
    finally:
        launcher.down(dep)
    result = {"config": asdict(cfg), **figures(streams, turns, sched, logs, cfg.modes, cfg.settle_s)}
    result.update(blocks_in_use_after_drain=blocks, migrations_total=migrations_total, diagnosis=diagnosis)
    return result, logs


# ---- outputs -------------------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> None:
    """Output tokens/s (5 s moving average) over the run, each restart shaded from its signal until it served
    again (SIGTERM blue, SIGKILL red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the backend must be chosen first

    bins = result["tok_s_per_second"]
    smooth = [sum(bins[max(i - 4, 0):i + 1]) / len(bins[max(i - 4, 0):i + 1]) for i in range(len(bins))]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(range(len(bins)), smooth, color="black", lw=1)
    for r in result["restart_times_s"]:
        ax.axvspan(r["t_signal"], r["t_ready"], color="tab:blue" if r["mode"] == "term" else "tab:red", alpha=0.2)
        ax.text(r["t_signal"] + 1, 0.98, r["service"], fontsize=7, rotation=90, va="top",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("output tokens/s (5 s mean)")
    ax.set_title(f"{result['config']['concurrency']} sessions; shaded: a service away (blue SIGTERM, red SIGKILL)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, logs: dict[str, str], out_dir: Path) -> None:
    """result.json, summary.txt, throughput.png, and every service's log under logs/ (the run directory is
    temporary)."""
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for name, text in logs.items():
        (out_dir / "logs" / f"{name}.log").write_text(text)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    (out_dir / "summary.txt").write_text(report.format_summary(result) + "\n")
    plot(result, out_dir / "throughput.png")


def ok(result: dict) -> bool:
    """No client error, no stream off the reference, a complete schedule, every SIGTERM'd service exited 0."""
    c = result["check"]
    term_exits = [d["exit_code"] for d in result["restarts"] if d["mode"] == "term"]
    return (not result["failure"] and not c["errors"] and not c["lost_tokens"] and not c["duplicated_tokens"]
            and not c["different_streams"] and all(code == 0 for code in term_exits))


# ---- command line ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from services.launch.topology import ROOT

    p = argparse.ArgumentParser(prog="pdserve bench restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "topology.cpu.yaml"),
                   help="topology to start with --replicas prefills and decodes (own run dir, free ports, Redis)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64, help="sessions in flight at once")
    p.add_argument("--sessions", type=int, default=0, help="distinct sessions (default: 2 x --concurrency)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--steady", type=float, default=30.0, help="seconds of each steady window")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after a service is back before the next")
    p.add_argument("--modes", default="term,kill", help="comma list of term (SIGTERM) and kill (SIGKILL)")
    p.add_argument("--services", default="", help="comma list of process names (default: every prefill and decode)")
    p.add_argument("--shutdown-timeout", type=float, help="the services' --shutdown-timeout (default: theirs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", help="default: results/restart-<time>")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    w = Workload(sessions=a.sessions or 2 * a.concurrency, turns=a.turns, min_tokens=a.min_tokens,
                 max_tokens=a.max_tokens, seed=a.seed)
    cfg = RestartConfig(concurrency=a.concurrency, workload=w, steady_s=a.steady, settle_s=a.settle,
                        modes=tuple(m for m in a.modes.split(",") if m),
                        services=tuple(n for n in a.services.split(",") if n), replicas=a.replicas,
                        shutdown_timeout_s=a.shutdown_timeout)
    out_dir = Path(a.output_dir or f"results/restart-{time.strftime('%Y%m%d-%H%M%S')}")
    result, logs = run(a.config, cfg)
    result["command"] = " ".join(["pdserve bench restart", *(argv if argv is not None else sys.argv[1:])])
    write_outputs(result, logs, out_dir)
    print(report.format_summary(result))
    print(f"results in {out_dir}/ (result.json, summary.txt, throughput.png, logs/)")
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
