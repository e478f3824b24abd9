"""EngineArgs: the user-facing knobs (vLLM's names: docs/conventions.md) -> a validated EngineConfig.

Used by the offline `LLM`, the services' command lines and the benchmarks, so a flag means the same
thing everywhere. The reference prefill launch line works as is:
  --prefill-context-parallel-size 8 --decode-context-parallel-size 8 --dcp-comm-backend ag_rs
  --enable-expert-parallel --attention-config '{"sparse_mla_force_mqa":true}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from engine.config.engine import (
    INDEXER_PRECISIONS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    GraphConfig,
    HiSparseConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_offloading_size,
)
from engine.config.model_config import ModelConfig


@dataclass
class EngineArgs:
    model: str
    device: str | None = None  # None: cuda when available
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"  # auto: the model dtype; or fp8_ds_mla / bfloat16 / float32
    indexer_precision: str | None = None  # None: fp8 with an fp8 cache, else fp32
    seed: int = 0
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    block_size: int = 64
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None  # GiB of host KV tier behind the device pool (None: none)
    mtp_kv: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    num_speculative_tokens: int | None = None
    speculative_config: dict | None = None
    hisparse: dict | None = None
    attention_config: dict | None = None
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    data_parallel_size: int = 1
    ep_decode_dispatch: str = "static"
    attention_backend: str | None = None
    load_format: str = "auto"
    quantization: str | None = None  # "fp8": quantize a bf16 checkpoint's projections at load (block FP8)
    enforce_eager: bool | None = None  # None: CUDA graphs on CUDA, eager on the CPU; see GraphConfig
    cuda_graph_sizes: list[int] | None = None
    warmup: bool = False  # step through the batch shapes a server meets before it serves (engine/core/warmup.py)
    extra: dict[str, Any] = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        model_path = Path(self.model)
        mcfg = self._quantized(ModelConfig.from_pretrained(model_path))
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        kv_dtype = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        if kv_dtype == "float16":
            raise ValueError("kv_cache_dtype float16 is not supported; use fp8_ds_mla, bfloat16 or float32")
        indexer = self.indexer_precision or ("fp8" if kv_dtype == "fp8_ds_mla" else "fp32")
        max_len = self.max_model_len or mcfg.max_position_embeddings
        attn = dict(self.attention_config or {})
        hisparse = self.hisparse if self.hisparse is not None else attn.pop("hisparse_config", None)
        attn.pop("sparse_mla_force_mqa", None)  # we always run the absorbed (MQA) form over the cache
        if attn:
            raise ValueError(f"unknown attention_config keys: {sorted(attn)}")
        return EngineConfig(
            model_path=model_path, model=mcfg,
            cache=CacheConfig(block_size=self.block_size, kv_cache_dtype=kv_dtype, indexer_precision=indexer,
                              num_blocks=self.num_blocks, gpu_memory_utilization=self.gpu_memory_utilization,
                              cpu_kv_cache_gib=self.cpu_kv_cache_gib, enable_prefix_caching=self.enable_prefix_caching,
                              mtp_kv=self.mtp_kv, kv_offloading_size=self.kv_offloading_size),
            scheduler=SchedulerConfig(max_model_len=max_len,
                                      max_num_batched_tokens=self.max_num_batched_tokens or max(8192, 1),
                                      max_num_seqs=self.max_num_seqs,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      async_scheduling=self.async_scheduling),
            parallel=ParallelConfig(prefill_context_parallel_size=self.prefill_context_parallel_size,
                                    decode_context_parallel_size=self.decode_context_parallel_size,
                                    enable_expert_parallel=self.enable_expert_parallel,
                                    dcp_comm_backend=self.dcp_comm_backend,
                                    cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
                                    data_parallel_size=self.data_parallel_size,
                                    ep_decode_dispatch=self.ep_decode_dispatch),
            speculative=self._speculative(),
            hisparse=HiSparseConfig.from_dict(hisparse) if hisparse is not None else None,
            device=device, dtype=dtype, seed=self.seed, attention_backend=self.attention_backend,
            load_format=self.load_format, warmup=self.warmup,
            graphs=GraphConfig(enforce_eager=self.enforce_eager,
                               cuda_graph_sizes=tuple(self.cuda_graph_sizes) if self.cuda_graph_sizes else None))

    def _quantized(self, mcfg: ModelConfig) -> ModelConfig:
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or unset, got {self.quantization!r}")
        if self.quantization == "fp8" and mcfg.quantization != "fp8":
            return dataclasses.replace(mcfg, quantization="fp8", quantize_at_load=True, weight_block_size=(128, 128))
        return mcfg

    def _speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config:
            return SpeculativeConfig.from_dict(self.speculative_config)
        if self.num_speculative_tokens:
            return SpeculativeConfig(num_speculative_tokens=self.num_speculative_tokens)
        return None

    # ---- command line --------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = p.add_argument_group("engine")
        g.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
        g.add_argument("--device", default=None)
        g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
        add_kv_layout_args(g, resolve_auto=True)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (else from memory)")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--kv-offloading-size", type=gib_size, default=None, metavar="GIB",
                       help="host memory (GiB) for a KV offload tier: prefix-cached blocks evicted from the device "
                            "pool are kept there and loaded back on a prefix hit (pinned on CUDA); the total of "
                            "a CP engine's ranks, per DP rank")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--async-scheduling", action="store_true",
                       help="plan the next step while the current one runs on the GPU; its tokens are read back "
                            "after the next step is launched (single-rank engines and DP groups)")
        g.add_argument("--warmup", action="store_true",
                       help="before serving, step once through the batch shapes a server meets (every prefill token "
                            "count class up to one step's budget, with and without a cached prefix, every decode "
                            "batch-size class) so that kernels compile then, not under traffic; the requests and "
                            "their KV are forgotten (engine/core/warmup.py)")
        g.add_argument("--speculative-config", type=json.loads, default=None)
        g.add_argument("--attention-config", type=json.loads, default=None)
        g.add_argument("--hisparse-config", dest="hisparse", type=json.loads, default=None,
                       help='hybrid HiSparse for decode, e.g. {"host_pool_gib": 48} (same as attention-config '
                            'hisparse_config)')
        g.add_argument("--prefill-context-parallel-size", type=int, default=1)
        g.add_argument("--decode-context-parallel-size", type=int, default=1)
        g.add_argument("--enable-expert-parallel", action="store_true")
        g.add_argument("--dcp-comm-backend", default="ag_rs", choices=["ag_rs", "a2a"])
        g.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)
        g.add_argument("--data-parallel-size", type=int, default=1)
        g.add_argument("--ep-decode-dispatch", default="static", choices=["static", "dynamic"],
                       help="DP x EP decode steps: static (planned fixed-shape passes, captured on CUDA) or dynamic "
                            "(all-to-alls sized by exchanged counts, eager; every prompt step is dynamic)")
        g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
        g.add_argument("--quantization", default=None, choices=["fp8"],
                       help="fp8: quantize a bf16 checkpoint to FP8 block-scaled weights at load (an FP8 checkpoint "
                            "is served in FP8 without it)")
        g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights of the config's shape (benchmarks without a checkpoint)")
        g.add_argument("--enforce-eager", action="store_true", default=None,
                       help="decode without the padded static-buffer path and CUDA graphs")
        g.add_argument("--cuda-graphs", dest="enforce_eager", action="store_false",
                       help="decode through the padded static-buffer path, captured as CUDA graphs on CUDA (the "
                            "default there; on the CPU the same padded forwards run eagerly)")
        g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                       help="decode batch sizes to pad to and capture (default 1 2 4 8 16 24 ... max-num-seqs)")
        return p

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def gib_size(text: str) -> float:
    """argparse type of --kv-offloading-size: a finite number of GiB >= 0."""
    try:
        value = float(text)
        check_offloading_size(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size in GiB (a finite number >= 0, 0 = off), got {text!r}") from None
    return value


def add_kv_layout_args(g, resolve_auto: bool) -> None:
    """The flags that fix a KV block's layout, declared once for the engines (EngineArgs) and the kvstore,
    whose blocks must match theirs byte for byte. `resolve_auto`: an engine may take "auto" / no indexer
    precision and resolve them from its device; the kvstore, which has no model on a device, gets the
    served layout (fp8_ds_mla, fp8 indexer keys) as defaults instead."""
    g.add_argument("--kv-cache-dtype", default="auto" if resolve_auto else "fp8_ds_mla",
                   choices=(("auto",) if resolve_auto else ()) + KV_CACHE_DTYPES)
    g.add_argument("--indexer-precision", default=None if resolve_auto else "fp8", choices=INDEXER_PRECISIONS)
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument("--mtp-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="keep/compute the MTP layer's KV (default on when the model has one)")
