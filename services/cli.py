"""`pdserve`: one console script, one subcommand per tool.

    pdserve up [--config T] | down | status     services.launch.commands   (up_main / down_main / status_main)
    pdserve serve MODEL [flags]                services.launch.serve       (serve_main)
    pdserve scale SERVICE N                    services.launch.scale       (scale_main)
    pdserve make-checkpoint ...                engine.loading.checkpoint   (main)
    pdserve bench agentx | serve | load | restart | compare
                                               bench.serving.agentx / .serve / .loadtest / .restart / .compare (main)
    pdserve bench calibrate ...                bench.simulate.calibrate (main)
    pdserve plan ...                           planner.cli          (main)
    pdserve simulate ...                       bench.simulate.cli   (main)

Every tool is `fn(argv: list[str]) -> int` and owns its own argparse (so `--help` is its help). The table
holds, per command, a loader: a small function that imports the tool's module when its command runs and
returns the tool.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

Tool = Callable[[list[str]], int]

# The loaders import inside: `pdserve` must start fast, `pdserve plan` must not start grpc, and a tool's
# heavy dependencies (torch for make-checkpoint, plotting for bench) load only when that tool runs.


def _up() -> Tool:
    from services.launch.commands import up_main  # lazy: above
    return up_main


def _serve() -> Tool:
    from services.launch.serve import serve_main  # lazy: above
    return serve_main


def _scale() -> Tool:
    from services.launch.scale import scale_main  # lazy: above
    return scale_main


def _down() -> Tool:
    from services.launch.commands import down_main  # lazy: above
    return down_main


def _status() -> Tool:
    from services.launch.commands import status_main  # lazy: above
    return status_main


def _make_checkpoint() -> Tool:
    from engine.loading.checkpoint import main  # lazy: above
    return main


def _bench_agentx() -> Tool:
    from bench.serving.agentx import main  # lazy: above
    return main


def _bench_serve() -> Tool:
    from bench.serving.serve import main  # lazy: above
    return main


def _bench_load() -> Tool:
    from bench.serving.loadtest import main  # lazy: above
    return main


def _bench_restart() -> Tool:
    from bench.serving.restart import main  # lazy: above
    return main


def _bench_compare() -> Tool:
    from bench.serving.compare import main  # lazy: above
    return main


def _bench_calibrate() -> Tool:
    from bench.simulate.calibrate import main  # lazy: above
    return main


def _simulate() -> Tool:
    from bench.simulate.cli import main  # lazy: above
    return main


def _plan() -> Tool:
    from planner.cli import main  # lazy: above
    return main


@dataclass(frozen=True)
class Command:
    load: Callable[[], Tool]
    help: str


COMMANDS: dict[tuple[str, ...], Command] = {
    ("up",): Command(_up, "start a topology (router, prefill, decode, kvstore, redis)"),
    ("serve",): Command(_serve, "serve MODEL on this host from vLLM-style flags (a derived topology)"),
    ("scale",): Command(_scale, "add or remove replicas of a service of a running topology (removed ones drain)"),
    ("down",): Command(_down, "stop a topology started by `pdserve up`"),
    ("status",): Command(_status, "which processes of a topology are alive"),
    ("make-checkpoint",): Command(_make_checkpoint, "write a checkpoint (random or converted)"),
    ("bench", "agentx"): Command(_bench_agentx, "replay agentic-coding traces at several concurrencies"),
    ("bench", "serve"): Command(_bench_serve, "random/fixed-length prompts, vllm-bench-serve metrics"),
    ("bench", "load"): Command(_bench_load, "N concurrent greedy streams: tokens = offline, no leaks, flat RSS"),
    ("bench", "restart"): Command(_bench_restart, "engines restarted one by one under load: no errors, no lost tokens"),
    ("bench", "compare"): Command(_bench_compare, "plot several agentx results with ratios"),
    ("bench", "calibrate"): Command(_bench_calibrate, "measure a topology's engine steps: a simulation profile"),
    ("plan",): Command(_plan, "KV, capacity and roofline planner for a model and deployment"),
    ("simulate",): Command(_simulate, "bench agentx against a simulated topology (virtual clock, calibrated)"),
}
GROUP_HELP = {"bench": "benchmarks against a running server"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Disaggregated prefill/decode serving for GLM-5.x DSA.")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, cmd in COMMANDS.items():
        if len(path) == 1:
            # add_help=False: `pdserve plan --help` reaches the tool's own parser
            top.add_parser(path[0], help=cmd.help, add_help=False).set_defaults(target=cmd)
            continue
        if path[0] not in groups:
            group = top.add_parser(path[0], help=GROUP_HELP.get(path[0]))
            groups[path[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
        groups[path[0]].add_parser(path[1], help=cmd.help, add_help=False).set_defaults(target=cmd)
    return parser


def resolve(cmd: Command) -> Tool:
    """The command's tool; a part missing from this installation is a plain message, not a traceback."""
    try:
        return cmd.load()
    except ImportError as e:
        raise SystemExit(f"pdserve: this command is not available in this installation ({e})") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv)
    return int(resolve(args.target)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
