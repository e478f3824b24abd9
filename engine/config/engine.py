"""The engine's frozen config tree: cache, scheduler, parallelism, speculation, HiSparse (docs/conventions.md,
"Architecture").

Values found at run time (how many KV blocks fit) are the runner's (`ModelRunner.kv_cache.num_blocks`, reported in
`EngineCore.get_stats()`), not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config.model_config import ModelConfig

# the KV cache's row formats (engine/kv/cache.py, docs/kv-formats.md) and the indexer keys' precisions
KV_CACHE_DTYPES = ("fp8_ds_mla", "bfloat16", "float32")
INDEXER_PRECISIONS = ("fp8", "fp32")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 64
    kv_cache_dtype: str = "float32"  # resolved from "auto" by EngineConfig.create
    indexer_precision: str = "fp32"
    num_blocks: int | None = None  # explicit pool size; else sized from memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0  # KV budget when the "device" is the CPU
    enable_prefix_caching: bool = True
    # Keep (and compute) the MTP layer's KV when the model has one, even without speculating: every
    # engine of a deployment then has one block layout, and decode engines that draft find the MTP
    # cache of imported prompts filled in (it costs one extra layer's worth of prefill).
    mtp_kv: bool = True
    # GiB of host memory for the KV offload tier (vLLM's --kv-offloading-size): prefix-cached blocks evicted
    # from the device pool are kept there and loaded back on a hit (docs/kv-offloading.md). The engine's
    # total: the ranks of one CP engine split it; each DP rank is an engine of its own and gets all of it.
    # None or 0: no tier.
    kv_offloading_size: float | None = None

    def __post_init__(self) -> None:
        check_offloading_size(self.kv_offloading_size)
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size extends the prefix cache: it needs prefix caching (drop "
                             "--no-enable-prefix-caching or --kv-offloading-size)")
        if self.block_size != 64:
            raise ValueError("block_size must be 64 (the fp8_ds_mla page and the prefix-hash block)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} or 'auto', got {self.kv_cache_dtype!r}")
        if self.indexer_precision not in INDEXER_PRECISIONS:
            raise ValueError(f"indexer_precision must be one of {INDEXER_PRECISIONS}, got {self.indexer_precision!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


def check_offloading_size(size) -> None:
    """kv_offloading_size must be None or a finite number of GiB >= 0 (ValueError naming the value)."""
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) or size < 0:
        raise ValueError(f"kv_offloading_size is a size in GiB (a finite number >= 0, 0 = off), got {size!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    # plan step N+1 while step N runs on the GPU (vLLM's --async-scheduling; docs/async_scheduling.md)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_model_len, max_num_batched_tokens and max_num_seqs must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 3
    synthetic_acceptance_length: float | None = None  # benchmark mode: fixed mean acceptance length

    def __post_init__(self) -> None:
        if self.method != "mtp":
            raise ValueError(f"speculative method must be 'mtp', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 3:
            raise ValueError("num_speculative_tokens must be 1, 2 or 3 (one MTP layer, recycled)")
        L = self.synthetic_acceptance_length
        if L is not None and not 1.0 <= L <= 1.0 + self.num_speculative_tokens:
            raise ValueError(f"synthetic_acceptance_length must be in [1, {1 + self.num_speculative_tokens}], got {L}")

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if not d:
            return None
        unknown = set(d) - {"method", "num_speculative_tokens", "synthetic_acceptance_length"}
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class ParallelConfig:
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    data_parallel_size: int = 1
    ep_decode_dispatch: str = "static"  # DP x EP decode steps: "static" (planned, capturable) or "dynamic"

    def __post_init__(self) -> None:
        if self.ep_decode_dispatch not in ("static", "dynamic"):
            raise ValueError(f"ep_decode_dispatch must be 'static' or 'dynamic', got {self.ep_decode_dispatch!r}")
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        if pcp < 1 or dcp < 1:
            raise ValueError("context parallel sizes must be >= 1")
        if dcp not in (1, pcp):
            raise ValueError(f"decode_context_parallel_size must be 1 or equal to the PCP size ({pcp}), got {dcp}")
        if self.dcp_comm_backend not in ("ag_rs", "a2a"):
            raise ValueError(f"dcp_comm_backend must be 'ag_rs' or 'a2a', got {self.dcp_comm_backend!r}")
        if self.cp_kv_cache_interleave_size < 1 or 64 % self.cp_kv_cache_interleave_size:
            raise ValueError("cp_kv_cache_interleave_size must divide the block size (64)")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and pcp > 1:
            raise ValueError("data_parallel_size > 1 runs one rank per DP replica: use it without the context "
                             "parallel sizes (PCP x DCP is the prefill engine's, DP x EP the decode engine's)")

    @property
    def world_size(self) -> int:
        """Processes (ranks) of one engine: its PCP ranks, or its DP ranks."""
        return self.prefill_context_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class HiSparseConfig:
    """Hybrid HiSparse for decode (docs/hisparse.md, `engine/hisparse/`).

    host_pool_gib       host memory for every request's MLA rows (all layers incl. MTP); admission is
                        bounded by it. `host_pool_blocks` overrides it with an exact block count (tests).
    device_buffer_size  LRU rows per request per layer of a non-resident request's hot buffer (default
                        2 * index_topk); raised to (1 + drafts) * index_topk with MTP so the union of the
                        verify rows' selections always fits.
    offload_only        comparison baseline: no device pages and no hot buffer; every step brings each
                        request's whole context back to the device, layer by layer.
    """

    host_pool_gib: float = 1.0
    device_buffer_size: int | None = None  # hot rows per request per layer; default 2 * index_topk
    offload_only: bool = False  # baseline: bring the whole request back each step
    host_pool_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.host_pool_gib <= 0:
            raise ValueError("hisparse host_pool_gib must be > 0")
        if self.device_buffer_size is not None and self.device_buffer_size < 1:
            raise ValueError("hisparse device_buffer_size must be >= 1")
        if self.host_pool_blocks is not None and self.host_pool_blocks < 1:
            raise ValueError("hisparse host_pool_blocks must be >= 1")

    @classmethod
    def from_dict(cls, d: dict | None) -> HiSparseConfig | None:
        if d is None:
            return None
        unknown = set(d) - {"host_pool_gib", "device_buffer_size", "offload_only", "host_pool_blocks"}
        if unknown:
            raise ValueError(f"unknown hisparse keys: {sorted(unknown)} (known: host_pool_gib, device_buffer_size, "
                             "offload_only, host_pool_blocks)")
        return cls(**d)


@dataclass(frozen=True)
class GraphConfig:
    """The decode step's static-buffer path and CUDA graphs (vLLM's capture-size convention).

    Decode batches are padded to the next capture size (`capture_sizes`) and run from buffers
    allocated once; on CUDA each size is captured once, at start-up, as a CUDA graph and replayed.
    enforce_eager None (the default): graphs on CUDA (as in vLLM), the plain eager path on the CPU;
    False: the padded static path on every device, run eagerly on the CPU (what the CPU tests compare);
    True: eager everywhere (`--enforce-eager`). HiSparse decode is padded and captured like the rest (timed
    against its unpadded path: 1.45-1.6x faster a step; docs/hisparse.md, "Under CUDA graphs")."""

    enforce_eager: bool | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, then every 8 up to max_num_seqs

    def __post_init__(self) -> None:
        if self.cuda_graph_sizes is not None:
            sizes = tuple(self.cuda_graph_sizes)
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise ValueError(f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        """Batch sizes (requests) a decode step is padded to, ascending, none above max_num_seqs."""
        if self.cuda_graph_sizes is not None:
            sizes = [n for n in self.cuda_graph_sizes if n <= max_num_seqs]
            return sizes or [min(self.cuda_graph_sizes)]
        sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
        if not sizes or sizes[-1] < max_num_seqs:
            sizes.append(max_num_seqs)  # the largest batch the scheduler forms always has a bucket
        return sizes

    @property
    def capture_hisparse(self) -> bool:
        return self.enforce_eager is not True

    def use_static_path(self, device: str) -> bool:
        if self.enforce_eager is None:
            return torch.device(device).type == "cuda"
        return not self.enforce_eager


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    hisparse: HiSparseConfig | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    attention_backend: str | None = None  # None: torch on CPU, triton on CUDA
    load_format: str = "auto"  # "dummy": random weights of the checkpoint's shape (benchmarks)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    warmup: bool = False  # engine/core/warmup.py before the first request (AsyncEngine)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hisparse is not None and self.parallel.prefill_context_parallel_size > 1:
            raise ValueError("hisparse runs on single-rank decode engines and DP ranks: drop it or the context "
                             "parallel sizes")
        if self.speculative is not None and not self.model.has_mtp:
            raise ValueError("speculative decoding with MTP needs a checkpoint with an MTP layer")
        if self.speculative is not None and not self.cache.mtp_kv:
            raise ValueError("speculative decoding needs the MTP layer's KV: drop --no-mtp-kv")
        pc = self.parallel
        if self.scheduler.async_scheduling and pc.world_size > 1 and pc.data_parallel_size != pc.world_size:
            raise ValueError("async_scheduling runs single-rank engines and DP groups: drop --async-scheduling or "
                             "the context parallel sizes")
        if pc.enable_expert_parallel and pc.world_size > 1 and self.model.n_routed_experts % pc.world_size:
            what = "--data-parallel-size" if pc.data_parallel_size > 1 else "the number of ranks"
            raise ValueError(f"expert parallelism over {pc.world_size} ranks needs n_routed_experts "
                             f"({self.model.n_routed_experts}) divisible by {what} ({pc.world_size})")
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ValueError(f"max_model_len {self.scheduler.max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.model.max_position_embeddings}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def checkpoint(self) -> Path | None:
        """Where weights load from (None with load_format='dummy')."""
        return self.model_path if self.load_format == "auto" else None

    @property
    def with_mtp(self) -> bool:
        """Whether engines build the MTP layer and keep its KV (the last layer of the cache)."""
        return self.model.has_mtp and self.cache.mtp_kv

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0
