r"""`pdserve bench load`: hold N concurrent greedy streams against a deployment for a duration and
check what a soak test must: every stream's token ids equal the offline engine's, no KV block stays
held after the load drains, and no service's memory keeps growing after warm-up.

    pdserve bench load --concurrency 200 --duration 60             # starts configs/topology.cpu.yaml
    pdserve bench load --attach .run --concurrency 200 --duration 60  # a running `pdserve up`

Workload: a fixed seeded set of agent-like sessions (a system prompt all share, then turns that each
extend the previous turn's prompt, so later turns hit the prefix cache); each of the N workers sends
one request after another (prompt and max_tokens drawn from a seeded stream per worker, temperature 0,
ignore_eos, `return_token_ids`) until the duration ends and the steady state has been seen (below), then
the in-flight ones finish. Started deployments use a private run directory, free ports and a private
Redis; `--attach` reads the run directory's state.json for the URL, the Redis URL and the pids to sample.

Memory is compared across windows decided by completed requests, not seconds
(`loadcheck.SteadyState`): warm-up ends once every worker completed its first request(s); the
completions after that, split in halves by count, are the two windows, and the load goes on past the
duration until each half holds `window_requests` (one per stream by default), up to `max_duration_s`.
A slow machine makes the run longer instead of making it measure warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.serving import loadcheck
from bench.serving.client import RequestRecord, make_session, stream_completion
from bench.serving.metrics import Window, summarize
from bench.serving.target import wait_ready


@dataclass(frozen=True)
class LoadConfig:
    concurrency: int = 200
    duration_s: float = 60.0  # at least this long; longer until the steady state's windows are full
    max_duration_s: float = 0.0  # never start a request after this (0: 5 x duration_s)
    warmup_per_worker: int = 1  # requests every worker completes before the steady state opens
    window_requests: int = 0  # completions in each memory window (0: one per stream)
    min_tokens: int = 8  # max_tokens of each request is uniform in [min_tokens, max_tokens]
    max_tokens: int = 32
    sessions: int = 8
    turns: int = 4
    system_len: int = 80  # shared by every session: more than one 64-token KV block
    turn_len: tuple[int, int] = (8, 40)
    seed: int = 0
    check: bool = True  # compare every stream with the offline engine

    def __post_init__(self):
        if self.concurrency < 1 or self.duration_s <= 0 or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need concurrency >= 1, duration > 0 and 1 <= min_tokens <= max_tokens")
        if self.max_duration_s and self.max_duration_s < self.duration_s:
            raise ValueError("max_duration_s must be 0 (5 x duration) or at least duration_s")

    @property
    def stop_by_s(self) -> float:
        return self.max_duration_s or 5 * self.duration_s

    def steady_state(self) -> loadcheck.SteadyState:
        return loadcheck.SteadyState(self.concurrency, self.warmup_per_worker,
                                     self.window_requests or self.concurrency)


def make_prompts(cfg: LoadConfig, vocab_size: int, min_token_id: int = 16) -> list[list[int]]:
    """sessions x turns prompts: turn t = turn t-1 + an answer + a new user message (all seeded ids)."""
    rng = random.Random(cfg.seed)

    def piece(n: int) -> list[int]:
        return [rng.randrange(min_token_id, vocab_size) for _ in range(n)]

    system = piece(cfg.system_len)
    prompts = []
    for _ in range(cfg.sessions):
        prompt = system + piece(rng.randint(*cfg.turn_len))
        for _ in range(cfg.turns):
            prompts.append(prompt)
            prompt = prompt + piece(rng.randint(*cfg.turn_len)) + piece(rng.randint(*cfg.turn_len))
    return prompts


def pick(cfg: LoadConfig, worker: int, k: int, num_prompts: int) -> tuple[int, int]:
    """(prompt index, max_tokens) of worker's k-th request: the same every run."""
    rng = random.Random(f"{cfg.seed}/{worker}/{k}")
    return rng.randrange(num_prompts), rng.randint(cfg.min_tokens, cfg.max_tokens)


@dataclass
class Driven:
    sent: list[tuple[int, RequestRecord]]  # (prompt index, record) of every request
    t0: float
    t_stop: float  # no request starts after this
    in_flight: list[int]  # sampled every 0.5 s while requests were still being started
    steady: loadcheck.SteadyState  # the completions that decide warm-up and the memory windows


