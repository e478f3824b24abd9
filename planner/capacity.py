"""Capacity planner: weights, KV bytes and what fits on a prefill engine and a decode rank.

All byte counts come from the engine's own definitions: KV rows from `engine.kv.cache.KVCacheSpec`,
parameters from `engine.model.GlmDsaForCausalLM` built on the `meta` device (no memory, exact shapes).

Deployment model (docs/parallelism.md, docs/hisparse.md, docs/deployment.md):

    prefill engine   `gpus` ranks = PCP × TP; DCP splits persistent KV over `dcp` of them; experts are
                     split over all `gpus` (EP); TP splits q_b/kv_b/o_proj, dense MLPs, shared experts,
                     embeddings and lm_head; the rest is replicated.
    decode rank      one GPU per DP rank, experts split over the `dp` ranks (EP), the rest replicated.
                     Hybrid HiSparse: a request either stays resident (all KV on the GPU) or is
                     spilled: its MLA rows live in the host pool, the GPU keeps its indexer keys
                     plus a hot buffer of `device_rows` rows per MLA layer.
                     Host memory per rank: the HiSparse pool + the engine's KV offload tier
                     (`--kv-offloading-size`: prefix blocks the pool evicted, MLA rows and indexer keys).

    KV budget per GPU = HBM · gpu_memory_utilization − weights − reserve (activations, graphs, comm)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from math import ceil

import torch

from engine.config.model_config import ModelConfig
from engine.kv.cache import KVCacheSpec
from engine.loading.loader import build_model
from engine.loading.weight_stats import weight_bytes_by_dtype
from engine.model.model import GlmDsaForCausalLM
from engine.parallel.ep import expert_shard

GIB = 1 << 30
FP8_TILE = 128  # fp8 checkpoints: one fp32 scale per 128 x 128 weight tile
TP_SPLIT = ("q_b_proj", "kv_b_proj", "o_proj", "embed_tokens", "lm_head", "shared_experts")
DENSE_MLP = (".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj")
NOT_FP8 = ("embed_tokens", "lm_head", ".mlp.gate.weight")  # kept in bf16 by fp8 checkpoints


@dataclass(frozen=True)
class Deployment:
    gpus: int = 8  # ranks of the prefill engine
    pcp: int = 8
    dcp: int = 8
    tp: int = 1
    dp: int = 8  # decode ranks (one GPU each)
    cp_interleave: int = 1  # --cp-kv-cache-interleave-size
    hbm_gib: float = 140.0  # per GPU (H200: 143,771 MiB)
    host_gib: float = 256.0  # host memory per GPU
    gpu_memory_utilization: float = 0.9
    reserve_gib: float = 6.0
    kv_gib: float | None = None  # override the derived KV budget per GPU (what-if, tests)
    kv_cache_dtype: str = "fp8_ds_mla"
    indexer_precision: str = "fp8"
    weight_dtype: str = "fp8"
    hisparse_pool_gib: float = 48.0  # host pool per decode rank; 0 = HiSparse off
    hisparse_device_rows: int | None = None  # hot rows per layer; default 2 · top-k + 1
    kv_offloading_gib: float = 512.0  # prefill host KV tier, whole engine
    decode_kv_offloading_gib: float = 16.0  # each decode rank's --kv-offloading-size (0 = none)
    with_mtp: bool = True
    block_size: int = 64

    def __post_init__(self) -> None:
        for name in ("gpus", "pcp", "dcp", "tp", "dp", "cp_interleave", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pcp * self.tp != self.gpus:
            raise ValueError(f"prefill ranks = PCP x TP: {self.pcp} x {self.tp} != --gpus {self.gpus}")
        if self.gpus % self.dcp:
            raise ValueError(f"--dcp {self.dcp} must divide --gpus {self.gpus}")
        if self.weight_dtype not in ("fp8", "bf16"):
            raise ValueError(f"--weight-dtype must be fp8 or bf16, got {self.weight_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        for name in ("hisparse_pool_gib", "kv_offloading_gib", "decode_kv_offloading_gib"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.hisparse_pool_gib + self.decode_kv_offloading_gib > self.host_gib:
            raise ValueError(f"a decode rank's host memory: HiSparse pool {self.hisparse_pool_gib} GiB + KV offloading "
                             f"{self.decode_kv_offloading_gib} GiB exceeds host memory per GPU {self.host_gib} GiB")
        if self.kv_offloading_gib > self.host_gib * self.gpus:
            raise ValueError(f"host KV tier {self.kv_offloading_gib} GiB exceeds the prefill host's memory "
                             f"({self.host_gib} GiB x {self.gpus} GPUs)")


# ---- weights -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightBytes:
    experts: int  # routed experts (split by EP)
    tp_split: int  # split by TP
    replicated: int
    num_params: int

    def per_gpu(self, tp: int, ep: int) -> int:
        return self.replicated + ceil(self.tp_split / tp) + ceil(self.experts / ep)


def _param_bytes(name: str, shape: tuple[int, ...], numel: int, weight_dtype: str) -> int:
    if weight_dtype == "bf16" or len(shape) < 2 or any(k in name for k in NOT_FP8):
        return 2 * numel
    lead = numel // (shape[-1] * shape[-2])  # experts: [E, out, in]
    return numel + 4 * lead * ceil(shape[-2] / FP8_TILE) * ceil(shape[-1] / FP8_TILE)


@lru_cache(maxsize=8)
def param_shapes(cfg: ModelConfig, with_mtp: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter, from the engine's model built on `meta` (no memory used)."""
    with torch.device("meta"):
        model = GlmDsaForCausalLM(cfg, with_mtp=with_mtp)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lru_cache(maxsize=16)
