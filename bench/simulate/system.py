"""A topology file as a simulated system: its prefill and decode engine instances (bench/simulate/engines.py),
the production router's placement (services/router/routing.py over an in-memory registry), and the KV
transfer between them, on the virtual clock.

One request, as the router serves it (services/router/flow.py):

    router       placement: the prefill instance with the least work ahead of this prompt given its cached
                 prefix and queue, the least-loaded decode instance (the same `Routing` code, its load figures
                 refreshed every 0.5 s from the engines' schedulers, its prefix lookups from their block pools)
    kvstore      when the router's hint names a kvstore holding more of the prefix than the prefill, the
                 prefill reserves that prefix and loads what the kvstore still holds (a lease of the production
                 BlockPool) before computing the rest
    prefill      the prompt through the prefill engine (chunked, prefix-cached), KV held on finish; its first
                 token reaches the client when the last chunk's step ends: TTFT; its full blocks are offloaded to
                 the kvstore in the background (reserve, write, commit), the prefill keeping them till then
    transfer     the decode reserves blocks for the prompt (production admission: it waits while the pool is
                 short), the KV not already cached there moves at the profile's transfer cost, the prefill's
                 blocks are released
    decode       the request joins the decode engine's batch; every step's tokens reach the client when that
                 step ends
    + the profile's per-request service overhead before the prefill (HTTP, tokenisation, gRPC).

A HiSparse decode admits as its engine does: its KV manager holds the host pool's blocks, and the scheduler's
device-room check is the production `DeviceFootprint` over the device blocks and one hot buffer per request.

An engine's refusal (its own validation: too long, more blocks than its pool) ends the request with the
router's error and releases its prefill KV.

An engine with a host KV tier (--kv-offloading-size) keeps the production tier's bookkeeping in its KV manager:
evicted prefix blocks stored to host memory, a later turn's hit loaded back, each copy paid in the step that runs
it at the profile's host-memory bandwidth (its kvstore entry).

A DP x EP prefill group (`--set services.prefill.data_parallel_size=8`, with PCP and DCP 1) is a what-if the
launcher does not run (pdserve's prefill splits a prompt's context over PCP/DCP ranks instead): it is simulated as
one prefill instance per rank, each with its own production scheduler, prefix cache and KV pool (a rank holds
its requests' whole KV), the router placing prompts among them as among prefill replicas, and its step cost the
profile's `prefill/dpN` entry.

A DP group (decode, or the prefill what-if) is one instance per rank, its ranks stepping together
(engines.LockStep): a step lasts as long as its slowest rank's, and a rank without work runs a dummy pass.

A prefill and a decode placed on one device (one topology file, a GPU both list, or neither listing GPUs: the
host's default device) share it (engines.SharedDevice) with the profile's measured `shared_device` slowdowns;
a profile without them costs each as if alone, and each level's `sim.shared_device` says which it was.

What it does not model (yet): PCP/DCP and DP×EP inside an engine beyond their step costs, migrations and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
from pathlib import Path

import yaml

from bench.serving.client import RequestRecord
from bench.simulate.engines import TOKEN, LockStep, SharedDevice, SimEngine
from bench.simulate.profile import DispersedCost, Profile, decode_key, prefill_key
from engine.config.arg_utils import EngineArgs
from engine.config.presets import PRESETS, preset
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.hisparse.host_pool import host_blocks_for
from engine.hisparse.layout import HotLayout
from engine.hisparse.residency import DeviceFootprint
from engine.kv.budget import num_blocks_for_bytes, num_kv_blocks
from engine.kv.cache import KVCacheSpec
from engine.kv.hashing import block_hashes
from engine.kv.offload import OffloadTier
from engine.kv.offload_buffer import offload_blocks_for
from planner.capacity import weight_bytes
from services.cluster.redis_state import InstanceInfo
from services.kvstore.pool import BlockPool
from services.launch import topology as topology_mod
from services.router.routing import Routing

_GIB = 1 << 30
LEASE_S = 600.0  # kvstore reservations and leases: far longer than any simulated transfer
# a request's time, in order: the services' overhead, the kvstore load of a hinted prefix, the wait for the prefill's
# first step of it, the prefill's steps (to the first token), the handoff (decode admission + KV transfer), decoding
PHASES = ("service", "kvstore_load", "prefill_queue", "prefill", "handoff", "decode")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    role: str
    instance_id: str
    cfg: object  # EngineConfig
    key: str  # its step-cost entry in the profile
    num_blocks: int
    gpus: int  # GPUs it occupies (throughput per GPU)
    acceptance_length: float | None
    device_room: tuple[int, int] | None = None  # HiSparse: (device blocks, blocks of one hot buffer)
    offload: tuple[int, int] | None = None  # host KV tier (--kv-offloading-size): (its blocks, bytes a block)
    group: str | None = None  # the DP group whose ranks step together (engines.LockStep)
    deployment_gpus: int | None = None  # distinct GPUs the topology places its engines on (None: not listed)
    shared_device: bool = False  # placed on one device with the other role's engines (engines.SharedDevice)


def model_dir(model: str, topo_path: Path, tmp: Path) -> Path:
    """A checkpoint directory with the model's config.json: the topology's own, or a preset's written to `tmp`."""
    if model in PRESETS:
        (tmp / "config.json").write_text(json.dumps(preset(model).to_hf_dict()))
        return tmp
    path = Path(model)
    if not path.is_absolute():
        path = (topo_path.parent / path) if (topo_path.parent / path).exists() else path
    if not (path / "config.json").exists() and not (path.is_file() and path.name == "config.json"):
        raise ValueError(f"model {model!r}: no config.json there and not a preset ({', '.join(sorted(PRESETS))})")
    return path if path.is_dir() else path.parent


