r"""The H200 profile of the reference deployment (GLM-5.3 FP8; one PCP8 x DCP8 x EP8 prefill engine, one
DP8 x EP8 decode group), built from the project's own recorded H200 measurements (bench/data/) and a few named
published figures, never from the results the simulation is set beside:

    python -m bench.simulate.reference_profile --out configs/profiles/h200-glm5.3-fp8.json

Each entry says where every number came from. What is measured and what is modelled:

decode/dp8 (a rank of the DP8 x EP8 group, requests resident on the device)
    The one-rank stand-in (one EP8 rank of the 78-layer model in FP8, 32 of 256 experts, MTP3 at acceptance 2.99,
    whole-step graphs, async scheduling) was timed on an H200 at B = 1 / 16 / 64 with 256-token prompts and
    B = 16 / 64 with 1,900-token prompts (decode-graphs/). Its steps fold every assignment onto the local
    experts; the DP8 x EP8 rank's own step code (planned static dispatch over a loopback transport) measured
    1.03-1.09x the stand-in at the same B on an H100 over 36 layers (decode-dp/): that ratio, at the nearest
    measured B and prompt, multiplies each H200 point (modelled: the ratio carried over from the H100 and 36
    layers), and the wire is added as bench.decode_dp models it for 75 + 1 MoE layers (collectives x 15 us +
    bytes / 450 GB/s, no overlap). The indexer's share that grows with the context (every key scored) is the
    H200 kernel measurement (decode, B = 64, 128K keys: 349 us of device time) per (row x key x full indexer
    layer); the rest is fitted, non-negative least squares over those five points, to step + per row + per row
    x min(context, 2,048) + per request.
decode/dp8-hisparse
    decode/dp8 plus what HiSparse added to the stand-in's step on the H200 at B = 1 and 16 (4,096-token prompts;
    against the resident step of the same code days): a per-step and a per-request part, less the plan kernel's
    later speed-up (three sorts -> one sort, kernel alone, x its 24 launches a step).
prefill/pcp8-dcp8 (the whole PCP8 x DCP8 x EP8 engine; a chunk of n tokens is split n / 8 per rank)
    One rank's compute of a PCP-8 step of the 4-layer GLM-5.3 stack was timed on the H200 at 32K and 128K
    (prefill-stack/). Two achieved rates are solved from those two points: one for the context-independent
    matmuls (projections, MLP, experts), one for attention (indexer scores and sparse MLA), using the model's
    FLOP counts (planner/roofline.py); the full model's terms are its FLOPs at those rates, divided over 8 ranks.
    Modelled on top (not measured at 8 GPUs): the EP all-to-all bytes of each token (bench.decode_dp's count
    of remote copies) and the DCP context all-gather over 450 GB/s NVLink, and 15 us per collective per layer.
prefill/dp8 (one rank of a DP8 x EP8 prefill group: a what-if, simulated only; a chunk's rows all on one rank)
    The same per-GPU rates and fixed part as prefill/pcp8-dcp8, nothing divided over 8 ranks, no DCP all-gather;
    modelled the same way: the EP all-to-all of each row, 15 us per collective (2 a MoE layer). The routed
    experts' share of a token's matmul FLOPs (from the model) is `group_token_s`: the group's tokens over its 8
    ranks, wherever the rows came from (bench/simulate/engines.py: LockStep).
kvstore
    Pinned host memory to the GPU by DMA (measured on the H200); the call latency is the transfer's.
transfer
    450 GB/s would be NVLink; the two hosts talk over one 400 Gb/s ConnectX-7 per GPU (50 GB/s, NVIDIA's
    DGX H200 specification). Latency: the decode and router services' measured per-delta work on the H200
    (the path of the first decoded token); the NIXL read's own latency across hosts is not measured.
request_overhead_s
    The router's TTFT less the prefill's, means over the H200 agentx run (gpu-system-h200/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from bench.decode_dp import ALPHA_US, NVLINK_GBS, WORLD, step_comm
from bench.simulate.calibrate import nnls_fit
from bench.simulate.profile import selected
from engine.config.presets import preset
from planner.capacity import Deployment, kv_spec, rank_weight_bytes
from planner.roofline import active_params, prefill_flops

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "bench" / "data"
MTP_K = 3
NIC_GBS = 50.0  # one ConnectX-7 (400 Gb/s) per GPU: NVIDIA DGX H200 specification
HOST_DMA_GBS = 52.0  # pinned host -> H200 by DMA, the low end of the 52-54 GB/s measured (BENCHMARKS.md, HiSparse)
HBM_GIB = 139.8  # torch.cuda.get_device_properties(0).total_memory of the H200s the data came from (143,771 MiB)
DECODE_POINTS = [  # (file under bench/data, prompt length)
    ("decode-graphs/standin-h200-2026-12-04.json", 256),
    ("decode-graphs/standin-sparse-mla-sm90-1-h200-2026-12-04.json", 1900),
]
EMULATED = "decode-dp/emulated-ep8-packed-rows-h100-36l-p256-p1900-2026-12-06.json"
CTX_DURING_STEPS = 8  # timed steps after the prompt: the rows' context is the prompt plus about this many tokens
INDEXER = "kernels/indexer-layout/indexer-blocked-h200-2026-12-03.json"
HISPARSE = "decode-graphs/standin-hisparse-graphs-h200-2026-12-02.json"
HISPARSE_RESIDENT = "decode-graphs/standin-fused-ops-h200-2026-12-02.json"  # the resident step of those days
PLAN_ONE_SORT = "hisparse-h200-plan-one-sort/plan-mtp3-h200-2026-12-05.json"
PLAN_THREE_SORTS_MS = 0.896  # kernel alone, B = 1, MTP3, 2026-12-02 (hisparse-h200-plan-one-sort/NOTES.md)
PLAN_LAUNCHES = 24  # plan launches in one MTP3 step of the stand-in (BENCHMARKS.md, "The decode step")
PREFILL_STACK = "prefill-stack/stack-32k-128k-sm90-1-h200-2026-12-04.json"
STACK_LAYERS = 4
STACK_CHUNK = 16384  # the stack bench's chunks
ENGINE_CHUNK = 8192  # the engine's default max_num_batched_tokens (the reference prefill host keeps it)
SERVICE_DELTA_MS = {"decode": 2.34, "router": 0.49}  # per token delta on the H200 (BENCHMARKS.md, whole system)
AGENTX_TTFT_MS = {"router": 164.0, "prefill": 159.0}  # means, H200 tiny-code agentx run (gpu-system-h200/NOTES.md)
PCP = 8
COPY_TBPS = 4.27  # copy bandwidth measured on the H200s of these runs (BENCHMARKS.md ceilings)


def _load(rel: str) -> dict:
    return json.loads((DATA / rel).read_text())


def _async(rows: list[dict], engine: str) -> dict[int, float]:
    return {r["batch"]: r["wall_ms"] * 1e-3 for r in rows if r["engine"] == engine and r["mode"] == "async"}


def decode_entry(cfg) -> tuple[dict, dict]:
    """(decode/dp8, the parts it was made of)."""
    spec = kv_spec(cfg, Deployment(), with_mtp=True)
    emu = {(r["prompt_len"], r["batch"]): r["emulated_over_standin"] for r in _load(EMULATED)["summary"]}
    main_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    topk = cfg.index_topk
    # the indexer: device time per (row x key x full indexer layer), one row per request in the measurement
    ix = next(r for r in _load(INDEXER)["rows"] if r.get("case") == "decode" and r.get("impl") == "fused")
    per_key = ix["device_us"] * 1e-6 / (ix["B"] * ix["S"])
    full_main = spec.num_index_layers - 1  # the MTP layer's indexer is the last one
    # per step and request: the target pass scores 1 + k rows over the main model's full indexers, the MTP
    # catch-up pass 1 + k rows and the k - 1 draft passes one row each over the MTP layer's (the passes of
    # bench.decode_dp.step_comm); the cost model counts 1 + k rows per request
    token_ctx = per_key * (full_main * (1 + MTP_K) + (1 + MTP_K) + (MTP_K - 1)) / (1 + MTP_K)
    rows, points = [], []
    for rel, prompt in DECODE_POINTS:
        for b, t in sorted(_async(_load(rel)["rows"], "resident").items()):
            ratio = emu[(prompt, b)]
            wire = step_comm(b, [b], MTP_K, cfg.hidden_size, cfg.num_experts_per_tok, (main_moe, 1), ALPHA_US,
                             NVLINK_GBS, fp8=True)["wire_ms"] * 1e-3
            ctx = prompt + CTX_DURING_STEPS
            n = b * (1 + MTP_K)
            t_rank = t * ratio + wire
            rest = t_rank - token_ctx * n * ctx
            rows.append(([1.0, n, n * min(ctx, topk), b], rest))
            points.append({"source": rel, "batch": b, "prompt": prompt, "standin_s": t, "emulated_ratio": ratio,
                           "wire_s": wire, "rank_step_s": t_rank})
    coef, rel_err = nnls_fit(rows)
    step, token, sel, req = coef
    entry = {"step_s": step, "token_s": token, "token_ctx_s": token_ctx, "request_s": req, "token_sel_s": sel,
             "index_topk": topk, "median_relative_error": rel_err, "points": points,
             "source": "H200 stand-in steps (one EP8 rank, 78 layers, FP8, MTP3 at 2.99, async) x the DP8xEP8 "
                       "rank's measured ratio to the stand-in (H100, 36 layers) + modelled NVLink wire; indexer "
                       "term from the H200 indexer kernel (decode, 128K keys); the rest fitted to those points"}
    return entry, {"indexer_s_per_row_key_layer": per_key}


def hisparse_entry(resident: dict) -> dict:
    his = _async(_load(HISPARSE)["rows"], "hisparse")
    res = _async(_load(HISPARSE_RESIDENT)["rows"], "resident")
    b0, b1 = 1, 16
    extra0, extra1 = his[b0] - res[b0], his[b1] - res[b1]
    per_req = (extra1 - extra0) / (b1 - b0)
    per_step = extra0 - per_req * b0
    one = {r["batch"]: r["ms"] * 1e-3 for r in _load(PLAN_ONE_SORT)["rows"]}
    saved = PLAN_LAUNCHES * (PLAN_THREE_SORTS_MS * 1e-3 - one[1])
    return {**{k: v for k, v in resident.items() if k not in ("points", "median_relative_error", "source")},
            "step_s": resident["step_s"] + max(per_step - saved, 0.0),
            "request_s": resident["request_s"] + per_req,
            "hisparse_extra": {"per_step_s": per_step, "per_request_s": per_req, "plan_speedup_s": saved},
            "source": f"decode/dp8 + HiSparse's measured extra on the H200 stand-in (B = 1 / 16, 4,096-token prompts, "
                      f"{HISPARSE} against {HISPARSE_RESIDENT}): {per_step * 1e3:.1f} ms a step and "
                      f"{per_req * 1e3:.2f} ms a request, less the plan kernel's later speed-up ({PLAN_LAUNCHES} "
                      f"launches x (three sorts - one sort) = {saved * 1e3:.1f} ms, {PLAN_ONE_SORT})"}


def _chunks(prompt: int, cached: int = 0, chunk: int = STACK_CHUNK) -> list[tuple[int, int]]:
    """(start, n) of the prefill steps of `prompt` tokens after `cached`, in the engine's chunks."""
    out, at = [], cached
    while at < cached + prompt:
        n = min(chunk, cached + prompt - at)
        out.append((at, n))
        at += n
    return out


