"""`python -m bench.decode_step`: the engine's decode step, eager against the padded static path (CUDA
graphs on CUDA), with the GPU's busy time and the step's memory floor beside the wall time.

    python -m bench.decode_step --model checkpoints/tiny-code --batches 1,16,64 --spec 3 --out decode.json
    python -m bench.decode_step --random-model 4 --batches 1,16,64 --spec 3        # GLM-5.3 widths, 4 layers
    python -m bench.decode_step --standin --batches 1,16,64 --out standin.json    # one EP8 rank, FP8, MTP3
    ... --hisparse-pool-gib 16    # also a HiSparse engine (padded and captured: the benchmark asks for graphs)
    ... --temperature 0.8 --top-p 0.95 --seeded    # sampled requests instead of greedy ones
    ... --per-forward-graphs --modes graphs,async --top-kernels 25   # no whole-step graphs; the heaviest kernels
    python -m bench.decode_step --standin --roofline-only 4.27,679 --contexts 320,4096 --batches 1,16,64  # CPU
    ... --standin-layers 36 --switch-variants none,fused_activation+norm_quant+absorbed_in_place  # A/B, 80 GB card

One engine per model serves every mode, so the weights are built once: `eager` runs the plain path
(`runner.static` off), `graphs` the padded static path, captured on CUDA at start-up (on the CPU the
same padded forwards run eagerly), and with `--async-scheduling` also `async`: that path with the next
step launched before the last one's tokens are read (docs/async_scheduling.md). Per (mode, batch): B
greedy (or sampled) requests of `--prompt-len` tokens are prefilled, a few decode steps warm up, then each measured
`EngineCore.step()` is timed by wall clock between device synchronisations (median); `async` steps run
back to back instead, and a step's wall time is the measured steps' total over their number. The GPU's
busy time of a step is the union of its kernels' intervals under torch.profiler (median over
`--profile-steps` steps; `async`: one profile over them all, divided by their number). Each row also says how many
requests were decoding when the measured steps began and ended, how many waited and how many were preempted in
between: a batch the KV could not hold shows there. The memory floor is the bytes one
step must read at least (below) over the device-to-device copy bandwidth measured in the same run:

    weights   every parameter of the model but the embedding table, once per pass that uses it: the
              target pass (all layers), each MTP pass (the MTP layer and the shared head); routed
              experts counted at the expected share a pass touches, E * (1 - (1 - 1/E)^(rows * top-k))
              of E local experts
    KV        per request and attention layer of the target pass: min(context, top-k) MLA rows and the
              whole context's indexer keys (bytes per token of the engine's KV format)

The roofline floor (`roofline_ms`) counts compute too: each part at max(bytes / copy bandwidth, FLOPs / rate),
bf16 at the matmul rate measured in the same run and FP8 at twice it. With MTP3 at batch 64 the verify pass
has 256 rows, so its FP8 projections (512 FLOPs per weight byte) and, past 2,048 tokens of context, sparse MLA
(73 GFLOP a GLM-5.3 layer against 86 MB of KV rows) are compute-bound, which the memory floor does not see.

`--host-phases` instead times where a decode step's host time goes, on the static path, per batch: the
engine's own phase counters (`EngineCore.step_phase_seconds`: schedule, launch, device wait, read-back,
update, what the services export), inside the launch the input build (`StaticDecode.prepare` and the draft
passes' `next_rows`), the forwards (`StaticDecode.run`) and the logits, and the front end's output
processing after the step (detokenization, stop strings: `OutputProcessor.process`). Host = step + output
- device wait, less the forwards and logits on the CPU (there they are the device's work, computed):

    python -m bench.decode_step --host-phases --batches 1,32 --prompt-len 1024 --steps 10
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.mla import MLAttention
from engine.model.moe import MoE


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fill(core, batch: int, prompt_len: int, max_tokens: int, tag: str, a) -> list[str]:
    """B requests of random prompts (greedy, or sampled with `--temperature` / `--top-p`, each with its own
    seed under `--seeded`), stepped until every one of them decodes."""
    vocab = core.cfg.model.vocab_size
    g = torch.Generator().manual_seed(batch)
    rids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
    for i, r in enumerate(rids):
        sp = SamplingParams(max_tokens=max_tokens, temperature=a.temperature, top_p=a.top_p, ignore_eos=True,
                            seed=i if a.seeded else None)
        core.add_request(Request(r, torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), sp))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    return rids


def _decoding(core) -> int:
    """Running requests past their prompt (the batch a decode step serves)."""
    return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)


def busy_seconds(prof) -> float:
    """Union of the CUDA kernels' [start, end] intervals recorded by a torch.profiler session (s)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def kernel_totals(prof, steps: int) -> tuple[float, float]:
    """(CUDA kernels per step, their summed duration in ms per step) in a torch.profiler session."""
    ts = [(e.time_range.end - e.time_range.start) / 1e3 for e in prof.events()
          if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    return len(ts) / steps, sum(ts) / steps


def kernel_table(prof, steps: int, top: int) -> list[dict]:
    """The `top` CUDA kernels by total time in a torch.profiler session: name, launches and ms per step."""
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
            per.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"kernel": name[:120], "launches_per_step": len(ts) / steps, "ms_per_step": sum(ts) / steps}
            for name, ts in rows]