def weight_bytes(cfg: ModelConfig, with_mtp: bool, weight_dtype: str) -> WeightBytes:
    buckets = {"experts": 0, "tp_split": 0, "replicated": 0}
    shapes = param_shapes(cfg, with_mtp)
    for name, shape in shapes:
        nbytes = _param_bytes(name, shape, numel(shape), weight_dtype)
        if ".mlp.experts." in name:
            buckets["experts"] += nbytes
        elif any(k in name for k in TP_SPLIT) or any(k in name for k in DENSE_MLP):
            buckets["tp_split"] += nbytes
        else:
            buckets["replicated"] += nbytes
    return WeightBytes(num_params=sum(numel(s) for _, s in shapes), **buckets)


# ---- KV ------------------------------------------------------------------------------------------

def kv_spec(cfg: ModelConfig, dep: Deployment, with_mtp: bool | None = None) -> KVCacheSpec:
    return KVCacheSpec.from_model(cfg, block_size=dep.block_size, kv_cache_dtype=dep.kv_cache_dtype,
                                  indexer_precision=dep.indexer_precision,
                                  with_mtp=dep.with_mtp if with_mtp is None else with_mtp)


def kv_components(cfg: ModelConfig, dep: Deployment) -> dict[str, int]:
    """Bytes one token adds, by component (MTP = what serving the MTP layer adds)."""
    main, full = kv_spec(cfg, dep, with_mtp=False), kv_spec(cfg, dep)
    bs = dep.block_size
    return {"mla": main.mla_block_bytes // bs, "indexer": main.index_block_bytes // bs,
            "mtp_mla": (full.mla_block_bytes - main.mla_block_bytes) // bs,
            "mtp_indexer": (full.index_block_bytes - main.index_block_bytes) // bs,
            "total": full.bytes_per_token}


