"""`pdserve serve MODEL [flags]`: a whole disaggregated deployment on this host from one command, with vLLM's
flag names (`vllm serve MODEL --flags` becomes `pdserve serve MODEL --flags`).

    pdserve serve /models/GLM-5.3-FP8 --prefill-context-parallel-size 8 --decode-context-parallel-size 8 \\
        --data-parallel-size 8 --enable-expert-parallel --kv-cache-dtype fp8_ds_mla \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' \\
        --attention-config '{"hisparse_config": {"host_pool_gib": 48}}' \\
        --tool-call-parser glm47 --reasoning-parser glm45 --enable-auto-tool-choice --port 8000

derives a topology (services/launch/topology.py): the router on `--port`, a kvstore, a prefill engine of
max(PCP, DCP) ranks on the first GPUs, a decode engine (a DP x EP group of `--data-parallel-size` ranks) on the
next ones; on one GPU both engines share it (each takes half of `--gpu-memory-utilization`); with none, CPU.
Flags go where they mean something: parallel sizes to their engine, `--speculative-config` and
`--attention-config`'s `hisparse_config` to decode (the prefill computes one token), the chat and tool flags
to the router, every other flag (`--max-model-len`, `--max-num-seqs`, `--enforce-eager`, ...) to both engines.
`--dry-run` prints the derived topology and every process it starts; `--emit-topology FILE` writes the
topology, the first step to a multi-host file. Otherwise it starts everything, prints the endpoints, serves
until SIGINT / SIGTERM, and then stops every process it started (each drains first: docs/failures.md).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import yaml

from engine.config.engine import ParallelConfig
from services.launch import topology as topo_mod
from services.launch.commands import start
from services.launch.launcher import down, status
from services.launch.placement import DEFAULT_GPU_MEMORY_UTILIZATION, check_placement, visible_gpu_count
from services.launch.process_specs import describe, plan
from services.launch.schema import ROOT

ROUTER_FLAGS = ("--tool-call-parser", "--reasoning-parser", "--served-model-name", "--chat-template",
                "--api-key", "--max-migrations")  # value flags that mean something to the router only


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="pdserve serve", description=__doc__.split("\n\n")[0],
                                epilog="Any other flag goes to both engines (engine/config/arg_utils.py lists them).")
    p.add_argument("model", help="checkpoint directory (an HF layout)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="decode: one DP x EP group this size")
    g.add_argument("--enable-expert-parallel", action="store_true", help="experts sharded over each engine's ranks")
    e = p.add_argument_group("engines")
    e.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is present")
    e.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    e.add_argument("--speculative-config", default=None, help="JSON, decode only (e.g. MTP)")
    e.add_argument("--attention-config", default=None, help="JSON; its hisparse_config goes to decode only")
    e.add_argument("--kvstore-pool-gib", type=float, default=1.0, help="host KV tier size (0: no kvstore)")
    r = p.add_argument_group("router")
    r.add_argument("--host", default="0.0.0.0", help="the router binds here; every other service binds loopback")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--grpc-port", type=int, default=50050)
    r.add_argument("--enable-auto-tool-choice", action="store_true")
    for flag in ROUTER_FLAGS:
        r.add_argument(flag, action="append" if flag in ("--served-model-name", "--api-key") else "store")
    o = p.add_argument_group("this command")
    o.add_argument("--dry-run", action="store_true", help="print the topology and its processes; start nothing")
    o.add_argument("--emit-topology", default=None, metavar="FILE", help="write the derived topology (YAML)")
    o.add_argument("--run-dir", default=str(ROOT / ".run"))
    o.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="used if a Redis answers there, else a private redis-server is started there")
    o.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every service to be healthy")
    return p.parse_known_args(argv)


def derive(a: argparse.Namespace, extra: list[str], num_gpus: int) -> dict:
    """The topology (a dict in the topology file's schema) these flags describe on a host of `num_gpus`."""
    pcp, dcp, dp = a.prefill_context_parallel_size, a.decode_context_parallel_size, a.data_parallel_size
    if min(pcp, dcp, dp) < 1:
        raise ValueError("parallel sizes must be >= 1")
    for role, sizes in (("prefill", {"prefill_context_parallel_size": pcp, "decode_context_parallel_size": dcp}),
                        ("decode", {"data_parallel_size": dp})):
        try:  # the engines' own rules, checked before anything starts
            ParallelConfig(enable_expert_parallel=a.enable_expert_parallel, **sizes)
        except ValueError as exc:
            flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
            raise ValueError(f"{role} engine ({flags}): {exc}") from None
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    device = a.device or ("cuda" if num_gpus else "cpu")
    prefill_args, decode_args = _engine_args(a, extra)
    prefill = {"replicas": 1, "port": 0, "metrics_port": 0, "prefill_context_parallel_size": pcp,
               "decode_context_parallel_size": dcp, "args": prefill_args}
    decode = {"replicas": 1, "port": 0, "metrics_port": 0, "data_parallel_size": dp, "args": decode_args}
    env = {}
    if device == "cuda":
        need_p, need_d = max(pcp, dcp), dp
        if num_gpus >= need_p + need_d:
            prefill["gpus"], decode["gpus"] = list(range(need_p)), list(range(need_p, need_p + need_d))
        elif need_p == need_d == 1 and num_gpus >= 1:  # one GPU: the two engines share it
            prefill["gpus"] = decode["gpus"] = [0]
            for args in (prefill_args, decode_args):
                args["gpu-memory-utilization"] = round(a.gpu_memory_utilization / 2, 3)
        else:
            raise ValueError(f"prefill needs {need_p} GPU(s) (max of PCP {pcp}, DCP {dcp}) and decode {need_d} "
                             f"(DP {dp}), {need_p + need_d} in all; this host has {num_gpus}")
        env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    services = {"prefill": prefill, "decode": decode,
                "router": {"port": a.port, "grpc_port": a.grpc_port, "metrics_port": 0, "args": _router_args(a)}}
    if a.kvstore_pool_gib > 0:
        services["kvstore"] = {"replicas": 1, "port": 0, "metrics_port": 0,
                               "args": {"pool-gib": a.kvstore_pool_gib, **_layout_args(prefill_args)}}
    else:
        prefill_args["kvstore"] = "off"
    return {"model": str(Path(a.model)), "host": "127.0.0.1", "run_dir": a.run_dir, "host_gpus": num_gpus,
            "redis_url": a.redis_url, "env": env, "services": services,
            "router_host": a.host}


def _engine_args(a: argparse.Namespace, extra: list[str]) -> tuple[dict, dict]:
    common = _flags_to_args(extra)
    if a.device or a.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
        common["gpu-memory-utilization"] = a.gpu_memory_utilization
    if a.device:
        common["device"] = a.device
    if a.enable_expert_parallel:
        common["enable-expert-parallel"] = True
    prefill, decode = dict(common), dict(common)
    if a.speculative_config:
        decode["speculative-config"] = _json(a.speculative_config, "--speculative-config")
    if a.attention_config:
        att = _json(a.attention_config, "--attention-config")
        hisparse = {"hisparse_config": att.pop("hisparse_config")} if "hisparse_config" in att else {}
        if att:
            prefill["attention-config"] = att
        if att or hisparse:
            decode["attention-config"] = {**att, **hisparse}
    return prefill, decode


def _layout_args(engine_args: dict) -> dict:
    """The KV-layout flags the kvstore must share with the engines (engine/config/arg_utils.py)."""
    return {k: engine_args[k] for k in ("kv-cache-dtype", "indexer-precision", "block-size") if k in engine_args}


def _router_args(a: argparse.Namespace) -> dict:
    out: dict = {}
    for flag in ROUTER_FLAGS:
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            out[flag[2:]] = value
    if a.enable_auto_tool_choice:
        out["enable-auto-tool-choice"] = True
    return out


def _flags_to_args(extra: list[str]) -> dict:
    """`--name value` / `--name=value` / bare `--name` -> {name: value | True} (the topology's `args`)."""
    out: dict = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise ValueError(f"unexpected argument {tok!r} (flags are --name [value])")
        name, eq, value = tok[2:].partition("=")
        if eq:
            out[name] = value
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            out[name] = extra[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def _json(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def to_topology(raw: dict) -> dict:
    """The derived dict as a topology file holds it (the router's bind address in its args)."""
    raw = json.loads(json.dumps(raw))
    host = raw.pop("router_host")
    if host != raw["host"]:
        raw["services"]["router"]["args"]["host"] = host
    return raw


def serve_main(argv: list[str]) -> int:
    a, extra = parse_args(argv)
    try:
        raw = to_topology(derive(a, extra, visible_gpu_count()))
        topo = topo_mod.load(raw)
        check_placement(topo)
    except ValueError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    if a.emit_topology:
        Path(a.emit_topology).write_text(yaml.safe_dump(raw, sort_keys=False))
        print(f"wrote {a.emit_topology}: `pdserve up --config {a.emit_topology}` starts the same")
    if a.dry_run:
        print(yaml.safe_dump(raw, sort_keys=False))
        print(describe(topo, topo.redis_url, plan(topo, topo.redis_url)))
        return 0
    dep = start(raw, a.run_dir, a.timeout, "pdserve serve")
    if dep is None:
        return 1
    print(f"serving {a.model} at {dep.url} (logs in {dep.run_dir}); Ctrl-C stops it")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if not any(status(dep).values()):
            print("every service has stopped", file=sys.stderr)
            break
    down(dep)
    return 0