def time_steps(core, batch: int, a, tag: str) -> dict:
    prompt_len, steps, warmup, profile_steps = a.prompt_len, a.steps, a.warmup, a.profile_steps
    rids = _fill(core, batch, prompt_len, 12 * (warmup + steps + profile_steps + 4), tag, a)
    for _ in range(warmup):
        core.step()
    preempted0, decoding0 = core.scheduler.num_preemptions, _decoding(core)
    walls, tokens = [], 0
    if core.async_scheduling:  # a pipeline: one interval over the measured steps
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(o.new_token_ids) for o in core.step())
        _sync()
        walls = [(time.perf_counter() - t0) / steps] * steps
    for _ in range(0 if core.async_scheduling else steps):
        _sync()
        t0 = time.perf_counter()
        outs = core.step()
        _sync()
        walls.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outs)
    occupancy = {"decoding_requests": [decoding0, _decoding(core)], "waiting_requests": len(core.scheduler.waiting),
                 "preemptions": core.scheduler.num_preemptions - preempted0}  # a batch that did not hold says so
    busy, kernels, totals = [], [], []
    if torch.cuda.is_available() and profile_steps:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(1 if core.async_scheduling else profile_steps):
            n = profile_steps if core.async_scheduling else 1
            _sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    core.step()
                _sync()
            busy.append(busy_seconds(prof) / n)
            totals.append(kernel_totals(prof, n))
            if getattr(a, "top_kernels", 0) and not kernels:
                kernels = kernel_table(prof, n, a.top_kernels)
    for r in rids:
        core.abort(r)
    while core.has_unfinished():  # the step in flight too (async)
        core.step()
    core.step()
    wall = statistics.median(walls)
    row = {"batch": batch, "wall_ms": 1e3 * wall, "tokens_per_step": tokens / steps,
           "tok_s": tokens / sum(walls), **occupancy}
    if busy:
        row["busy_ms"] = 1e3 * statistics.median(busy)
        row["wall_over_busy"] = wall / statistics.median(busy)
    if kernels:
        row["kernels"] = kernels
    if totals:  # how many kernels a step runs, and their summed time (the busy union less their overlap)
        row["kernels_per_step"], row["kernel_ms_sum"] = totals[0]
    return row


# inside the launch: (label, functions timed inclusively; see bench.hisparse.host_timer)
LAUNCH_PARTS = (("inputs", ("engine.runner.static_decode:StaticDecode.prepare",
                            "engine.runner.static_decode:StaticDecode.next_rows")),
                ("forward", ("engine.runner.static_decode:StaticDecode.run",)),
                ("logits", ("engine.model.model:GlmDsaForCausalLM.compute_logits",)))