def tokens_on_rank(num_tokens: int, num_ranks: int, interleave: int = 1) -> int:
    """Tokens the busiest rank (rank 0) holds when token i lives on rank (i // I) % N."""
    cycle = interleave * num_ranks
    return (num_tokens // cycle) * interleave + min(num_tokens % cycle, interleave)


def paged_bytes(num_tokens: int, block_size: int, bytes_per_block: int) -> int:
    return ceil(num_tokens / block_size) * bytes_per_block


def request_kv(spec: KVCacheSpec, context: int, ranks: int = 1, interleave: int = 1) -> int:
    """KV bytes of one request of `context` tokens on the busiest of `ranks` DCP ranks (paged)."""
    return paged_bytes(tokens_on_rank(context, ranks, interleave), spec.block_size, spec.block_bytes)


def prefill_gather_bytes(spec: KVCacheSpec, context: int, dcp: int) -> int:
    """DCP in prefill all-gathers one layer's shards into a full-context buffer; two of them so the
    gather of layer l overlaps the compute of layer l-1 (docs/parallelism.md, "Prefill rows under DCP")."""
    if dcp == 1:
        return 0
    row = spec.mla_row * spec.mla_torch_dtype.itemsize + spec.index_row * spec.index_torch_dtype.itemsize
    return 2 * context * row


def hisparse_split(spec: KVCacheSpec, context: int, device_rows: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of one spilled request: indexer keys + hot rows stay, MLA rows go."""
    gpu = paged_bytes(context, spec.block_size, spec.index_block_bytes)
    gpu += spec.num_mla_layers * device_rows * spec.mla_row * spec.mla_torch_dtype.itemsize
    host = paged_bytes(context, spec.block_size, spec.mla_block_bytes)
    return gpu, host


# ---- what fits -----------------------------------------------------------------------------------

@lru_cache(maxsize=16)
def rank_weight_bytes(cfg: ModelConfig, with_mtp: bool, weight_dtype: str, ep: int) -> dict[str, int]:
    """Bytes by dtype of one expert-parallel rank's weights (its 1/ep of the routed experts and all the
    rest), from the engine's own model for that rank built on `meta`: the parameters an engine allocates,
    FP8 modules and their scales included (engine.model.fp8)."""
    if weight_dtype == "fp8":
        cfg = dataclasses.replace(cfg, quantization="fp8", weight_block_size=(FP8_TILE, FP8_TILE))
    else:
        cfg = dataclasses.replace(cfg, quantization=None)
    shard = expert_shard(cfg.n_routed_experts, 0, ep) if ep > 1 and cfg.n_routed_experts else None
    model = build_model(cfg, device="meta", dtype=torch.bfloat16, with_mtp=with_mtp, expert_shard=shard)
    return weight_bytes_by_dtype(model)


def weights_per_gpu(cfg: ModelConfig, dep: Deployment, role: str) -> int:
    """One rank's weight bytes: the engine's meta model (PCP x EP prefill ranks, DP x EP decode ranks);
    with TP, which the engine does not build, the split formula of `weight_bytes`."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if role == "prefill" and dep.tp > 1:
        return weight_bytes(cfg, dep.with_mtp, dep.weight_dtype).per_gpu(tp=dep.tp, ep=dep.gpus)
    ep = dep.gpus if role == "prefill" else dep.dp
    return sum(rank_weight_bytes(cfg, dep.with_mtp, dep.weight_dtype, ep).values())


def kv_budget(cfg: ModelConfig, dep: Deployment, role: str) -> int:
    """Bytes per GPU left for KV (negative: the weights do not fit)."""
    if dep.kv_gib is not None:
        return int(dep.kv_gib * GIB)
    usable = int(dep.hbm_gib * dep.gpu_memory_utilization * GIB) - int(dep.reserve_gib * GIB)
    return usable - weights_per_gpu(cfg, dep, role)


def largest_fitting(fits, limit: int) -> int:
    """Largest n in [0, limit] with fits(n), for a monotone predicate (fits(0) assumed)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def device_rows(cfg: ModelConfig, dep: Deployment) -> int:
    return dep.hisparse_device_rows or 2 * cfg.index_topk + 1


def prefill_concurrency(spec: KVCacheSpec, dep: Deployment, budget: int, context: int) -> int:
    per_request = request_kv(spec, context, dep.dcp, dep.cp_interleave)
    return max((budget - prefill_gather_bytes(spec, context, dep.dcp)) // per_request, 0)


def decode_concurrency(cfg: ModelConfig, spec: KVCacheSpec, dep: Deployment, budget: int,
                       context: int) -> tuple[int, int]:
    """(resident only, hybrid HiSparse) requests of `context` tokens one decode rank holds.

    Hybrid: spill as many requests as the host pool takes (each spilled one needs less GPU memory than
    a resident one), then fill the GPU memory left with resident requests."""
    kv = request_kv(spec, context)
    resident = max(budget // kv, 0)
    gpu, host = hisparse_split(spec, context, device_rows(cfg, dep))
    pool = int(dep.hisparse_pool_gib * GIB)
    if pool == 0 or gpu >= kv or budget < gpu:
        return resident, resident
    spilled = min(pool // host, budget // gpu)
    return resident, spilled + (budget - spilled * gpu) // kv


def max_contexts(cfg: ModelConfig, spec: KVCacheSpec, dep: Deployment, budgets: dict[str, int]) -> dict:
    limit = cfg.max_position_embeddings
    pre = largest_fitting(lambda n: request_kv(spec, n, dep.dcp, dep.cp_interleave)
                          + prefill_gather_bytes(spec, n, dep.dcp) <= budgets["prefill"], limit)
    resident = largest_fitting(lambda n: request_kv(spec, n) <= budgets["decode"], limit)
    pool, rows = int(dep.hisparse_pool_gib * GIB), device_rows(cfg, dep)

    def spilled_fits(n: int) -> bool:
        gpu, host = hisparse_split(spec, n, rows)
        return gpu <= budgets["decode"] and host <= pool

    hisparse = largest_fitting(spilled_fits, limit) if pool else 0
    return {"max_position_embeddings": limit, "prefill": pre, "decode_resident": resident,
            "decode_hisparse": hisparse, "decode": max(resident, hisparse)}


def decode_host_bytes(dep: Deployment) -> dict[str, int]:
    """Host memory one decode rank pins: the HiSparse pool and the KV offload tier behind it."""
    pool, tier = int(dep.hisparse_pool_gib * GIB), int(dep.decode_kv_offloading_gib * GIB)
    return {"hisparse_pool": pool, "kv_offloading": tier, "total": pool + tier,
            "host_per_gpu": int(dep.host_gib * GIB)}


def capacity(cfg: ModelConfig, dep: Deployment, contexts: list[int]) -> dict:
    """Weights, budgets, KV per token and per request, and what fits at each context length."""
    spec = kv_spec(cfg, dep)
    w = weight_bytes(cfg, dep.with_mtp, dep.weight_dtype)
    budgets = {role: kv_budget(cfg, dep, role) for role in ("prefill", "decode")}
    rows = []
    for n in contexts:
        resident, hybrid = decode_concurrency(cfg, spec, dep, budgets["decode"], n)
        rows.append({"context": n, "kv_bytes": request_kv(spec, n),
                     "kv_bytes_per_gpu_dcp": request_kv(spec, n, dep.dcp, dep.cp_interleave),
                     "prefill_concurrency": prefill_concurrency(spec, dep, budgets["prefill"], n),
                     "decode_concurrency_resident": resident, "decode_concurrency_hybrid": hybrid,
                     "host_tier_contexts": int(dep.kv_offloading_gib * GIB) // request_kv(spec, n),
                     "decode_tier_contexts": int(dep.decode_kv_offloading_gib * GIB) // request_kv(spec, n)})
    return {"num_params": w.num_params, "kv_bytes_per_token": kv_components(cfg, dep),
            "weights_bytes_per_gpu": {r: weights_per_gpu(cfg, dep, r) for r in ("prefill", "decode")},
            "weights_bytes_by_dtype": {"prefill": rank_weight_bytes(cfg, dep.with_mtp, dep.weight_dtype, dep.gpus)
                                       if dep.tp == 1 else None,
                                       "decode": rank_weight_bytes(cfg, dep.with_mtp, dep.weight_dtype, dep.dp)},
            "kv_budget_bytes_per_gpu": budgets, "decode_host_bytes_per_rank": decode_host_bytes(dep),
            "max_context": max_contexts(cfg, spec, dep, budgets),
            "contexts": rows}