def engine_cfg(spec, model_path: Path, pcp: int = 1, dcp: int = 1, device: str = "cpu"):
    """The EngineConfig a topology's service builds from its flags (on `device`: the simulator only reads it)."""
    p = EngineArgs.add_cli_args(argparse.ArgumentParser(add_help=False))
    flags = ["--model", str(model_path), "--device", device,
             "--prefill-context-parallel-size", str(pcp), "--decode-context-parallel-size", str(dcp)]
    ns, _ = p.parse_known_args(flags + topology_mod.args_to_flags(spec.args))
    return EngineArgs.from_cli_args(ns).create_engine_config()


def _spec(cfg) -> KVCacheSpec:
    return KVCacheSpec.from_model(cfg.model, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                  indexer_precision=cfg.cache.indexer_precision, with_mtp=cfg.with_mtp)


def hisparse_admits(cfg) -> bool:
    """Whether a decode's requests are admitted by HiSparse (host pool + hot buffers; its own step-cost entry,
    profile.decode_key), rather than held whole on the device (no HiSparse, or its offload-only baseline)."""
    return cfg.hisparse is not None and not cfg.hisparse.offload_only


def _hisparse_pools(cfg, device_blocks: int) -> tuple[int, tuple[int, int]]:
    """A HiSparse decode's admission, as its engine sizes it (engine/hisparse/manager.py): blocks of the host pool,
    and (device blocks, blocks of one hot buffer) for the scheduler's device-room check."""
    hs, spec = cfg.hisparse, _spec(cfg)
    layout = HotLayout.create(cfg.model.index_topk, hs.device_buffer_size, cfg.num_spec_tokens, spec.block_size)
    num_host = host_blocks_for(spec, hs.host_pool_gib, hs.host_pool_blocks)
    if cfg.cache.num_blocks is None:
        device_blocks = max((device_blocks * spec.block_bytes - num_host * spec.index_block_bytes)
                            // spec.mla_block_bytes, 1)
    return num_host, (device_blocks, layout.num_blocks)


def _num_blocks(cfg, profile: Profile, ranks: int, ep: bool, what: str) -> int:
    """The KV pool of one instance: the engine's own rule on the CPU; on the profile's GPU, HBM at
    gpu_memory_utilization less the rank's weights (ranks of one instance split its routed experts with EP)."""
    spec = _spec(cfg)
    if profile.hbm_gib is None:
        return num_kv_blocks(cfg, spec)
    dtype = "fp8" if cfg.model.quantization == "fp8" else "bf16"
    weights = weight_bytes(cfg.model, cfg.with_mtp, dtype).per_gpu(tp=1, ep=ranks if ep else 1)
    budget = profile.hbm_gib * _GIB * cfg.cache.gpu_memory_utilization - weights
    n = num_blocks_for_bytes(spec, int(budget)) if budget > 0 else 0
    if n < 1:
        raise ValueError(f"{what}: {weights / _GIB:.1f} GiB of weights per GPU leave no KV block in "
                         f"{profile.hbm_gib} GiB x {cfg.cache.gpu_memory_utilization} of HBM ({profile.path})")
    return n * ranks if cfg.parallel.decode_context_parallel_size > 1 else n


def override(data: dict, setting: str) -> None:
    """Apply one `--set PATH=VALUE` to a topology's dict: PATH is dotted keys into it (mappings made as needed),
    VALUE read as YAML (`services.decode.args.kv-offloading-size=64`,
    `services.decode.args.attention-config.hisparse_config.host_pool_gib=96`, `services.decode.replicas=2`)."""
    path, sep, text = setting.partition("=")
    keys = path.split(".")
    if not sep or not all(keys):
        raise ValueError(f"--set {setting!r}: expected PATH=VALUE, PATH dotted keys of the topology")
    node = data
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {setting!r}: {'.'.join(keys[:i + 1])} is not a mapping")
    node[keys[-1]] = yaml.safe_load(text)


def services_of(topo_paths: list[str], settings: list[str] = ()) -> tuple[str, Path, dict, int | None, bool]:
    """One deployment from its topology files (one per host, as `pdserve up` runs them): (model, the file its
    model path is relative to, {kind: ServiceSpec} of its kvstore, if any, prefill and decode, the GPUs its
    engines are placed on or None: `_placed_gpus`, whether the prefill and decode share a device:
    `_shared_device`). The files must
    name the same model, and a service kind may appear in one file only. `settings` (`override`) change them
    first: one under `services.KIND` applies to the file that has that service, any other to every file."""
    raws = [topology_mod.raw(p) for p in topo_paths]
    for setting in settings:
        keys = setting.partition("=")[0].split(".")
        targets = [r for r in raws if keys[0] != "services" or (len(keys) > 1 and keys[1] in r["services"])]
        if not targets:
            raise ValueError(f"--set {setting!r}: no topology file has that service")
        for r in targets:
            override(r, setting)
    model, where, services = None, None, {}
    for path, data in zip(topo_paths, raws):
        prefill_dp = _pop_prefill_dp(data)
        topo = topology_mod.load(data)
        if model is not None and topo.model != model:
            raise ValueError(f"topology files name different models: {model!r} ({where}) and {topo.model!r} ({path})")
        model, where = topo.model, where or Path(path)
        for kind in ("kvstore", "prefill", "decode"):
            spec = topo.service(kind)
            if spec is None:
                continue
            if kind in services:
                raise ValueError(f"the {kind} service appears in two topology files ({services[kind][1]} and {path})")
            if kind == "prefill" and prefill_dp is not None:
                spec = dataclasses.replace(spec, extra={**spec.extra, "data_parallel_size": prefill_dp})
            services[kind] = (spec, path)
    for kind in ("prefill", "decode"):
        if kind not in services:
            raise ValueError(f"topology {', '.join(topo_paths)} has no {kind} service")
    return model, where, {k: spec for k, (spec, _) in services.items()}, _placed_gpus(services), \
        _shared_device(services)


def _placed_gpus(services: dict) -> int | None:
    """Distinct GPUs the prefill and decode engines are placed on, as (topology file, GPU id): engines sharing a GPU
    (configs/topology.gpu-1.yaml) count it once, as `bench agentx --num-gpus` does; None where a service lists none."""
    if not all(services[k][0].gpus for k in ("prefill", "decode")):
        return None
    return len({(services[k][1], g) for k in ("prefill", "decode") for g in services[k][0].gpus})


def _shared_device(services: dict) -> bool:
    """Whether the prefill and decode engines run on one device: in one topology file (one host), on GPUs the
    two lists share, or neither listing GPUs (the host's default device: its CPU cores, or GPU 0)."""
    (pre, pre_path), (dec, dec_path) = services["prefill"], services["decode"]
    if pre_path != dec_path:
        return False
    if pre.gpus and dec.gpus:
        return bool(set(pre.gpus) & set(dec.gpus))
    return not pre.gpus and not dec.gpus


def _pop_prefill_dp(data: dict) -> int | None:
    """A what-if the launcher does not run: `services.prefill.data_parallel_size` (set with --set), a DP x EP
    prefill group, one rank per GPU, each with its own requests, scheduler, prefix cache and KV pool (pdserve's
    prefill engines split a prompt's context over PCP/DCP ranks instead). Taken out of the topology before it is
    validated; None when absent."""
    body = data.get("services", {}).get("prefill") if isinstance(data.get("services"), dict) else None
    if not isinstance(body, dict) or "data_parallel_size" not in body:
        return None
    dp = body.pop("data_parallel_size")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"services.prefill.data_parallel_size must be a positive integer, got {dp!r}")
    if dp > 1:
        body.setdefault("ranks", dp)  # one process per rank: the topology's GPU placement checks them
    return dp