def prefill_entries(cfg) -> tuple[dict, dict]:
    """(prefill/pcp8-dcp8, prefill/dp8) from the 4-layer stack's H200 times, scaled to the 78-layer model by
    FLOPs."""
    stack = _load(PREFILL_STACK)["lengths"]
    cut = preset("glm-5.3-fp8", num_hidden_layers=STACK_LAYERS,
                 mlp_layer_types=list(cfg.mlp_layer_types[:STACK_LAYERS]),
                 indexer_types=list(cfg.indexer_types[:STACK_LAYERS]))
    dep = Deployment()
    spec, spec_cut = kv_spec(cfg, dep, with_mtp=True), kv_spec(cut, dep, with_mtp=True)
    topk = cfg.index_topk
    # the indexer's scores: the H200 kernel (prefill, 2,048 rows x 128K keys) per (row x key x full indexer layer)
    ix = next(r for r in _load(INDEXER)["rows"] if r.get("case") == "prefill" and r.get("impl") == "fused"
              and r.get("S") == 131072)
    per_key = ix["device_us"] * 1e-6 / (ix["T"] * ix["S"])

    def indexer_s(sp, chunks):
        return per_key * sp.num_index_layers * sum(n * (st + n / 2) for st, n in chunks)

    def features(chunks, ranks):
        return [float(len(chunks)), sum(n for _, n in chunks) / ranks,
                sum(selected(st, n, topk) for st, n in chunks) / ranks]

    def scale(length, new):  # the full model's FLOPs over the stack's, without the indexer (charged apart)
        def f(c):
            full = prefill_flops(c, kv_spec(c, dep, with_mtp=True), length, True)
            part = prefill_flops(c, kv_spec(c, dep, with_mtp=True), length - new, True) if new < length else None
            return sum(full[k] - (part[k] if part else 0) for k in ("sparse_mla", "moe", "rest"))
        return f(cfg) / f(cut)

    # a step's fixed part: the rank reads all of its weights once (dense parts + its 32 experts' share), at the
    # copy bandwidth measured on the same H200s (the stack's bf16 experts, all 256 on one GPU, do not scale to it)
    weights = sum(rank_weight_bytes(cfg, True, "fp8", WORLD).values())
    step = weights / (COPY_TBPS * 1e12)
    rows, points = [], []
    for length in (32768, 131072):
        # one PCP-8 rank's compute for the whole prompt (chunks 0 and 15 of 16, all before each cached)
        chunks = _chunks(length)
        t = stack[str(length)]["pcp_rank0"][str(PCP)]["rank0_s"]
        t78 = (t - indexer_s(spec_cut, chunks) / PCP) * scale(length, length) - step * len(chunks)
        rows.append((features(chunks, PCP)[1:], t78))
        points.append({"what": f"PCP-8 rank, {length} fresh", "stack_s": t, "full_model_s": t78})
    coef, err = nnls_fit(rows)
    token, sel = coef
    main_moe = sum(t == "sparse" for t in cfg.mlp_layer_types) + 1
    # modelled: EP all-to-all of each token's row to the ranks holding its experts and back (bf16 both ways),
    # the DCP8 context all-gather (7/8 of the context's MLA rows, per step: charged per token of a full chunk of
    # the engine's)
    remote = (WORLD - 1) * (1 - (1 - 1 / WORLD) ** cfg.num_experts_per_tok)
    ep_bytes = main_moe * remote * (cfg.hidden_size * 2 * 2 + 8 * cfg.num_experts_per_tok)
    gather_per_ctx = spec.mla_block_bytes / spec.block_size * (WORLD - 1) / WORLD
    collectives = (spec.num_mla_layers * 2 + main_moe * 2) * ALPHA_US * 1e-6
    pcp = {"step_s": step + collectives,
            "token_s": token / PCP + ep_bytes / PCP / (NVLINK_GBS * 1e9),
            "token_ctx_s": per_key * spec.num_index_layers / PCP + gather_per_ctx / ENGINE_CHUNK / (NVLINK_GBS * 1e9),
            "token_sel_s": sel / PCP, "request_s": 0.0, "index_topk": topk,
            "median_relative_error": err, "points": points,
            "source": f"the 4-layer GLM-5.3 stack on the H200 ({PREFILL_STACK}): a PCP-8 rank's compute of "
                      f"32K and 128K prompts, scaled to the 78-layer model by its FLOPs (planner/roofline.py), "
                      f"fitted to per token + per selected key (a chunk's rows split over 8 ranks); a step's fixed "
                      f"part: the rank's FP8 weights at the H200's measured copy bandwidth ({COPY_TBPS} TB/s); the "
                      f"indexer from the H200 kernel (prefill, 128K keys); modelled: the EP all-to-all "
                      f"({remote:.2f} remote copies a token a MoE layer) and the DCP8 context all-gather at "
                      f"{NVLINK_GBS:.0f} GB/s, {ALPHA_US:.0f} us per collective (4 a layer)"}
    # one rank of a DP8 x EP8 prefill group: the same per-GPU rates, a chunk's every row on its own rank (nothing
    # divided over 8), no context all-gather; its MoE layers' all-to-alls as above (2 collectives a MoE layer).
    # The routed experts' share of a token's matmul FLOPs runs on the ranks holding the experts: charged per token
    # of the whole group over its 8 ranks (`group_token_s`), the rest on the row's own rank
    act = active_params(cfg, True)
    routed = act.routed / (act.moe + act.rest)
    dp = {"step_s": step + main_moe * 2 * ALPHA_US * 1e-6,
          "token_s": token * (1 - routed) + ep_bytes / (NVLINK_GBS * 1e9),
          "group_token_s": token * routed,
          "token_ctx_s": per_key * spec.num_index_layers,
          "token_sel_s": sel, "request_s": 0.0, "index_topk": topk,
          "median_relative_error": err, "points": points,
          "source": f"the same fit as prefill/pcp8-dcp8 ({PREFILL_STACK}: a GPU's rates for the matmuls and sparse "
                    f"attention, the rank's FP8 weights at {COPY_TBPS} TB/s, the H200 indexer kernel), a chunk's rows "
                    f"all on one rank; modelled: the EP all-to-all ({remote:.2f} remote copies a token a MoE layer) at "
                    f"{NVLINK_GBS:.0f} GB/s, {ALPHA_US:.0f} us per collective (2 a MoE layer); the routed experts' "
                    f"{routed:.0%} of a token's matmul FLOPs (planner/roofline.py) charged per token of the whole "
                    f"group over its 8 ranks"}
    return pcp, dp