def host_phases(core, tokenizer, batch: int, prompt_len: int, steps: int, warmup: int, tag: str) -> dict:
    """Per decode step (ms, means over `steps`): the engine's phases, the launch's parts, the output processing
    and the host total (module docstring)."""
    from bench.hisparse.host_timer import HostTimer
    from engine.core.core import STEP_PHASES
    from engine.frontend.output_processor import OutputProcessor

    proc = OutputProcessor(tokenizer)
    rids = _fill(core, batch, prompt_len, 12 * (warmup + steps + 4), tag)
    for r in core.scheduler.running:
        proc.add(r)
    for _ in range(warmup):
        proc.process(core.step())
    timer = HostTimer()
    for _, targets in LAUNCH_PARTS:
        for t in targets:
            timer.wrap(t)
    before, tokens = dict(core.step_phase_seconds), 0
    _sync()
    t0 = time.perf_counter()
    timer.on = True
    try:
        for _ in range(steps):
            outs = core.step()
            tokens += sum(len(o.new_token_ids) for o in outs)
            t = time.perf_counter()
            proc.process(outs)
            timer.seconds["output"] = timer.seconds.get("output", 0.0) + time.perf_counter() - t
        _sync()
        wall = time.perf_counter() - t0
    finally:
        timer.on = False
        timer.restore()
    ms = {p: 1e3 * (core.step_phase_seconds[p] - before[p]) / steps for p in STEP_PHASES}
    for label, targets in LAUNCH_PARTS:
        ms[label] = 1e3 * sum(timer.seconds[t.split(":")[1]] for t in targets) / steps
    ms["output"] = 1e3 * timer.seconds["output"] / steps
    ms["step"] = sum(ms[p] for p in STEP_PHASES)
    device_work = ms["forward"] + ms["logits"] if core.runner.device.type == "cpu" else 0.0
    ms["host"] = ms["step"] + ms["output"] - ms["device_wait"] - device_work
    for r in rids:
        core.abort(r)
    while core.has_unfinished():
        core.step()
    core.step()
    return {"batch": batch, "wall_ms": 1e3 * wall / steps, "tokens_per_step": tokens / steps,
            "ms": {k: round(v, 3) for k, v in ms.items()}}


def _split_weights(module) -> tuple[list, list]:
    """(the parameters a pass reads whole: all but the embeddings and the routed experts, the routed experts)."""
    experts = [m.experts for m in module.modules() if isinstance(m, MoE)]
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    return [p for n, p in module.named_parameters() if "embed" not in n and id(p) not in expert_ids], experts


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _touched(experts, assignments: int) -> float:
    """Expected share of E local experts that `assignments` routed rows touch: 1 - (1 - 1/E)^assignments."""
    return 1 - (1 - 1 / experts.w13.shape[0]) ** assignments


def _kv_row_bytes(spec) -> tuple[int, int]:
    """Bytes of one token's MLA row and indexer key in the engine's KV format."""
    return (spec.mla_row * torch.empty((), dtype=spec.mla_torch_dtype).element_size(),
            spec.index_row * torch.empty((), dtype=spec.index_torch_dtype).element_size())


def floor_bytes(core, batch: int, context: int) -> dict:
    """The bytes one decode step reads at least (module docstring), by part."""
    runner, cfg = core.runner, core.cfg
    mc, k = cfg.model, cfg.num_spec_tokens
    model = runner.model
    rows = 1 + k

    def pass_bytes(module, rows_per_req: int) -> float:
        dense, experts = _split_weights(module)
        total = float(_nbytes(dense))
        for e in experts:
            total += _nbytes(e.parameters()) * _touched(e, batch * rows_per_req * mc.num_experts_per_tok)
        return total

    head = _nbytes(model.lm_head.parameters())
    target = pass_bytes(model.model, rows) + head
    mtp = (pass_bytes(model.mtp, rows) + head) * k if getattr(model, "mtp", None) is not None and k else 0.0
    spec = runner.spec
    mla_b, idx_b = _kv_row_bytes(spec)
    kv = batch * spec.num_mla_layers * (min(context, mc.index_topk) * mla_b + context * idx_b)
    return {"target_weights": target, "mtp_weights": mtp, "kv": float(kv), "total": target + mtp + kv}


