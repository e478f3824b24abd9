"""One GPU standing in for one rank of the real deployment (benchmark only): one EP8 rank's share of the
full GLM-5.3 in FP8 with random weights, the KV that the rest of the memory holds, a long prefill and
decode steps with MTP3.

    python -m bench.prefill.standin --out standin.json [--prefill-tokens 32768] [--batches 1,16,64]
                                    [--weight-dtype fp8|bf16] [--set num_hidden_layers=8 ...]
                                    [--prefill-repeats 2]

The rank holds every attention, indexer, dense and MTP weight and 32 of the 256 routed experts (experts
[0, 32)). Routing is remapped so the local experts get the load they would get under balanced EP8: each
token's top-8 global ids are folded onto the local 32 (id mod 32), so a step's T tokens bring 8T
assignments to 32 experts, as T tokens on each of 8 ranks would bring to every rank. MTP3 runs with the
reference's synthetic acceptance length (2.99): random weights accept nothing on their own.

Reports weight bytes by dtype, the KV tokens that fit at `gpu_memory_utilization`, the prefill time and the
median decode step time per batch size. bf16 does not fit with all 78 layers: pass fewer layers
(`--set num_hidden_layers=...`) for the same run's bf16 figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.config.arg_utils import EngineArgs
from engine.config.presets import preset
from engine.core.core import EngineCore
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.loading.loader import build_model, dummy_init
from engine.loading.weight_stats import weight_bytes_by_dtype
from engine.model.moe import MoE
from engine.runner.model_runner import ModelRunner

EP = 8


class LocalLoad:
    """`MoE.dispatcher` for the stand-in: every assignment goes to a local expert (global id mod local)."""

    def __call__(self, x, weights, ids, experts):
        n = experts.w13.shape[0]
        return experts(x, weights, experts.offset + ids % n)


def build_rank_model(cfg):
    """One EP8 rank's model of `cfg` (an EngineConfig): every weight but the routed experts, 32 of 256 of
    those, random, routing folded onto them (LocalLoad)."""
    mc = cfg.model
    model = build_model(mc, device=torch.device(cfg.device), dtype=cfg.torch_dtype, with_mtp=True,
                        expert_shard=(0, mc.n_routed_experts // EP))
    dummy_init(model, cfg.seed)
    for m in model.modules():
        if isinstance(m, MoE):
            m.dispatcher = LocalLoad()
    return model


def rank_config_dir(tmp: Path, preset_name: str = "glm-5.3", weight_dtype: str = "fp8", **overrides) -> Path:
    """A config.json of the preset (FP8 block-scaled weights unless weight_dtype is bf16) in `tmp`."""
    cfg = preset(preset_name, **overrides)
    if weight_dtype == "fp8":
        cfg = dataclasses.replace(cfg, quantization="fp8", weight_block_size=(128, 128))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return tmp


def _engine(a, model_dir: Path, model=None, **engine_kw) -> tuple[EngineCore, dict]:
    """The stand-in engine; `model` reuses an already built rank model (another engine over the same
    weights), `engine_kw` are further EngineArgs (graphs, HiSparse)."""
    args = EngineArgs(model=str(model_dir), device=a.device, load_format="dummy", kv_cache_dtype=a.kv_cache_dtype,
                      gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.prefill_tokens + 1024,
                      max_num_batched_tokens=a.chunk, max_num_seqs=max(a.batches),
                      speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                          "synthetic_acceptance_length": 2.99},
                      num_blocks=a.num_blocks, **engine_kw)
    cfg = args.create_engine_config()
    n_local = cfg.model.n_routed_experts // EP
    model = model if model is not None else build_rank_model(cfg)
    core = EngineCore(cfg, runner_factory=lambda c: ModelRunner(c, model=model))
    info = {"weight_bytes": weight_bytes_by_dtype(model), "num_local_experts": n_local,
            "kv_blocks": core.kv.num_blocks, "kv_tokens": core.kv.num_blocks * cfg.cache.block_size}
    return core, info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ids(core: EngineCore, n: int, seed: int) -> list[int]:
    vocab = core.cfg.model.vocab_size
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_prefill(core: EngineCore, n: int, device: str, seed: int = 0) -> float:
    ids = _ids(core, n, seed)  # a new seed per run: no prefix-cache hits between runs
    core.add_request(Request(f"prefill-{seed}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                    ignore_eos=True)))
    _sync(device)
    t0 = time.perf_counter()
    while core.has_unfinished():
        core.step()
    _sync(device)
    return time.perf_counter() - t0


def _run_decode(core: EngineCore, batch: int, steps: int, device: str) -> float:
    """Median step time once all `batch` requests are decoding (prompts of 256 tokens)."""
    for i in range(batch):
        ids = _ids(core, 256, 1000 * batch + i)
        core.add_request(Request(f"d{batch}-{i}", ids, SamplingParams(max_tokens=10 * steps + 64, temperature=0.0,
                                                                       ignore_eos=True)))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        core.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    for i in range(batch):
        core.abort(f"d{batch}-{i}")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="glm-5.3")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (JSON value)")
    p.add_argument("--weight-dtype", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: what the memory holds)")
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64])
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--prefill-repeats", type=int, default=0,
                   help="warm prefills after the first (cold) one, new tokens each; their median is reported")
    a = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in a.set)}
    with tempfile.TemporaryDirectory() as tmp:
        core, info = _engine(a, rank_config_dir(Path(tmp), a.preset, a.weight_dtype, **overrides))
    res = {"preset": a.preset, "overrides": overrides, "weight_dtype": a.weight_dtype, "device": a.device, **info,
           "weight_gib": sum(info["weight_bytes"].values()) / 2**30,
           "kv_gib": info["kv_blocks"] * core.runner.spec.block_bytes / 2**30}
    res["prefill_s"] = _run_prefill(core, a.prefill_tokens, a.device)
    if a.prefill_repeats:
        res["prefill_warm_s"] = [_run_prefill(core, a.prefill_tokens, a.device, 1 + i)
                                 for i in range(a.prefill_repeats)]
        res["prefill_warm_median_s"] = statistics.median(res["prefill_warm_s"])
    res["decode_step_s"] = {b: _run_decode(core, b, a.decode_steps, a.device) for b in a.batches}
    st = core.stats()
    res["spec_mean_acceptance_length"] = st.spec_mean_acceptance_length
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
