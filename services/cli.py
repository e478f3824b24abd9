"""`pdserve`: one console script, one subcommand per tool; each tool's module is imported only when
its subcommand runs (so `pdserve plan` never starts grpc, and a missing part says so plainly).

    pdserve up [--config T] | down | status     services.deploy.launcher   (up_main / down_main / status_main)
    pdserve make-checkpoint ...                engine.loading.checkpoint   (main)
    pdserve bench agentx | serve | load | compare   bench.serving.agentx / .serve / .loadtest / .compare (main)
    pdserve plan ...                           planner.cli          (main)

Every target is `fn(argv: list[str]) -> int` and owns its own argparse (so `--help` is its help).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str
    function: str
    help: str


COMMANDS: dict[tuple[str, ...], Command] = {
    ("up",): Command("services.deploy.launcher", "up_main",
                     "start a topology (router, prefill, decode, kvstore, redis)"),
    ("down",): Command("services.deploy.launcher", "down_main", "stop a topology started by `pdserve up`"),
    ("status",): Command("services.deploy.launcher", "status_main", "which processes of a topology are alive"),
    ("make-checkpoint",): Command("engine.loading.checkpoint", "main", "write a checkpoint (random or converted)"),
    ("bench", "agentx"): Command("bench.serving.agentx", "main",
                                 "replay agentic-coding traces at several concurrencies"),
    ("bench", "serve"): Command("bench.serving.serve", "main", "random/fixed-length prompts, vllm-bench-serve metrics"),
    ("bench", "load"): Command("bench.serving.loadtest", "main",
                               "N concurrent greedy streams: tokens = offline, no leaks, flat RSS"),
    ("bench", "compare"): Command("bench.serving.compare", "main", "plot several agentx results with ratios"),
    ("plan",): Command("planner.cli", "main", "KV, capacity and roofline planner for a model and deployment"),
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


def resolve(cmd: Command):
    try:
        module = importlib.import_module(cmd.module)
    except ImportError as e:
        raise SystemExit(f"pdserve: this command is not available in this installation "
                         f"({cmd.module} cannot be imported: {e})") from None
    fn = getattr(module, cmd.function, None)
    if not callable(fn):
        raise SystemExit(f"pdserve: {cmd.module}.{cmd.function} is missing from this installation")
    return fn


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv)
    return int(resolve(args.target)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