def engine_specs(topo_paths: str | list[str], profile: Profile, model: str | None, tmp: Path,
                 settings: list[str] = ()) -> list[EngineSpec]:
    paths = [topo_paths] if isinstance(topo_paths, (str, Path)) else list(topo_paths)
    topo_model, topo_path, services, placed, shared = services_of([str(p) for p in paths], settings)
    mdir = model_dir(model or topo_model, topo_path, tmp)
    out = []
    for kind in ("prefill", "decode"):
        spec = services[kind]
        acceptance = None
        if kind == "prefill":
            pcp = spec.extra.get("prefill_context_parallel_size", 1)
            dcp = spec.extra.get("decode_context_parallel_size", 1)
            dp = spec.extra.get("data_parallel_size", 1)
            if dp > 1 and max(pcp, dcp) > 1:
                raise ValueError(f"services.prefill: a DP prefill group (data_parallel_size {dp}) has one GPU per "
                                 f"rank; set prefill_context_parallel_size and decode_context_parallel_size to 1 "
                                 f"(got {pcp} and {dcp})")
            cfg = engine_cfg(spec, mdir, pcp, dcp)
            # a DP group (simulated only): one instance per rank, one GPU each, the routed experts split over them
            key, per, ranks = prefill_key(pcp, dcp, dp), dp, pcp
        else:
            cfg = engine_cfg(spec, mdir)
            dp = spec.extra.get("data_parallel_size", 1)
            # a DP group: one instance per rank, one GPU each
            key, per, ranks = decode_key(dp, hisparse_admits(cfg)), dp, 1
            if cfg.speculative is not None:
                acceptance = cfg.speculative.synthetic_acceptance_length or profile.raw.get("mtp_acceptance_length")
        profile.engine(key)  # a missing entry is an error before anything runs
        profile.transfer_s(0)
        _ = profile.busy_handoff_s
        profile.request_overhead(0)
        ep = bool(spec.args.get("enable-expert-parallel")) or (kind == "prefill" and per == 1)
        blocks = _num_blocks(cfg, profile, max(ranks, per), ep, f"{kind} of {topo_path}")
        room = None
        if kind == "decode" and hisparse_admits(cfg):
            blocks, room = _hisparse_pools(cfg, blocks)
        offload = offload_tier_size(cfg, ranks)
        if offload is not None:
            profile.kvstore_s(0)  # its copies cost host-memory bandwidth: an error before anything runs
        for r in range(spec.replicas):
            for rank in range(per):
                iid = f"{kind}-{r}" + (f"-dp{rank}" if per > 1 else "")
                out.append(EngineSpec(kind, iid, cfg, key, blocks, ranks if kind == "prefill" else 1, acceptance,
                                      room, offload, f"{kind}-{r}" if per > 1 else None,
                                      shared_device=shared and per == 1))
    if placed is not None:
        out = [dataclasses.replace(e, deployment_gpus=placed) for e in out]
    store = services.get("kvstore")
    if store is not None:
        pre = next(e for e in out if e.role == "prefill")
        profile.kvstore_s(0)  # a kvstore needs its transfer cost: an error before anything runs
        for r in range(store.replicas):
            out.append(EngineSpec("kvstore", f"kvstore-{r}", pre.cfg, "kvstore", kvstore_blocks(store, pre.cfg),
                                  0, None))
    return out


