"""`python -m bench.decode_dp`: one rank of the reference DP8×EP8 decode group on one GPU, beside the single-rank
stand-in of the same weights, from the same run.

    python -m bench.decode_dp --batches 1,16,64 --prompt-lens 256,1900 --out dp.json             # H200: 78 layers
    python -m bench.decode_dp --layers 40 --batches 1,16,64 --prompt-lens 256,1900 --out dp.json # H100 (80 GB)

Both engines hold one EP8 rank's share of GLM-5.3 in FP8 (random weights, bench/prefill/standin.py: every
attention, indexer, dense and MTP weight, 32 of the 256 routed experts), MTP3 with the synthetic acceptance
length 2.99, whole-step CUDA graphs, async scheduling. They differ in what a MoE layer does:

    stand-in    every assignment folded onto the 32 local experts (global id mod 32): the load balanced EP8
                gives a rank, with no dispatch at all
    emulated    the group's own step code (engine/parallel/dp_runner.py, engine/parallel/ep.py): every step
                planned, the static dispatch in every MoE layer of every pass (rows sent in FP8: the experts are FP8),
                inside the captured step,
                over the loopback transport (engine/parallel/loopback.py): the [8 · T, W] gather buffer and
                the [8 · T, H] partials are written and read at their real sizes, the experts run over all
                8 · T rows with the ghost ranks' assignments moved onto the local experts (T · 8 assignments
                per pass, as on a real rank), the partials are summed in rank order; no host sync

What the emulation does not contain is the wire: the NVLink time of the real all-gather and all-to-all.
It is modelled per step from the bytes each rank sends and the number of collectives:

    wire = collectives · alpha + bytes sent / beta        (--alpha-us, --nvlink-gbs; both recorded)

and reported beside the measured step (`wire_ms`, `predicted_ms` = measured + wire, no overlap assumed).
Each row also gives the bytes one rank sends per step with the static dispatch and what the dynamic
dispatcher would send for the same real rows (one copy per (token, remote rank) under uniform routing:
(1 - (1 - 1/8)^8) of the 7 other ranks per token, plus the counts exchange).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_step import run_modes
from bench.kernels.timing import ceilings
from bench.prefill import standin
from engine.model.moe import MoE
from engine.parallel.ep import static_dispatch_bytes
from engine.parallel.loopback import emulated_rank_core

WORLD = 8
# default wire model: NVLink 4 on H100/H200 moves 450 GB/s per direction per GPU (NVIDIA's H100/H200 SXM
# specifications: 900 GB/s bidirectional); NCCL's small-message collectives on one NVSwitch node take on the
# order of 10-20 us each (nccl-tests' latency-bound sizes); the low end is taken by default and both are flags.
ALPHA_US = 15.0
NVLINK_GBS = 450.0


def moe_layers(model) -> tuple[int, int]:
    """(MoE layers of the target pass, MoE layers of one MTP pass)."""
    main = sum(isinstance(m, MoE) for m in model.model.modules())
    mtp = sum(isinstance(m, MoE) for m in model.mtp.modules()) if model.mtp is not None else 0
    return main, mtp


def step_comm(batch: int, sizes: list[int], k: int, hidden: int, top_k: int, layers: tuple[int, int],
              alpha_us: float, nvlink_gbs: float, fp8: bool = False) -> dict:
    """One planned step's collectives and bytes per rank (static; `fp8`: rows dispatched as FP8 codes and
    scales), the dynamic dispatcher's bytes (bf16 rows) for the same real rows, and the modelled wire time."""
    bucket = next(s for s in sizes if s >= batch)
    main, mtp = layers
    R = 1 + k
    passes = [(bucket * R, main), (bucket * R, mtp)] + [(bucket, mtp)] * (k - 1)  # (rows, MoE layers)
    real = [(batch * R, main), (batch * R, mtp)] + [(batch, mtp)] * (k - 1)
    static = sum(sum(static_dispatch_bytes(rows, hidden, top_k, WORLD, fp8=fp8).values()) * n for rows, n in passes)
    collectives = sum(2 * n for _, n in passes)
    remote = (WORLD - 1) * (1 - (1 - 1 / WORLD) ** top_k)  # expected remote ranks a token visits
    row_out, row_back = hidden * 2 + 8 * top_k, hidden * 2
    dynamic = sum(n * (rows * remote * (row_out + row_back) + WORLD * 8) for rows, n in real)
    wire_s = collectives * alpha_us * 1e-6 + static / (nvlink_gbs * 1e9)
    return {"bucket": bucket, "collectives": collectives, "static_bytes_sent": static,
            "dynamic_bytes_sent": dynamic, "wire_ms": 1e3 * wire_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-lens", default="256,1900")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: GLM-5.3's 78)")
    p.add_argument("--modes", default="graphs,async")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--top-kernels", type=int, default=0, metavar="N", help="the N heaviest kernels of each row")
    p.add_argument("--alpha-us", type=float, default=ALPHA_US, help="modelled latency of one collective (us)")
    p.add_argument("--nvlink-gbs", type=float, default=NVLINK_GBS, help="modelled NVLink bandwidth per direction")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [int(n) for n in a.prompt_lens.split(",")]
    modes = a.modes.split(",")
    device = "cuda"
    ceil = ceilings(torch.device(device))
    print(f"copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    ta = argparse.Namespace(steps=a.steps, warmup=a.warmup, profile_steps=a.profile_steps, temperature=0.0,
                            top_p=1.0, seeded=False, top_kernels=a.top_kernels, prompt_len=prompts[0])
    sa = argparse.Namespace(device=device, kv_cache_dtype="fp8_ds_mla", gpu_memory_utilization=0.9,
                            prefill_tokens=max(prompts) + 64 * a.steps, chunk=8192, batches=batches,
                            num_blocks=a.num_blocks)
    overrides = {"num_hidden_layers": a.layers} if a.layers else {}
    rows, info = [], {}

    def dump(**more):  # after every engine and prompt: a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps({"ceilings": ceil, "info": info, "rows": rows, **more}, indent=1,
                                              default=str))
    with tempfile.TemporaryDirectory() as tmp:
        path = standin.rank_config_dir(Path(tmp), **overrides)
        t0 = time.perf_counter()
        core, info = standin._engine(sa, path, enforce_eager=False, cuda_graph_sizes=batches)
        info["build_s"] = time.perf_counter() - t0
        cfg, model = core.cfg, core.runner.model
        for n in prompts:
            ta.prompt_len = n
            rows += [dict(r, prompt_len=n) for r in run_modes(core, modes, batches, ta, ceil, "standin")]
            dump()
        del core
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        core = emulated_rank_core(cfg, WORLD, model=model)  # the same weights; the dispatchers replaced
        info["emulated_build_s"] = time.perf_counter() - t0
        info["emulated_whole_step_graphs"] = core.runner.device_decode.step_graphs.num_captures
        for n in prompts:
            ta.prompt_len = n
            rows += [dict(r, prompt_len=n) for r in run_modes(core, modes, batches, ta, ceil, "emulated")]
            dump()
        info["emulated_dp_stats"] = core.runner.dp_stats()
        layers = moe_layers(model)
        mc = cfg.model
        fp8 = next(m for m in model.modules() if isinstance(m, MoE)).experts.takes_fp8_rows  # FP8 dispatch
    k = cfg.num_spec_tokens
    sizes = cfg.graphs.capture_sizes(cfg.scheduler.max_num_seqs)
    summary = []
    for n in prompts:
        for mode in modes:
            for b in batches:
                s = next(r for r in rows if r["engine"] == "standin" and r["mode"] == mode and r["batch"] == b
                         and r["prompt_len"] == n)
                e = next(r for r in rows if r["engine"] == "emulated" and r["mode"] == mode and r["batch"] == b
                         and r["prompt_len"] == n)
                comm = step_comm(b, sizes, k, mc.hidden_size, mc.num_experts_per_tok, layers, a.alpha_us,
                                 a.nvlink_gbs, fp8=fp8)
                row = {"prompt_len": n, "mode": mode, "batch": b, "standin_ms": s["wall_ms"],
                       "emulated_ms": e["wall_ms"], "emulated_over_standin": e["wall_ms"] / s["wall_ms"],
                       "standin_busy_ms": s.get("busy_ms"), "emulated_busy_ms": e.get("busy_ms"),
                       "emulated_wall_over_busy": e.get("wall_over_busy"), "floor_ms": e.get("floor_ms"), **comm}
                row["predicted_ms"] = e["wall_ms"] + comm["wire_ms"]
                row["predicted_over_standin"] = row["predicted_ms"] / s["wall_ms"]
                summary.append(row)
                print(f"prompt {n:5d} {mode:6s} B={b:3d}  stand-in {s['wall_ms']:7.2f} ms  emulated "
                      f"{e['wall_ms']:7.2f} ms ({row['emulated_over_standin']:.3f}x, wall/busy "
                      f"{row['emulated_wall_over_busy'] or float('nan'):.2f})  + wire {comm['wire_ms']:.2f} ms "
                      f"= {row['predicted_ms']:.2f} ({row['predicted_over_standin']:.3f}x)  bytes/step static "
                      f"{comm['static_bytes_sent'] / 2**20:.1f} MiB, dynamic "
                      f"{comm['dynamic_bytes_sent'] / 2**20:.1f} MiB",
                      flush=True)
    result = {"ceilings": ceil, "info": info, "layers": a.layers or mc.num_hidden_layers, "moe_layers": layers,
              "fp8_dispatch": fp8,
              "wire_model": {"alpha_us": a.alpha_us, "nvlink_gbs": a.nvlink_gbs}, "summary": summary, "rows": rows,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    dump(**result)
    return result


if __name__ == "__main__":
    main()
