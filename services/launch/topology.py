"""What `pdserve up` runs: the topology file read and validated into its records (services/launch/schema.py),
and the command-line flags of each process.

A topology (YAML or a dict; documented in configs/README.md):

    model: checkpoints/tiny-code          # --model of every service (relative to the project root)
    host: 127.0.0.1                       # address local processes bind (0.0.0.0: every interface)
    advertise_host: 10.0.0.5              # address they register in Redis (default: host, or with
                                          # host 0.0.0.0 this machine's routable address; never 0.0.0.0)
    host_gpus: 8                          # GPUs of the host the file is for (default: nvidia-smi's count)
    multi_host: false                     # true: one of several hosts sharing `redis_url` (required then)
    run_dir: .run                         # logs and state.json
    redis_url: redis://127.0.0.1:6379/0   # used if it answers, else a private redis-server there
    env: {UCX_TLS: tcp}                   # extra environment of every service process
    services:                             # kvstore, prefill, decode start together, the router after them
      kvstore: {replicas: 1, port: 50060, args: {pool-gib: 1}}
      prefill: {replicas: 1, port: 50051, prefill_context_parallel_size: 1,
                decode_context_parallel_size: 1, args: {kv-cache-dtype: fp8_ds_mla}}
      decode:  {replicas: 1, port: 50071, data_parallel_size: 1, args: {enable-expert-parallel: true}}
      router:  {port: 8000, grpc_port: 50050}

Per service: `replicas`, `port` (replica i listens on port + i; 0 = any free port),
`metrics_port` (same rule; 0 = any free), `gpus` (prefill and decode: services/launch/placement.py),
`args` (extra flags: {name: value}, true -> bare flag, a list -> repeated, a dict -> JSON), `env`, and
`module` (default services.<kind>; tests point it at stand-ins). Prefill also takes the parallel sizes and
`ranks` (processes per replica, default max(PCP, DCP)); decode takes `data_parallel_size` (a replica is
then one DP group of that many ranks, one process each, registered as one decode instance per rank).
Each rank of a multi-rank replica gets --rank/--world-size/--master-addr/--master-port; rank 0 serves gRPC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from services.launch.placement import check_placement
from services.launch.schema import ANY_ADDRESS, GPU_KINDS, ORDER, ROOT, ServiceSpec, Topology
from services.rpc.service_args import rank_flags

__all__ = ["ROOT", "Ports", "ServiceSpec", "Topology", "args_to_flags", "flags", "load"]

_TOP_KEYS = {"model", "host", "advertise_host", "host_gpus", "multi_host", "run_dir", "redis_url", "env", "services"}
_SERVICE_KEYS = {"replicas", "port", "metrics_port", "args", "env", "module"}
_KIND_KEYS = {"prefill": {"prefill_context_parallel_size", "decode_context_parallel_size", "ranks"},
              "decode": {"data_parallel_size"}, "router": {"grpc_port"}}


def raw(source: str | Path | dict) -> dict:
    """The topology as its file holds it (a dict), paths made absolute so it loads the same from anywhere."""
    data = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
    data = json.loads(json.dumps(data))
    topo = load(data)
    data["model"] = str(topo.path(data["model"])) if "model" in data else data.get("model")
    if "run_dir" in data:
        data["run_dir"] = str(topo.path(data["run_dir"]))
    return data


def load(source: str | Path | dict) -> Topology:
    """Parse and validate a topology file (or an already-loaded dict); ValueError names the problem."""
    try:
        raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("a topology is a mapping with at least `model` and `services`")
    _no_unknown("topology", raw, _TOP_KEYS)
    if "model" not in raw or not isinstance(raw.get("services"), dict) or not raw["services"]:
        raise ValueError("a topology needs `model` and a non-empty `services` mapping")
    services = []
    for kind, body in raw["services"].items():
        if kind not in ORDER:
            raise ValueError(f"unknown service kind {kind!r}; expected some of {ORDER}")
        services.append(_service(kind, body or {}))
    services.sort(key=lambda s: ORDER.index(s.kind))
    env = {k: str(v) for k, v in (raw.get("env") or {}).items()}
    topo = Topology(model=str(raw["model"]), host=str(raw.get("host", "127.0.0.1")),
                    run_dir=str(raw.get("run_dir", ".run")),
                    redis_url=str(raw.get("redis_url", "redis://127.0.0.1:6379/0")), env=env,
                    services=tuple(services), advertise_host=str(raw.get("advertise_host") or ""),
                    host_gpus=_host_gpus(raw.get("host_gpus")), multi_host=bool(raw.get("multi_host", False)))
    _check_hosts(topo, raw)
    if topo.host_gpus is not None:  # the host is known: place the GPUs now (else `pdserve up` does, on this host)
        check_placement(topo, topo.host_gpus)
    return topo


def _host_gpus(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"host_gpus must be a non-negative integer, got {value!r}")
    return value


def _check_hosts(topo: Topology, raw: dict) -> None:
    if topo.advertise_host in ANY_ADDRESS[:2]:
        raise ValueError(f"advertise_host {topo.advertise_host!r} is a wildcard: name an address other hosts can dial")
    if not topo.multi_host:
        return
    if "redis_url" not in raw:
        raise ValueError("a multi_host topology needs `redis_url`: the Redis every host joins")
    if urlparse(topo.redis_url).hostname in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"a multi_host topology needs a Redis other hosts can reach, not {topo.redis_url}")
    if topo.host in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("a multi_host topology must bind an address other hosts reach (host: 0.0.0.0 "
                         "or this host's address), not loopback")


def _service(kind: str, body: dict) -> ServiceSpec:
    if not isinstance(body, dict):
        raise ValueError(f"services.{kind} must be a mapping")
    kind_keys = _KIND_KEYS.get(kind, set())
    _no_unknown(f"services.{kind}", body, _SERVICE_KEYS | kind_keys | ({"gpus"} if kind in GPU_KINDS else set()))
    ints = {k: body[k] for k in ("replicas", "port", "metrics_port", *kind_keys) if k in body}
    for k, v in ints.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or ("port" not in k and v < 1):
            raise ValueError(f"services.{kind}.{k} must be a {'non-negative' if 'port' in k else 'positive'} "
                             f"integer, got {v!r}")
    if not isinstance(body.get("args", {}), dict) or not isinstance(body.get("env", {}), dict):
        raise ValueError(f"services.{kind}.args and .env must be mappings")
    if kind == "decode" and any(a.lstrip("-") == "data-parallel-size" for a in body.get("args", {})):
        raise ValueError("services.decode: set `data_parallel_size` (the launcher starts one process per DP rank), "
                         "not args.data-parallel-size")
    spec = ServiceSpec(kind=kind, replicas=ints.get("replicas", 1), port=ints.get("port", 0),
                       metrics_port=ints.get("metrics_port", 0), args=dict(body.get("args", {})),
                       env={k: str(v) for k, v in body.get("env", {}).items()}, module=str(body.get("module", "")),
                       extra={k: ints[k] for k in kind_keys if k in ints})
    return _with_gpus(spec, body.get("gpus"))


def _with_gpus(spec: ServiceSpec, gpus) -> ServiceSpec:
    if gpus is None:
        return spec
    where = f"services.{spec.kind}.gpus"
    if spec.kind not in GPU_KINDS:
        raise ValueError(f"{where}: only {' and '.join(GPU_KINDS)} run on GPUs")
    if not isinstance(gpus, list) or not gpus or any(not isinstance(g, int) or isinstance(g, bool) or g < 0
                                                     for g in gpus):
        raise ValueError(f"{where} must be a non-empty list of GPU indices (non-negative integers), got {gpus!r}")
    if len(gpus) not in (1, spec.num_processes):
        raise ValueError(f"{where} lists {len(gpus)} GPUs for {spec.num_processes} processes "
                         f"({spec.replicas} replica(s) x {spec.ranks} rank(s)): one per process, or one for all")
    share = spec.args.get("gpu-memory-utilization", 0.9)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"services.{spec.kind}.args.gpu-memory-utilization must be in (0, 1], got {share!r}")
    return ServiceSpec(**{**spec.__dict__, "gpus": tuple(gpus)})


def _no_unknown(where: str, d: dict, allowed: set[str]) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


# ---- flags of one process -----------------------------------------------------------------------

@dataclass(frozen=True)
class Ports:
    """Ports of one replica, resolved by the launcher (auto-picked where the topology says 0)."""

    port: int
    metrics_port: int
    grpc_port: int = 0  # router only
    master_port: int = 0  # multi-rank prefill / decode only (torch.distributed rendezvous of its ranks)


def flags(topo: Topology, spec: ServiceSpec, replica: int, rank: int, ports: Ports, redis_url: str) -> list[str]:
    """The command-line flags of one service process (the same names docker-compose.yml uses)."""
    out = ["--model", str(topo.path(topo.model)), "--redis-url", redis_url, "--host", topo.host,
           "--advertise-host", topo.advertised, "--port", str(ports.port), "--metrics-port", str(ports.metrics_port),
           "--instance-id", f"{spec.kind}-{replica}"]
    if spec.kind == "router":
        out += ["--grpc-port", str(ports.grpc_port)]
    if spec.kind == "prefill":
        out += ["--prefill-context-parallel-size", str(spec.extra.get("prefill_context_parallel_size", 1)),
                "--decode-context-parallel-size", str(spec.extra.get("decode_context_parallel_size", 1))]
        out += rank_flags(rank, spec.ranks, "127.0.0.1", ports.master_port)  # a rank group is on one host
    if spec.kind == "decode" and spec.ranks > 1:
        out += ["--data-parallel-size", str(spec.ranks), *rank_flags(rank, spec.ranks, "127.0.0.1", ports.master_port)]
    return out + args_to_flags(spec.args)


def args_to_flags(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in args.items():
        flag = "--" + name.lstrip("-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out