def offload_tier_size(cfg, ranks: int) -> tuple[int, int] | None:
    """An engine's host KV tier as it sizes it (engine/kv/offload_buffer.py): (blocks, bytes of a block over its
    `ranks` ranks), None without --kv-offloading-size."""
    size = cfg.cache.kv_offloading_size
    if not size:
        return None
    block_bytes = _spec(cfg).block_bytes  # one rank's rows of a block
    return offload_blocks_for(size, block_bytes, ranks), block_bytes * ranks


def _offload(spec: EngineSpec, profile: Profile) -> tuple[OffloadTier | None, float]:
    """(the production tier bookkeeping, seconds per block copy) of an engine with a host KV tier: each copy moves
    a block at the profile's host-memory bandwidth (its kvstore entry: pinned host memory <-> GPU)."""
    if spec.offload is None:
        return None, 0.0
    blocks, block_bytes = spec.offload
    return OffloadTier(blocks, block_bytes), profile.kvstore_s(block_bytes) - profile.kvstore_s(0)


def kvstore_blocks(spec, cfg) -> int:
    """A kvstore's pool as the service sizes it (services/kvstore/main.py: --pool-gib of the prefill's blocks)."""
    gib = spec.args.get("pool-gib")
    if not isinstance(gib, (int, float)) or isinstance(gib, bool) or gib <= 0:
        raise ValueError(f"services.kvstore.args.pool-gib must be a positive number, got {gib!r}")
    n = num_blocks_for_bytes(_spec(cfg), int(gib * _GIB))
    if n < 1:
        raise ValueError(f"kvstore pool-gib {gib} holds no block of {_spec(cfg).block_bytes} bytes")
    return n