async def drive(url: str, model: str, prompts: list[list[int]], cfg: LoadConfig) -> Driven:
    """Every worker sends one request after another until the duration has passed and the steady state
    is `ready`, or `max_duration_s` has passed (checked at each completion and every 0.5 s)."""
    sent: list[tuple[int, RequestRecord]] = []
    in_flight: list[int] = []
    steady = cfg.steady_state()
    busy = 0
    async with make_session() as http:
        t0 = time.perf_counter()
        t_stop = 0.0

        def going() -> bool:
            nonlocal t_stop
            if not t_stop:
                now = time.perf_counter() - t0
                if now >= cfg.stop_by_s or (now >= cfg.duration_s and steady.ready):
                    t_stop = t0 + now
            return not t_stop

        async def worker(w: int) -> None:
            nonlocal busy
            k = 0
            while going():
                idx, max_tokens = pick(cfg, w, k, len(prompts))
                k += 1
                busy += 1
                rec = await stream_completion(http, url, model, prompts[idx], max_tokens, token_ids=True)
                busy -= 1
                sent.append((idx, rec))
                if rec.ok:
                    steady.completed(w, rec.t_end)

        async def sample() -> None:
            while going():
                in_flight.append(busy)
                await asyncio.sleep(0.5)

        await asyncio.gather(sample(), *(worker(w) for w in range(cfg.concurrency)))
    return Driven(sent, t0, t_stop, in_flight, steady)


def _engine_flags(dep) -> tuple[str, str]:
    """(model dir, kv cache dtype) of the deployment's decode, read off its command line."""
    cmd = next(p.cmd for p in dep.processes if p.kind == "decode")

    def flag(name: str, default: str) -> str:
        return cmd[cmd.index(name) + 1] if name in cmd else default

    return flag("--model", ""), flag("--kv-cache-dtype", "auto")


def memory_report(sampler: loadcheck.RssSampler, driven: Driven) -> dict:
    """Peak RSS per process, and its growth in the steady state: the median RSS over the second half of
    the steady completions against the first half (loadcheck.SteadyState; warm-up is before both)."""
    steady = driven.steady.describe(driven.t0, driven.t_stop)
    windows = driven.steady.windows(driven.t_stop)
    growth = loadcheck.memory_growth(sampler.samples, windows) if windows else {}
    return {"steady": steady,
            "processes": {name: {"peak_mib": round(peak, 1), **growth.get(name, {})}
                          for name, peak in sampler.peak().items()}}


def run_load(dep, cfg: LoadConfig, echo=lambda s: None) -> dict:
    """The whole load test against a running Deployment (services.launch.launcher); returns the figures."""
    info = asyncio.run(wait_ready(dep.url, timeout_s=60))
    prompts = make_prompts(cfg, int(info.get("vocab_size") or 4096))
    reference = None
    if cfg.check:
        model, dtype = _engine_flags(dep)
        echo(f"offline greedy reference of {len(prompts)} prompts ({model}, kv {dtype})")
        reference = loadcheck.offline_reference(model, prompts, cfg.max_tokens, dtype)
    pids = {p.name: p.pid for p in dep.processes}
    if dep.redis_pid:
        pids["redis"] = dep.redis_pid
    sampler = loadcheck.RssSampler(pids).start()
    try:
        echo(f"{cfg.concurrency} concurrent streams for {cfg.duration_s:.0f} s (up to {cfg.stop_by_s:.0f} s until "
             f"the steady state is seen) against {dep.url}")
        driven = asyncio.run(drive(dep.url, info["model"], prompts, cfg))
        t_drained = time.perf_counter()
        blocks = loadcheck.wait_blocks_freed(dep.redis_url)
    finally:
        sampler.stop()
    out = summary(cfg, driven, t_drained, blocks, memory_report(sampler, driven), reference)
    out["rss_timeline"] = [(round(t - driven.t0, 1), {n: round(v, 1) for n, v in s.items()})
                           for t, s in sampler.samples]
    return out