def build() -> dict:
    cfg = preset("glm-5.3-fp8")
    dec, parts = decode_entry(cfg)
    pcp, dp = prefill_entries(cfg)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    return {
        "version": 1, "hardware": "NVIDIA H200 (141 GB HBM3e), 8 per host, NVLink 4; hosts on 400 Gb/s per GPU",
        "hbm_gib": HBM_GIB, "commit": commit, "date": time.strftime("%Y-%m-%d"), "model": "glm-5.3-fp8",
        "built_by": "python -m bench.simulate.reference_profile",
        "engines": {"prefill/pcp8-dcp8": pcp, "prefill/dp8": dp, "decode/dp8": dec,
                    "decode/dp8-hisparse": hisparse_entry(dec)},
        "measured": parts,
        "transfer": {"latency_s": sum(SERVICE_DELTA_MS.values()) * 1e-3, "gbs": NIC_GBS,
                     "source": "bandwidth: one ConnectX-7 400 Gb/s per GPU (NVIDIA DGX H200 specification); latency: "
                               "the decode and router services' measured per-delta work on the H200 (2.34 + 0.49 "
                               "ms); the cross-host NIXL read latency itself is not measured"},
        "kvstore": {"latency_s": sum(SERVICE_DELTA_MS.values()) * 1e-3, "gbs": HOST_DMA_GBS,
                    "source": "bandwidth: pinned host memory to one H200 by DMA, measured 52-54 GB/s (BENCHMARKS.md, "
                              "HiSparse; a DCP8 prefill stages whole blocks through rank 0); latency: taken from the "
                              "transfer entry, not measured"},
        "request_overhead_s": {"value": (AGENTX_TTFT_MS["router"] - AGENTX_TTFT_MS["prefill"]) * 1e-3,
                               "source": "router TTFT less prefill TTFT, means of the H200 bench agentx run "
                                         "(bench/data/gpu-system-h200/NOTES.md)"},
        "mtp_acceptance_length": 2.99,
        "mtp_source": "the synthetic acceptance length the stand-in was timed at (docs/decode_graphs.md)",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    prof = build()
    Path(a.out).write_text(json.dumps(prof, indent=1) + "\n")
    for key, e in prof["engines"].items():
        terms = {k: e[k] for k in ("step_s", "token_s", "token_ctx_s", "token_sel_s", "request_s") if k in e}
        print(key, {k: f"{v:.3g}" for k, v in terms.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