class SimKVStore:
    """A kvstore instance: the production `BlockPool` (services/kvstore/pool.py: reservations, leases, LRU
    eviction) on the virtual clock; its transfers are costed by the profile's `kvstore` entry."""

    def __init__(self, instance_id: str, num_blocks: int):
        self.instance_id = instance_id
        self.pool = BlockPool(num_blocks)
        self.loaded_blocks = 0
        self.offloaded_blocks = 0

    def cached_prefix(self, hashes: list[bytes]) -> int:
        return self.pool.lookup(hashes)


class _Registry:
    """What the router reads from Redis, from the simulated instances (RedisState's calls `Routing` makes)."""

    def __init__(self, engines: dict[str, SimEngine | SimKVStore], roles: dict[str, str]):
        self.engines, self.roles = engines, roles

    async def instances(self, role: str | None = None) -> list[InstanceInfo]:
        return [InstanceInfo(self.roles[i], i, f"sim://{i}") for i in self.engines
                if role is None or self.roles[i] == role]

    async def loads(self, ids) -> dict[str, dict[str, float]]:
        return {i: self.engines[i].load() for i in ids if isinstance(self.engines[i], SimEngine)}

    async def lookup_prefix(self, hashes, *, role=None, instance_ids=None) -> dict[str, int]:
        ids = instance_ids if instance_ids is not None else list(self.engines)
        runs = {i: self.engines[i].cached_prefix(hashes) for i in ids if i in self.engines}
        return {i: n for i, n in runs.items() if n}