def summary(cfg: LoadConfig, driven: Driven, t_drained: float, blocks: dict, memory: dict, reference) -> dict:
    records = [r for _, r in driven.sent]
    figures = summarize(records, Window(driven.t0, t_drained), percentiles=(50, 90, 99))
    errors = sorted({r.error for r in records if r.error})
    steady = driven.in_flight[len(driven.in_flight) // 10:]  # after the first burst of prefills
    out = {"config": asdict(cfg), "requests_sent": len(records), "errors": errors[:20],
           "in_flight_min": min(steady, default=0), "in_flight_mean": sum(steady) / max(len(steady), 1),
           "blocks_in_use_after_drain": blocks, "leaked_blocks": sum(blocks.values()),
           "memory": memory, **{k: v for k, v in figures.items() if not k.startswith("std_")}}
    if reference is not None:
        streams = [(i, r.max_tokens, r.token_ids or []) for i, r in driven.sent if r.ok]
        out["tokens"] = loadcheck.compare_tokens(streams, reference)
    return out


# ---- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from services.launch.topology import ROOT

    p = argparse.ArgumentParser(prog="pdserve bench load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "topology.cpu.yaml"),
                   help="topology to start (private run dir, free ports, private Redis)")
    p.add_argument("--attach", metavar="RUN_DIR", help="use the deployment `pdserve up` runs from RUN_DIR instead")
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds during which new requests start, at least (longer until the steady state is seen)")
    p.add_argument("--max-duration", type=float, default=0.0,
                   help="never start a request after this many seconds (default: 5 x --duration)")
    p.add_argument("--window-requests", type=int, default=0,
                   help="completed requests in each steady-state memory window (default: --concurrency)")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the offline engine")
    p.add_argument("--result-file", help="write every figure as JSON here")
    return p


def started_topology(config: str, run_dir: Path) -> dict:
    """The topology file with its own run dir, free ports and a private Redis (never a shared one)."""
    import yaml

    from engine.parallel.dist import free_port

    topo = yaml.safe_load(Path(config).read_text())
    topo["run_dir"], topo["redis_url"] = str(run_dir), f"redis://127.0.0.1:{free_port()}/0"
    for kind, spec in topo["services"].items():
        spec["port"] = spec["metrics_port"] = 0
        if kind == "router":
            spec["grpc_port"] = 0
    return topo


def main(argv: list[str] | None = None) -> int:
    from services.launch import launcher

    a = build_parser().parse_args(argv)
    cfg = LoadConfig(concurrency=a.concurrency, duration_s=a.duration, max_duration_s=a.max_duration,
                     window_requests=a.window_requests, min_tokens=a.min_tokens, max_tokens=a.max_tokens,
                     sessions=a.sessions, turns=a.turns, seed=a.seed, check=not a.no_check)
    if a.attach:
        dep, started = launcher.Deployment.load(a.attach), False
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="pdserve-load-"))
        dep, started = launcher.up(started_topology(a.config, run_dir), die_with_parent=True, echo=print), True
    try:
        out = run_load(dep, cfg, echo=print)
    finally:
        if started:
            launcher.down(dep)
    print(format_summary(out))
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(out, indent=1))
    ok = not out["errors"] and out["leaked_blocks"] == 0 and (not cfg.check or not out["tokens"]["mismatched_streams"])
    return 0 if ok else 1


def format_summary(out: dict) -> str:
    lines = [f"requests completed   {out['completed']} of {out['requests_sent']} ({out['num_errors']} errors)",
             f"in flight            min {out['in_flight_min']}, mean {out['in_flight_mean']:.1f}",
             f"output tokens/s      {out['output_throughput']:.1f}",
             f"TTFT p50/p90 ms      {out['median_ttft_ms']:.0f} / {out['p90_ttft_ms']:.0f}",
             f"ITL p50/p90 ms       {out['median_itl_ms']:.0f} / {out['p90_itl_ms']:.0f}",
             f"leaked blocks        {out['leaked_blocks']} {out['blocks_in_use_after_drain']}"]
    if "tokens" in out:
        t = out["tokens"]
        lines.append(f"tokens vs offline    {t['streams_checked']} streams, {t['mismatched_streams']} differ, "
                     f"{t['lost_tokens']} lost, {t['duplicated_tokens']} duplicated")
    steady = out["memory"]["steady"]
    if steady["measured"]:
        lines.append(f"steady state         from {steady['opened_s']} s; windows {steady['first_s']} s and "
                     f"{steady['second_s']} s, {steady['requests'][0]} + {steady['requests'][1]} requests")
    else:
        lines.append(f"steady state         not reached: {steady['why']}")
    for name, m in out["memory"]["processes"].items():
        growth = f"growth after warm-up {m['growth_mib']:+.1f} MiB" if "growth_mib" in m else "growth not measured"
        lines.append(f"RSS {name:16s} peak {m['peak_mib']:.0f} MiB, {growth}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
