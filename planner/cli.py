"""`pdserve plan`: KV bytes, capacity and roofline of a model on a deployment (table or --json).

    pdserve plan                                      # glm-5.3 on the reference PCP8 x DCP8 + DP8 H200 nodes
    pdserve plan --model path/to/config.json --gpus 8 --tp 8 --pcp 1 --dcp 1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from engine.config.model_config import ConfigError, ModelConfig
from engine.config.presets import PRESETS, preset
from planner.capacity import Deployment, capacity, kv_spec
from planner.roofline import prefill_split, roofline
from planner.table import format_plan

DEFAULT_CONTEXTS = (8192, 32768, 131072, 262144, 524288, 1048576)


def load_model(spec: str) -> ModelConfig:
    if spec in PRESETS:
        return preset(spec)
    if Path(spec).exists():
        return ModelConfig.from_pretrained(spec)
    raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json path")


def build_parser() -> argparse.ArgumentParser:
    d = Deployment()
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm-5.3", help="preset name or config.json (file or folder)")
    p.add_argument("--gpus", type=int, default=d.gpus, help="ranks of the prefill engine (= PCP x TP)")
    p.add_argument("--pcp", type=int, default=d.pcp, help="prefill context parallel size")
    p.add_argument("--dcp", type=int, default=d.dcp, help="decode context parallel size (KV split)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor parallel size of the prefill engine")
    p.add_argument("--dp", type=int, default=d.dp, help="decode DP ranks, one GPU each, EP across them")
    p.add_argument("--cp-kv-cache-interleave-size", dest="cp_interleave", type=int, default=d.cp_interleave)
    p.add_argument("--hbm-gib", type=float, default=d.hbm_gib, help="HBM per GPU")
    p.add_argument("--host-gib", type=float, default=d.host_gib, help="host memory per GPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--reserve-gib", type=float, default=d.reserve_gib, help="activations, graphs, comm buffers")
    p.add_argument("--kv-gib", type=float, help="KV budget per GPU (overrides HBM - weights - reserve)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=("fp8_ds_mla", "bfloat16", "float32"))
    p.add_argument("--indexer-precision", default=d.indexer_precision, choices=("fp8", "fp32"))
    p.add_argument("--weight-dtype", default=d.weight_dtype, choices=("fp8", "bf16"))
    p.add_argument("--hisparse-pool-gib", type=float, default=d.hisparse_pool_gib, help="per decode rank; 0 = off")
    p.add_argument("--hisparse-device-rows", type=int, help="hot rows per layer (default 2 * top-k + 1)")
    p.add_argument("--kv-offloading-gib", type=float, default=d.kv_offloading_gib, help="prefill host KV tier")
    p.add_argument("--decode-kv-offloading-gib", type=float, default=d.decode_kv_offloading_gib,
                   help="each decode rank's --kv-offloading-size (host memory beside the HiSparse pool)")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out (weights, KV, FLOPs)")
    p.add_argument("--contexts", help="comma-separated context lengths for the tables")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H200: 989)")
    p.add_argument("--gpu-tbps", type=float, default=4.8, help="HBM TB/s of one GPU (H200: 4.8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def deployment(args: argparse.Namespace) -> Deployment:
    return Deployment(gpus=args.gpus, pcp=args.pcp, dcp=args.dcp, tp=args.tp, dp=args.dp,
                      cp_interleave=args.cp_interleave, hbm_gib=args.hbm_gib, host_gib=args.host_gib,
                      gpu_memory_utilization=args.gpu_memory_utilization, reserve_gib=args.reserve_gib,
                      kv_gib=args.kv_gib, kv_cache_dtype=args.kv_cache_dtype,
                      indexer_precision=args.indexer_precision, weight_dtype=args.weight_dtype,
                      hisparse_pool_gib=args.hisparse_pool_gib, hisparse_device_rows=args.hisparse_device_rows,
                      kv_offloading_gib=args.kv_offloading_gib,
                      decode_kv_offloading_gib=args.decode_kv_offloading_gib, with_mtp=not args.no_mtp)


def contexts_of(args: argparse.Namespace, cfg: ModelConfig) -> list[int]:
    if args.contexts:
        try:
            values = [int(x) for x in args.contexts.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--contexts takes comma-separated integers, got {args.contexts!r}") from None
        if not values or min(values) < 1:
            raise ValueError("--contexts must be positive")
        return values
    return [c for c in DEFAULT_CONTEXTS if c <= cfg.max_position_embeddings] or [cfg.max_position_embeddings]


def make_plan(cfg: ModelConfig, dep: Deployment, contexts: list[int], *, flops_per_s: float,
              bytes_per_s: float, model_name: str = "") -> dict:
    spec = kv_spec(cfg, dep)
    return {"model": {"name": model_name, "num_hidden_layers": cfg.num_hidden_layers,
                      "num_attention_heads": cfg.num_attention_heads, "index_topk": cfg.index_topk,
                      "mla_cache_layers": spec.num_mla_layers, "index_cache_layers": spec.num_index_layers,
                      "mla_row_bytes": spec.mla_row * spec.mla_torch_dtype.itemsize,
                      "index_row_bytes": spec.index_row * spec.index_torch_dtype.itemsize},
            "deployment": asdict(dep), **capacity(cfg, dep, contexts),
            "roofline": roofline(cfg, spec, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, n=dep.gpus),
            "prefill_flops": prefill_split(cfg, spec, contexts, with_mtp=dep.with_mtp, n=dep.gpus)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_model(args.model)
        dep = deployment(args)
        plan = make_plan(cfg, dep, contexts_of(args, cfg), flops_per_s=args.gpu_tflops * 1e12,
                         bytes_per_s=args.gpu_tbps * 1e12, model_name=args.model)
    except (ValueError, ConfigError) as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
