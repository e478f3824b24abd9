r"""`pdserve bench agentx`: replay agentic-coding traces at several session concurrencies.

    pdserve bench agentx --url http://127.0.0.1:8000 --concurrency 8,16,32,64 \
        --duration 600 --warmup 120 --num-gpus 16 --label pcp8-dcp8
    pdserve bench agentx --fresh-server topo.yaml --concurrency 2,4 --token-scale 0.01 ...

Per level: (fresh server up) -> replay (bench/serving/replay.py) -> metrics (bench/serving/metrics.py) -> (down).
Writes <output-dir>/result.json, levels.csv, interactivity_vs_throughput.png, ttft_cdf.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.serving import results
from bench.serving.client import RequestRecord, make_session, stream_completion
from bench.serving.engine_counters import MTP_COUNTERS, engine_counters, mtp_acceptance, scrape_services, server_side
from bench.serving.metrics import measured_window, summarize
from bench.serving.plots import plot_interactivity_vs_throughput, plot_ttft_cdf
from bench.serving.progress import ProgressBar
from bench.serving.replay import ReplayConfig, Replayer, ReplayResult
from bench.serving.target import FreshServer, GivenServer, wait_ready
from bench.serving.traces import Trace, load_traces

COPIES_PER_LEVEL = 1 << 24  # session-copy ids: seed << 32 | (level + 1) << 24 | n, so levels of a run and
# runs with different seeds never send the same prompt (a server kept across them gets no free hits)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench agentx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (router) URL")
    target.add_argument("--fresh-server", metavar="TOPOLOGY",
                        help="`pdserve up TOPOLOGY` before each level, down after")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    add_replay_args(p, context_from="max_model_len from /v1/models")
    p.add_argument("--vocab-size", type=int, help="prompt ids stay below it (default: /v1/models, else 4096)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs of the deployment (throughput per GPU)")
    p.add_argument("--label", help="configuration name on plots (default: topology name or 'run')")
    p.add_argument("--output-dir", help="default: results/agentx-<label>-<time>")
    p.add_argument("--seed", type=int, help="trace order and prompt salt (default: random, recorded)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p


def add_replay_args(p: argparse.ArgumentParser, context_from: str) -> None:
    """The traces, levels and client flags `bench agentx` and `simulate` share (their meaning is the replayer's)."""
    p.add_argument("--traces", help="trace folder, glob, or comma-separated files (recorded agent sessions)")
    p.add_argument("--max-traces", type=int, help="use only the first N trace files")
    p.add_argument("--concurrency", type=int_list, default=[8, 16, 32, 64], help="concurrent sessions per level")
    p.add_argument("--duration", type=float, default=600.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds per level before measuring")
    p.add_argument("--ramp-up", type=float, default=0.0, help="stagger session starts over this many seconds")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to let in-flight requests finish")
    p.add_argument("--think-time-scale", type=float, default=1.0, help="multiply every recorded think time")
    p.add_argument("--max-think-time", type=float, help="cap one think time (seconds, after scaling)")
    p.add_argument("--token-scale", type=float, default=1.0, help="scale every token length (small models, CPU)")
    p.add_argument("--max-context", type=int, help=f"prompt + output above this counts as overflow (default: "
                   f"{context_from})")
    p.add_argument("--fit-traces", action="store_true", help="drop traces with any request above --max-context")
    p.add_argument("--min-token-id", type=int, default=16, help="prompt ids start here (skip special tokens)")
    p.add_argument("--percentiles", type=float_list, default=[50, 90, 99], help="latency percentiles")


def _prepare(args: argparse.Namespace) -> None:
    if args.token_scale <= 0 or args.num_gpus < 1 or args.duration <= 0:
        raise ValueError("--token-scale and --duration must be > 0 and --num-gpus >= 1")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if not 0 <= args.seed < 1 << 31:
        raise ValueError(f"--seed must be in [0, 2^31), got {args.seed}")
    args.label = args.label or (Path(args.fresh_server).stem if args.fresh_server else "run")
    if not args.output_dir:
        args.output_dir = f"results/agentx-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}"


def level_config(args: argparse.Namespace, level_idx: int, concurrency: int, info: dict) -> ReplayConfig:
    return ReplayConfig(
        concurrency=concurrency, duration_s=args.duration, warmup_s=args.warmup,
        think_time_scale=args.think_time_scale, max_think_s=args.max_think_time,
        max_context=args.max_context or info.get("max_model_len"), ramp_up_s=args.ramp_up,
        drain_timeout_s=args.drain_timeout, seed=args.seed,
        copy_offset=(args.seed << 32) | ((level_idx + 1) * COPIES_PER_LEVEL),
        vocab_size=args.vocab_size or info.get("vocab_size") or 4096, min_token_id=args.min_token_id)


def select_traces(traces: list[Trace], cfg: ReplayConfig, fit: bool) -> list[Trace]:
    if not fit or cfg.max_context is None:
        return traces
    kept = [t for t in traces if t.max_request_tokens <= cfg.max_context]
    if not kept:
        raise ValueError(f"--fit-traces: no trace fits in {cfg.max_context} tokens; lower --token-scale")
    return kept


async def replay_level(url: str, model: str, traces: list[Trace], cfg: ReplayConfig, progress: bool,
                       read_services: Callable[[], dict | None] | None = None) -> tuple[ReplayResult, list]:
    """The level's replay; with `read_services`, also its result when the measured window opens and after the
    drain (read in a thread, so the replay's event loop does not wait on it)."""
    async with make_session() as http:
        async def send(prompt: list[int], max_tokens: int, rec: RequestRecord) -> RequestRecord:
            return await stream_completion(http, url, model, prompt, max_tokens, rec)

        replayer = Replayer(traces, send, cfg)
        s = replayer.stats
        bar = ProgressBar(f"c={cfg.concurrency}", cfg.warmup_s + cfg.duration_s,
                          lambda: {"in-flight": s.in_flight, "done": s.completed, "err": s.errors,
                                   "overflow": s.overflows, "out-tok": s.output_tokens},
                          replayer.phase, enabled=progress)
        reads: list = []

        async def read_at(delay: float) -> None:
            await asyncio.sleep(delay)
            reads.append(await asyncio.to_thread(read_services))

        start = asyncio.create_task(read_at(cfg.warmup_s)) if read_services else None
        bar.start()
        try:
            result = await replayer.run()
            if start is not None:  # the second read after the drain: the measured requests' first tokens are in it
                await start
                reads.append(await asyncio.to_thread(read_services))
            return result, reads
        finally:
            if start is not None:
                start.cancel()
            await bar.stop()


def run_level(args: argparse.Namespace, level_idx: int, concurrency: int, traces: list[Trace]) -> dict:
    server = FreshServer(args.fresh_server) if args.fresh_server else GivenServer(args.url)
    with server as ep:
        info = asyncio.run(wait_ready(ep.url))
        cfg = level_config(args, level_idx, concurrency, info)
        used = select_traces(traces, cfg, args.fit_traces)
        model = args.model or info["model"]
        redis_url = getattr(ep.handle, "redis_url", None)  # a fresh server: its engines' counters can be read
        before = _counters(redis_url)
        read = (lambda: _services(redis_url, ep.url)) if redis_url is not None else None
        result, reads = asyncio.run(replay_level(ep.url, model, used, cfg, not args.no_progress, read))
        mtp = mtp_acceptance(before, _counters(redis_url)) if before is not None else None
        served = server_side(*reads) if len(reads) == 2 and None not in reads else None
    num_gpus = ep.num_gpus or args.num_gpus
    window = measured_window(result.records, result.t_measure, result.t_stop)
    level = {"concurrency": concurrency, **summarize(result.records, window, num_gpus=num_gpus,
                                                    percentiles=args.percentiles)}
    level.update(sessions_started=len(result.sessions), num_traces=len(used), model=model,
                 max_context=cfg.max_context, vocab_size=cfg.vocab_size,
                 ttft_s=sorted(r.ttft_s for r in result.records if r.measured and r.ok))
    if mtp is not None:  # what the decode's MTP accepted over the level (warm-up included): the simulator's input
        level["decode_mtp"] = mtp
    if served is not None:  # the services' own figures from the measured window's start to the drain's end
        level["server"] = served
    return level


def _counters(redis_url: str | None) -> dict | None:
    if redis_url is None:
        return None
    try:
        return engine_counters(redis_url, MTP_COUNTERS)
    except OSError as e:  # a figure the level can do without
        print(f"agentx: the engines' counters could not be read ({e})", file=sys.stderr)
        return None


def _services(redis_url: str, router_url: str) -> dict | None:
    from redis.exceptions import RedisError  # the registry's client: only with a fresh server

    try:
        return scrape_services(redis_url, router_url)
    except (OSError, RedisError) as e:  # a figure the level can do without
        print(f"agentx: the services' metrics could not be read ({e})", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> dict:
    """Every level in turn; the result files are rewritten after each, so a failed level keeps the rest."""
    _prepare(args)
    traces = load_traces(args.traces, token_scale=args.token_scale, max_traces=args.max_traces)
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress", "command")}
    out = {"benchmark": "agentx", "version": 1, "label": args.label,
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": getattr(args, "command", None), "config": config,
           "traces": [t.trace_id for t in traces], "valid": False, "levels": []}
    for i, c in enumerate(args.concurrency):
        out["levels"].append(run_level(args, i, c, traces))
        out["valid"] = all(lv["valid"] for lv in out["levels"])
        write_outputs(out, Path(args.output_dir))
        print(results.format_table(out["levels"][-1:]), file=sys.stderr)
    return out


def write_outputs(out: dict, out_dir: Path) -> dict[str, Path]:
    levels = out["levels"]
    notes = [f"token scale {out['config'].get('token_scale')}, think-time scale "
             f"{out['config'].get('think_time_scale')}, {out['config'].get('duration')} s per level"]
    return {"json": results.write_json(out, out_dir / "result.json"),
            "csv": results.write_csv(levels, out_dir / "levels.csv"),
            "plot": plot_interactivity_vs_throughput([(out["label"], levels)],
                                                     out_dir / "interactivity_vs_throughput.png", notes=notes),
            "ttft_cdf": plot_ttft_cdf(levels, out_dir / "ttft_cdf.png", title=f"TTFT CDF ({out['label']})")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = ["pdserve", "bench", "agentx", *argv]
    try:
        out = run(args)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve bench agentx: error: {e}", file=sys.stderr)
        return 2
    print(results.format_table(out["levels"]))
    print(f"results in {args.output_dir}/ (result.json, levels.csv, interactivity_vs_throughput.png, ttft_cdf.png)")
    if not out["valid"]:
        print("WARNING: some levels are invalid: " +
              "; ".join(f"c={lv['concurrency']}: {', '.join(lv['invalid_reasons'])}" for lv in out["levels"]
                        if not lv["valid"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