class SimSystem:
    def __init__(self, specs: list[EngineSpec], profile: Profile, seed: int, dispersion: bool = False,
                 served_prefill: bool = True, served_by_streams: bool = False, busy_handoff: bool = False):
        """`dispersion`: each step drawn around its cost as the profile's measured steps of the layout spread
        around their fit (Profile.dispersion), seeded per engine; else every step of a shape costs the same.
        `served_prefill`: each prefill step costs what the running services added to it too, where the profile
        measured that (`prefill_served`: under load where it has the busy window, else the lone probe's at the
        streams live, or that always with `served_by_streams`); else its engine-alone fit only.
        `busy_handoff`: a handoff whose prefill has more work when it starts costs the profile's busy handoff
        (`transfer.busy_s`, where measured), else the latency under the streams live."""
        self.loop = asyncio.get_running_loop()
        self.profile = profile
        self.specs = {s.instance_id: s for s in specs}

        def cost(s: EngineSpec, n: int):
            base, ratios = profile.engine(s.key), profile.dispersion(s.key) if dispersion else None
            return DispersedCost(base, ratios, seed * 1000 + n) if ratios else base

        self.engines = {s.instance_id: SimEngine(s.instance_id, s.cfg, s.num_blocks, cost(s, n),
                                                 self.loop, seed + n, s.acceptance_length,
                                                 *_offload(s, profile))
                        for n, s in enumerate(specs) if s.role != "kvstore"}
        self.stores = {s.instance_id: SimKVStore(s.instance_id, s.num_blocks) for s in specs if s.role == "kvstore"}
        groups: dict[str, LockStep] = {}
        for s in specs:
            if s.device_room is not None:  # HiSparse: admission by device room too (production DeviceFootprint)
                self.engines[s.instance_id].kv.device_footprint = DeviceFootprint(*s.device_room)
            if s.group is not None:  # a DP group's ranks step together
                groups.setdefault(s.group, LockStep(self.loop)).add(self.engines[s.instance_id])
        self.streams = 0  # requests past their first token, still streaming (request_overhead's load)
        self.busy_handoff = busy_handoff and profile.busy_handoff_s is not None
        self.busy_handoffs = 0  # handoffs costed at the busy handoff's latency
        # malformed entries: refused now
        _ = (profile.served_prefill_busy, profile.served_prefill_extra(0, by_streams=True),
             profile.served_prefill_spread())
        slowdown = profile.shared_device
        served_prefill = served_prefill and profile.has_served_prefill
        if served_prefill:  # each prefill step as the services take it, at the streams live then
            spread = profile.served_prefill_spread(served_by_streams) if dispersion else None
            for n, s in enumerate(specs):
                if s.role != "prefill":
                    continue
                if spread:  # with dispersion, each served step drawn as the busy window's (or the probes') spread
                    rng = random.Random(seed * 1000 + 500 + n)
                    extra = (lambda rng=rng: profile.served_prefill_extra(self.streams, rng.choice(spread),
                                                                          served_by_streams))
                else:
                    extra = (lambda: profile.served_prefill_extra(self.streams, by_streams=served_by_streams))
                self.engines[s.instance_id].served_extra = extra
            # the probes' points under streams hold the decode's share of the device; the busy window does not
            # (the calibration keeps the prefill busy with the decode idle), so the sharing still slows its steps
            if slowdown is not None and (served_by_streams or profile.served_prefill_busy is None):
                slowdown = {**slowdown, "prefill": 1.0}
        sharing = [s for s in specs if s.shared_device and s.role != "kvstore"]
        # engines on one device take turns on it; without the profile's measured slowdowns, each as if alone
        self.shared_device = {"engines": [s.instance_id for s in sharing], "slowdown": slowdown,
                              "served_prefill": served_prefill and (
                                  "by streams" if served_by_streams or profile.served_prefill_busy is None
                                  else "busy")}
        if len({s.role for s in sharing}) > 1 and slowdown is not None:
            device = SharedDevice(self.loop, slowdown)
            for s in sharing:
                device.add(self.engines[s.instance_id], s.role)
        self.routing = Routing(_Registry({**self.engines, **self.stores}, {s.instance_id: s.role for s in specs}),
                               block_size=specs[0].cfg.cache.block_size)
        pre = next(s for s in specs if s.role == "prefill")
        self.block_bytes = _spec(pre.cfg).block_bytes  # a whole block, as the kvstore stores it
        dec = next(s for s in specs if s.role == "decode")
        self.kv_bytes_per_token = _spec(dec.cfg).block_bytes / dec.cfg.cache.block_size
        self.block_size = specs[0].cfg.cache.block_size
        self._ids = itertools.count()
        self.transfer_s = 0.0  # virtual seconds of KV transfers, summed
        self.admission_waits = 0  # decode reservations that waited for room
        self.refusals = 0  # requests an engine refused (prompts no pool of it can hold)
        # where each request's time went: its record and seconds by phase (PHASES)
        self.phases: list[tuple[RequestRecord, dict[str, float]]] = []

    @property
    def num_gpus(self) -> int:
        """The GPUs of the deployment: those its topology places the engines on, else each engine's ranks."""
        placed = next(iter(self.specs.values())).deployment_gpus
        return placed or sum(s.gpus for s in self.specs.values())

    async def close(self) -> None:
        await self.routing.close()

    async def send(self, prompt: list[int], max_tokens: int, rec: RequestRecord) -> RequestRecord:
        loop = self.loop
        rec.t_start = loop.time()
        rid = f"sim-{next(self._ids)}"
        phases: dict[str, float] = {}
        self.phases.append((rec, phases))
        # the services' time, with the host work of the tokens other requests are streaming meanwhile
        await asyncio.sleep(self.profile.request_overhead(self.streams))
        phases["service"] = loop.time() - rec.t_start
        hashes = block_hashes(prompt, self.block_size)
        choice = await self.routing.pick_prefill(hashes, len(prompt))
        pid = choice.instance.instance_id
        prefill = self.engines[pid]
        first: asyncio.Future = loop.create_future()
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.routing.started(pid)
        try:
            # the first token (a chunk before the last one emits an output without tokens)
            req = Request(rid, list(prompt), sp, hold_kv_on_finish=True)
            listener = lambda o: first.done() or not (o.new_token_ids or o.finish_reason) or first.set_result(o)
            t_hint = loop.time()
            if not await self._from_kvstore(choice, prefill, req, hashes, listener):
                prefill.add(req, listener)
            t_added = loop.time()
            await first
        except ValueError as e:  # refused (the engine's own validation), as the router reports it to the client
            return self._refused(rec, f"prefill {pid} failed: INVALID_ARGUMENT: {e}")
        finally:
            self.routing.finished(pid)
        rec.t_first = loop.time()
        started = prefill.first_step.pop(rid, rec.t_first)
        phases.update(kvstore_load=t_added - t_hint, prefill_queue=started - t_added, prefill=rec.t_first - started)
        rec.output_tokens = 1
        rec.prompt_tokens = len(prompt)
        rec.cached_tokens = prefill.scheduler.held[rid].num_cached_tokens if rid in prefill.scheduler.held else None
        # the prompt's full blocks go to the kvstore in the background; the prefill keeps them until that read ends
        # and the decode has pulled them (services/prefill/leases.py)
        offload = self._to_kvstore(hashes)
        if max_tokens <= 1:
            self._release_after(offload, prefill, rid)
            rec.t_end = rec.t_first
            return rec
        self.streams += 1  # from its first token to its last, a stream the services carry
        try:
            await self._decode(rid, prompt, max_tokens, rec, prefill, phases, offload)
        finally:
            self.streams -= 1
        return rec

    async def _from_kvstore(self, choice, prefill: SimEngine, req: Request, hashes: list[bytes], listener) -> bool:
        """The prefill service's admission with a kvstore hint (services/prefill/server.py `_admit`): reserve the
        hinted prefix's blocks, load what the kvstore still holds beyond the local cache, then compute the rest.
        False when there is no hint or no room to stage it (the prompt is then simply added)."""
        n_hint = min(choice.kvstore_blocks if choice.kvstore is not None else 0, len(hashes),
                     (req.num_tokens - 1) // self.block_size)
        if n_hint == 0:
            return False
        got = prefill.reserve_import(req, n_hint * self.block_size, listener)
        if got is None:
            return False
        first = got[1] // self.block_size
        store = self.stores[choice.kvstore.instance_id]
        lease = store.pool.load(hashes[first:n_hint], LEASE_S, self.loop.time()) if first < n_hint else None
        loaded = len(lease.block_ids) if lease is not None else 0
        if loaded:
            await asyncio.sleep(self.profile.kvstore_s(loaded * self.block_bytes))
            store.pool.release(lease.lease_id, self.loop.time())
            store.loaded_blocks += loaded
        prefill.import_done(req.req_id, ok=loaded > 0, num_tokens=(first + loaded) * self.block_size)
        return True

    def _to_kvstore(self, hashes: list[bytes]) -> asyncio.Task | None:
        """Offload the blocks the (first) kvstore lacks: reserve, write at the profile's cost, commit."""
        if not self.stores or not hashes:
            return None
        store = next(iter(self.stores.values()))
        res, _, _ = store.pool.reserve(hashes, LEASE_S, self.loop.time())
        if res is None:
            return None

        async def write():
            await asyncio.sleep(self.profile.kvstore_s(len(res.block_ids) * self.block_bytes))
            store.pool.commit(res.reservation_id, self.loop.time())
            store.offloaded_blocks += len(res.block_ids)
        return self.loop.create_task(write())

    @staticmethod
    def _release_after(offload: asyncio.Task | None, prefill: SimEngine, rid: str) -> None:
        if offload is None or offload.done():
            prefill.release_held(rid)
        else:
            offload.add_done_callback(lambda _: prefill.release_held(rid))

    def _refused(self, rec: RequestRecord, message: str) -> RequestRecord:
        rec.error, rec.t_end = message, self.loop.time()
        self.refusals += 1
        return rec

    async def _decode(self, rid: str, prompt: list[int], max_tokens: int, rec: RequestRecord, prefill: SimEngine,
                      phases: dict[str, float], offload: asyncio.Task | None = None):
        loop = self.loop
        dinfo = await self.routing.pick_decode()
        did = dinfo.instance_id
        decode = self.engines[did]
        done: asyncio.Future = loop.create_future()
        last = [rec.t_first]

        def on_output(o) -> None:
            now = loop.time()
            rec.itl_s.append(now - last[0])
            last[0] = now
            rec.output_tokens += len(o.new_token_ids)
            if o.finish_reason is not None and not done.done():
                done.set_result(o)

        req = Request(rid, list(prompt) + [TOKEN], SamplingParams(max_tokens=max_tokens - 1, temperature=0.0,
                                                                    ignore_eos=True), remote_kv=True)
        self.routing.started(did)
        try:
            try:
                await decode.between_steps()  # the decode service reserves through an engine call
                while (got := decode.reserve_import(req, len(prompt), on_output)) is None:
                    self.admission_waits += 1
                    await asyncio.sleep(max(decode.cost([]), 1e-3))  # the pool frees as its steps end
            except ValueError as e:  # a request no pool of this decode can hold: the router ends it
                self._release_after(offload, prefill, rid)
                self._refused(rec, f"decode {did} failed: INVALID_ARGUMENT: {e}")
                return
            _, n_local = got
            # the handoff's latency for the other requests streaming meanwhile (this one counts itself from its
            # first token on)
            busy = self.busy_handoff and prefill.has_work()
            self.busy_handoffs += busy
            seconds = self.profile.transfer_s((len(prompt) - n_local) * self.kv_bytes_per_token,
                                              max(self.streams - 1, 0), prefill_busy=busy)
            self.transfer_s += seconds
            await asyncio.sleep(seconds)
            self._release_after(offload, prefill, rid)
            decode.import_done(rid)
            t_in = loop.time()
            await done
        finally:
            self.routing.finished(did)
        rec.t_end = loop.time()
        phases.update(handoff=t_in - rec.t_first, decode=rec.t_end - t_in)