def roofline_ms(core, batch: int, context: int, copy_tbps: float, bf16_tflops: float) -> dict:
    """A step's floor with compute counted too (module docstring): each part at max(bytes / copy bandwidth,
    FLOPs / rate), bf16 at the measured matmul rate, FP8 at twice it. Weights per pass and dtype (2 x rows
    FLOPs per element: the projections, the absorbed kv_b_proj, lm_head), the routed experts (2 x assignments
    FLOPs per expert element), and attention: sparse MLA over min(context, top-k) rows (2 x (R + P + R)
    FLOPs per head and row) and the indexer's scores over the context, against the KV bytes. The verify pass
    has batch x (1 + drafts) rows; each MTP pass is charged one row per request (a lower bound)."""
    runner, cfg = core.runner, core.cfg
    mc, k = cfg.model, cfg.num_spec_tokens
    model = runner.model
    rows = batch * (1 + k)
    bw, r16, r8 = copy_tbps * 1e12, bf16_tflops * 1e12, 2 * bf16_tflops * 1e12

    def weights(module, rows: int) -> float:
        dense, experts = _split_weights(module)
        t = 0.0
        for fp8 in (True, False):
            ps = [p for p in dense if (p.dtype == torch.float8_e4m3fn) == fp8]
            flops = sum(2 * rows * p.numel() for p in ps if p.dim() >= 2)
            t += max(_nbytes(ps) / bw, flops / (r8 if fp8 else r16))
        for e in experts:
            assignments = rows * mc.num_experts_per_tok
            elems = (e.w13.numel() + e.w2.numel()) / e.w13.shape[0]
            t += max(_nbytes(e.parameters()) * _touched(e, assignments) / bw,
                     2 * assignments * elems / (r8 if e.fp8 else r16))
        return t

    def attention(module, layers: int, rows: int) -> float:
        attn = [m for m in module.modules() if type(m).__name__ == "MLAttention"][:layers]
        mla_b, idx_b = _kv_row_bytes(runner.spec)
        n = min(context, mc.index_topk)
        R, P, H = mc.kv_lora_rank, mc.qk_rope_head_dim, mc.num_attention_heads
        flops = len(attn) * rows * H * n * 2 * (R + P + R)
        idx_flops = sum(a.indexer is not None for a in attn) * rows * mc.index_n_heads * mc.index_head_dim * 2 * context
        kv = len(attn) * batch * (n * mla_b + context * idx_b)
        return max(kv / bw, flops / r16 + idx_flops / r8)

    head = model.lm_head.weight

    def lm(rows: int) -> float:
        return max(head.numel() * head.element_size() / bw, 2 * rows * head.numel() / r16)

    parts = {"target_weights": weights(model.model, rows) + lm(rows),
             "target_attention": attention(model.model, 10**9, rows)}
    mtp = getattr(model, "mtp", None)  # its compute at one row per request (a lower bound), bytes as the memory floor
    parts["mtp"] = (weights(mtp, batch) + lm(batch) + attention(mtp, 1, batch)) * k if mtp is not None and k else 0.0
    out = {name: 1e3 * v for name, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def standin_roofline(batches: list[int], contexts: list[int], copy_tbps: float, bf16_tflops: float) -> list[dict]:
    """`roofline_ms` of the one-rank stand-in with no GPU: its model built on `meta` (the engine's own shapes and
    dtypes), for the ceilings a GPU run measured."""
    from types import SimpleNamespace

    from bench.prefill import standin
    from engine.config.arg_utils import EngineArgs
    from engine.kv.cache import KVCacheSpec
    from engine.loading.loader import build_model

    with tempfile.TemporaryDirectory() as tmp:
        args = EngineArgs(model=str(standin.rank_config_dir(Path(tmp))), device="cpu", load_format="dummy",
                          kv_cache_dtype="fp8_ds_mla", num_blocks=16, max_num_seqs=max(batches),
                          speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        cfg = args.create_engine_config()
    mc = cfg.model
    model = build_model(mc, device=torch.device("meta"), dtype=torch.bfloat16, with_mtp=True,
                        expert_shard=(0, mc.n_routed_experts // standin.EP))
    spec = KVCacheSpec.from_model(mc, block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                  indexer_precision=cfg.cache.indexer_precision, with_mtp=True)
    core = SimpleNamespace(runner=SimpleNamespace(model=model, spec=spec), cfg=cfg)
    out = []
    for b in batches:
        for ctx in contexts:
            r = {"batch": b, "context": ctx, "roofline_ms": roofline_ms(core, b, ctx, copy_tbps, bf16_tflops),
                 "floor_ms": 1e3 * floor_bytes(core, b, ctx)["total"] / (copy_tbps * 1e12)}
            print(f"B={b:3d} context {ctx:7d}  memory floor {r['floor_ms']:7.2f} ms  roofline "
                  + "  ".join(f"{k} {v:.2f}" for k, v in r["roofline_ms"].items()), flush=True)
            out.append(r)
    return out


SWITCHES = {"fused_activation": (GatedMLP, "fused_activation"), "norm_quant": (RMSNorm, "quantize"),
            "absorbed_in_place": (MLAttention, "absorbed_in_place")}


def set_switches(variant: str, apply: bool = False) -> str:
    """Check a `--switch-variants` entry ('+'-joined SWITCHES names, or none); with `apply`, set exactly those."""
    names = set() if variant == "none" else set(variant.split("+"))
    unknown = names - set(SWITCHES)
    if unknown:
        raise SystemExit(f"--switch-variants: unknown switch(es) {sorted(unknown)}; known: {sorted(SWITCHES)}, none")
    if apply:
        for name, (cls, attr) in SWITCHES.items():
            setattr(cls, attr, name in names)
    return variant


def tag(rows: list[dict]) -> list[dict]:
    """The rows with the switches they ran under."""
    return [dict(r, switches={name: getattr(cls, attr) for name, (cls, attr) in SWITCHES.items()}) for r in rows]


def run_modes(core, modes: list[str], batches: list[int], a, ceil: dict, label: str) -> list[dict]:
    runner = core.runner
    static = runner.static
    rows = []
    for mode in modes:
        runner.static = static if mode in ("graphs", "static", "async") else None
        core.async_scheduling = mode == "async"  # between steps, with none in flight
        for b in batches:
            row = {"engine": label, "mode": mode, **time_steps(core, b, a, f"{label}-{mode}")}
            row["captures"] = static.num_captures if static is not None else 0
            sg = runner.device_decode.step_graphs if runner.device_decode is not None else None
            row["whole_step_replays"] = sg.num_replays if sg is not None else 0
            hs = core.stats().hisparse
            if hs is not None:
                row["hisparse"] = {"hits": hs.hits, "misses": hs.misses}
            fb = floor_bytes(core, b, a.prompt_len + 8 * a.steps)
            row["floor_bytes"] = fb
            if ceil.get("copy_tbps"):
                row["floor_ms"] = 1e3 * fb["total"] / (ceil["copy_tbps"] * 1e12)
                row["wall_over_floor"] = row["wall_ms"] / row["floor_ms"]
                row["roofline_ms"] = roofline_ms(core, b, a.prompt_len + 8 * a.steps, ceil["copy_tbps"],
                                                 ceil["bf16_tflops"])
                row["wall_over_roofline"] = row["wall_ms"] / row["roofline_ms"]["total"]
            rows.append(row)
            busy = f"busy {row['busy_ms']:8.2f} ms ({row['wall_over_busy']:.2f}x)" if "busy_ms" in row else ""
            floor = ""
            if "floor_ms" in row:
                floor = (f"floor {row['floor_ms']:8.2f} ms ({row['wall_over_floor']:.2f}x)  roofline "
                         f"{row['roofline_ms']['total']:8.2f} ms ({row['wall_over_roofline']:.2f}x)")
            print(f"{label:9s} {mode:6s} B={b:3d}  wall {row['wall_ms']:8.2f} ms  {busy}  {floor}  "
                  f"{row['tokens_per_step']:.1f} tok/step  decoding {row['decoding_requests']}  "
                  f"preempted {row['preemptions']}  captures {row['captures']}", flush=True)
            for k in row.get("kernels", []):
                print(f"    {k['ms_per_step']:8.3f} ms  x{k['launches_per_step']:6.1f}  {k['kernel']}", flush=True)
    runner.static = static
    core.async_scheduling = False
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="checkpoints/tiny-code")
    src.add_argument("--random-model", type=int, metavar="LAYERS", help="GLM-5.3 widths, LAYERS layers, random")
    src.add_argument("--standin", action="store_true", help="one EP8 rank of the full GLM-5.3 in FP8 (random)")
    p.add_argument("--standin-layers", type=int, default=None, metavar="N",
                   help="the stand-in cut to N layers (the full one needs 105 GiB: an 80 GB card takes about 36)")
    p.add_argument("--experts", type=int, default=32, help="routed experts of --random-model")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--spec", type=int, default=3, help="MTP draft tokens per step (0: none; the stand-in: 3)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--hisparse-pool-gib", type=float, default=None, help="also time a HiSparse engine")
    p.add_argument("--hisparse-buffer", type=int, default=None, help="its device_buffer_size (rows per request)")
    p.add_argument("--hisparse-batches", default=None, help="its batch sizes (default: --batches)")
    p.add_argument("--hisparse-prompt-len", type=int, default=None,
                   help="its prompt length (default: --prompt-len; above the top-k, a step misses)")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seeded", action="store_true", help="every request with its own seed")
    p.add_argument("--hisparse-only", action="store_true", help="time the HiSparse engine alone")
    p.add_argument("--async-scheduling", action="store_true",
                   help="also the static path with async scheduling (mode `async`)")
    p.add_argument("--host-phases", action="store_true",
                   help="only where the static path's decode step spends its host time, by phase (docstring)")
    p.add_argument("--per-forward-graphs", action="store_true",
                   help="no whole-step graphs (engine/runner/step_graph.py): a graph per forward, the rest eager")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of eager,graphs,async to time (default: all that apply)")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="record the N CUDA kernels that take the most time in a profiled step (`kernels` per row)")
    p.add_argument("--roofline-only", metavar="COPY_TBPS,BF16_TFLOPS", default=None,
                   help="with --standin: only the floors, from the model on meta and these ceilings (no GPU)")
    p.add_argument("--contexts", default=None, help="--roofline-only's contexts (default: what a timed run has)")
    p.add_argument("--switch-variants", default=None, metavar="V,V",
                   help="time the resident engine once per variant, one engine each on the same model, side by side "
                        "in this process: '+'-joined switches (fused_activation, norm_quant, absorbed_in_place) or "
                        "none (e.g. none,fused_activation,fused_activation+norm_quant)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.roofline_only:
        if not a.standin:
            p.error("--roofline-only needs --standin")
        copy, bf16 = (float(x) for x in a.roofline_only.split(","))
        res = {"roofline": standin_roofline([int(b) for b in a.batches.split(",")],
                                            [int(c) for c in a.contexts.split(",")] if a.contexts
                                            else [a.prompt_len + 8 * a.steps], copy, bf16),
               "ceilings": {"copy_tbps": copy, "bf16_tflops": bf16}}
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return res
    batches = [int(b) for b in a.batches.split(",")]
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ceil = {}
    if device.startswith("cuda"):
        from bench.kernels.timing import ceilings

        ceil = ceilings(torch.device(device))
        print(f"copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    graph_kw = {"enforce_eager": False, "cuda_graph_sizes": sorted(set(batches))}
    variants = [set_switches(v) for v in a.switch_variants.split(",")] if a.switch_variants else []
    if variants:  # before each engine is built: its graphs capture the model as it runs then
        set_switches(variants[0], apply=True)
    hs_kw = {"hisparse": {"host_pool_gib": a.hisparse_pool_gib}} if a.hisparse_pool_gib else None
    if hs_kw and a.hisparse_buffer:
        hs_kw["hisparse"]["device_buffer_size"] = a.hisparse_buffer
    hs_batches = [int(b) for b in a.hisparse_batches.split(",")] if a.hisparse_batches else batches
    hs_prompt = a.hisparse_prompt_len or a.prompt_len
    rows, info = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        if a.standin:
            from bench.prefill import standin

            sa = argparse.Namespace(device=device, kv_cache_dtype="fp8_ds_mla", gpu_memory_utilization=0.9,
                                    prefill_tokens=max(a.prompt_len, hs_prompt) + 64 * a.steps, chunk=8192,
                                    batches=batches, num_blocks=a.num_blocks)
            path = standin.rank_config_dir(Path(tmp), **({"num_hidden_layers": a.standin_layers}
                                                          if a.standin_layers else {}))
            t0 = time.perf_counter()
            core, info = standin._engine(sa, path, **graph_kw)
            info["build_s"] = time.perf_counter() - t0
            model = core.runner.model

            def make_hisparse():
                return standin._engine(sa, path, model=model, **hs_kw, **graph_kw)[0]

            def make_resident():
                return standin._engine(sa, path, model=model, **graph_kw)[0]
        else:
            path = a.model
            kw = {"num_blocks": a.num_blocks, "max_num_seqs": max(batches), "device": device,
                  "max_model_len": max(a.prompt_len, hs_prompt) + 64 * a.steps + 64}
            if a.random_model:
                from bench.serving.gpu_system import random_model_dir

                path = str(random_model_dir(Path(tmp) / "model", layers=a.random_model, experts=a.experts))
                kw["load_format"] = "dummy"
            if a.spec:
                kw["num_speculative_tokens"] = a.spec
            llm = LLM(path, **kw, **graph_kw)
            core = llm.core

            def make_hisparse():
                return LLM(path, **kw, **hs_kw, **graph_kw).core

            def make_resident():
                return LLM(path, **kw, **graph_kw).core
        st = core.runner.static
        dd = core.runner.device_decode
        if a.per_forward_graphs and dd is not None:
            dd.step_graphs = None
        sg = dd.step_graphs if dd is not None else None
        info["whole_step_graphs"] = sg.num_captures if sg is not None else 0
        info["whole_step_capture_s"] = sum(sg.capture_seconds.values()) if sg is not None else 0.0
        info["captures_at_start"] = st.num_captures if st is not None else 0
        info["capture_s"] = sum(st.capture_seconds.values()) if st is not None else 0.0
        if a.host_phases:
            rows = [host_phases(core, getattr(llm, "tokenizer", None) if not a.standin else None, b, a.prompt_len,
                                a.steps, a.warmup, "host") for b in batches]
            for row in rows:
                print(f"B={row['batch']:3d}  " + "  ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
                      + f"  ms/step, {row['tokens_per_step']:.1f} tok/step", flush=True)
            batches = []  # nothing else to time
        modes = ["eager", "graphs"] + (["async"] if a.async_scheduling and st is not None else [])
        if a.modes:
            modes = [m for m in modes if m in a.modes.split(",")]
        if batches and not a.hisparse_only:
            rows += tag(run_modes(core, modes, batches, a, ceil, "resident"))
            for v in variants[1:]:
                del core, st
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                set_switches(v, apply=True)
                print(f"switches: {v}", flush=True)
                llm = None  # the LLM path's engine goes with it
                core = make_resident()
                st = core.runner.static
                rows += tag(run_modes(core, modes, batches, a, ceil, "resident"))
        if hs_kw and batches:
            del core, st
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            core = make_hisparse()  # padded and captured: the benchmark asks for graphs (GraphConfig.capture_hisparse)
            a.prompt_len = hs_prompt
            hst = core.runner.static
            info["hisparse_capture_s"] = sum(hst.capture_seconds.values()) if hst is not None else 0.0
            hs_static = ["graphs" if hst.capture else "static"] if hst is not None else []
            hs_modes = ["eager"] + hs_static + (["async"] if a.async_scheduling and hst is not None else [])
            if a.modes:
                hs_modes = [m for m in hs_modes if m in a.modes.split(",") or (m == "static" and "graphs" in a.modes)]
            rows += run_modes(core, hs_modes, hs_batches, a, ceil, "hisparse")
    name = "standin" + (f"-{a.standin_layers}-layers" if a.standin_layers else "")
    result = {"model": name if a.standin else (f"random-{a.random_model}" if a.random_model else a.model),
              "spec": a.spec, "device": device, "ceilings": ceil, "info": info, "rows": rows,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
