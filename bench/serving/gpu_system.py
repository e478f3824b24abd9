r"""The whole system on one GPU, measured: `bench serve` and `bench agentx` through the router of a
topology (default configs/topology.gpu-1.yaml), with each engine's own per-step time beside the client's
figures, so the cost of the hops (router, gRPC, NIXL pull) shows.

    python -m bench.serving.gpu_system --out gpu1-tiny.json                                   # tiny-code
    python -m bench.serving.gpu_system --random-model --out gpu1-glm.json                     # GLM-5.3 widths

`--random-model` writes a config-only checkpoint of the GLM-5.3 widths cut to 4 layers and 32 routed
experts (tiny-code's tokenizer and vocabulary) and serves it with random weights (`--load-format dummy`).
Per run the engines' counters are read before and after (`pdserve:engine_steps_total`,
`pdserve:engine_step_seconds_total`, the decode TPOT and prefill TTFT histograms, NIXL bytes): the
server-side figures are means over that run. Each `bench serve` level also prints where the decode time
goes (`split_line`): the decode engine's step by phase (`pdserve:engine_step_phase_seconds_total`: the
device wait, and the host's schedule / launch / read-back / update), the decode service per token delta
(engine step returned -> its gRPC message sent) and the router per chunk (gRPC message read -> SSE event
written), both from `pdserve:token_delta_delay_seconds`.

    python -m bench.serving.gpu_system --no-hisparse --concurrency 32 --prompts-per-level 64 --out F.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import yaml

from bench.serving.engine_counters import PHASES, scrape_services, server_side

ROOT = Path(__file__).resolve().parents[2]



def random_model_dir(out: Path, layers: int = 4, experts: int = 32) -> Path:
    """GLM-5.3 widths, `layers` layers, `experts` routed experts; config + tiny-code's tokenizer only."""
    from engine.config.presets import preset_dict

    src = ROOT / "checkpoints" / "tiny-code"
    d = preset_dict("glm-5.3", num_hidden_layers=layers, n_routed_experts=experts, vocab_size=4096,
                    max_position_embeddings=32768, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    d.pop("indexer_types", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(d))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def topology(config: Path, run_dir: Path, model: str | None, dummy: bool, share: float | None,
             hisparse: bool = True, async_scheduling: bool = False, cuda_graphs: bool = False) -> dict:
    """The topology file for one benchmark run: fresh ports and Redis; the model, dummy weights, memory
    share, (hisparse False) a decode without HiSparse, whose decode step is then graph-captured, and
    (async_scheduling) a decode that plans its next step while one runs, (cuda_graphs) a decode that pads and
    captures its HiSparse decode too (`--cuda-graphs`)."""
    from engine.parallel.dist import free_port

    topo = yaml.safe_load(config.read_text())
    topo["run_dir"], topo["redis_url"] = str(run_dir), f"redis://127.0.0.1:{free_port()}/0"
    if model:
        topo["model"] = model
    for kind, spec in topo["services"].items():
        spec["port"] = spec["metrics_port"] = 0
        if kind == "router":
            spec["grpc_port"] = 0
        if kind in ("prefill", "decode"):
            args = spec.setdefault("args", {})
            if dummy:
                args["load-format"] = "dummy"
            if share:
                args["gpu-memory-utilization"] = share
            if kind == "decode" and async_scheduling:
                args["async-scheduling"] = True
            if kind == "decode" and cuda_graphs:
                args["cuda-graphs"] = True
            if kind == "decode" and not hisparse:
                attn = dict(args.pop("attention-config", None) or {})
                attn.pop("hisparse_config", None)
                if attn:
                    args["attention-config"] = attn
    return topo


def scrape(dep) -> dict[str, dict[str, float]]:
    """{role: {counter: value}} of every engine (and the router's histograms) of a deployment handle."""
    return scrape_services(dep.redis_url, dep.endpoints()["router"][0])


def split_line(level: dict) -> str:
    """Where a run's decode time goes: the engine step (device wait, host phases), the decode service per
    delta (engine step returned -> gRPC message sent) and the router per chunk (gRPC read -> SSE written)."""
    sv = level["server"]

    def ms(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    ph = sv.get("decode_phase_ms") or {}
    phases = ", ".join(f"{p} {ms(ph.get(p))}" for p in PHASES if p != "device_wait")
    return (f"C={level.get('concurrency')}: TPOT p50 {ms(level.get('median_tpot_ms'))} ms | decode step "
            f"{ms(sv.get('decode_mean_step_ms'))} ms = device wait {ms(ph.get('device_wait'))} + host "
            f"{ms(sv.get('decode_host_ms'))} ({phases}) | decode service {ms(sv.get('decode_delta_delay_ms'))} ms "
            f"per delta | router {ms(sv.get('router_delta_delay_ms'))} ms per chunk")


KEEP = ("completed", "num_errors", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def bench_serve(dep, concurrency: int, num_prompts: int, input_len: int, output_len: int) -> dict:
    from bench.serving import serve

    args = serve.build_parser().parse_args(["--url", dep.url, "--input-len", str(input_len), "--output-len",
                                            str(output_len), "--num-prompts", str(num_prompts),
                                            "--max-concurrency", str(concurrency), "--no-progress",
                                            "--seed", str(concurrency)])
    before = scrape(dep)
    res = serve.run(args)
    return {"concurrency": concurrency, **{k: res.get(k) for k in KEEP}, "server": server_side(before, scrape(dep))}


def bench_agentx(dep, traces: str, concurrency: int, duration: float, warmup: float, max_context: int) -> dict:
    from bench.serving import agentx

    args = agentx.build_parser().parse_args([
        "--url", dep.url, "--traces", traces, "--concurrency", str(concurrency), "--duration", str(duration),
        "--warmup", str(warmup), "--token-scale", "0.02", "--think-time-scale", "0.05", "--max-think-time", "2",
        "--fit-traces", "--max-context", str(max_context), "--seed", "1", "--no-progress",
        "--output-dir", tempfile.mkdtemp(prefix="agentx-")])
    before = scrape(dep)
    res = agentx.run(args)
    level = res["levels"][-1]
    keep = {k: v for k, v in level.items() if not isinstance(v, (list, dict))}
    return {**keep, "server": server_side(before, scrape(dep))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.gpu_system", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "topology.gpu-1.yaml"))
    p.add_argument("--random-model", action="store_true", help="GLM-5.3 widths, 4 layers, 32 experts, dummy weights")
    p.add_argument("--share", type=float, help="gpu-memory-utilization of each engine (override)")
    p.add_argument("--no-hisparse", action="store_true",
                   help="decode without HiSparse (CUDA graphs; HiSparse decode is captured only with --cuda-graphs)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the decode plans step N+1 while N runs (docs/async_scheduling.md)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the decode pads and captures its HiSparse decode too (engine flag --cuda-graphs)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompts-per-level", default="6,24,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--traces", help="recorded agent sessions for the agentx level (folder, glob or files); "
                                    "without it the agentx level is skipped")
    p.add_argument("--agentx-concurrency", type=int, default=8)
    p.add_argument("--agentx-duration", type=float, default=30.0)
    p.add_argument("--warmup-requests", type=int, default=2,
                   help="requests sent (and not measured) first: they pay for the kernels' compilation")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from services.launch import launcher

    work = Path(tempfile.mkdtemp(prefix="gpu-system-"))
    model = str(random_model_dir(work / "model")) if a.random_model else None
    topo = topology(Path(a.config), work / "run", model, a.random_model, a.share, hisparse=not a.no_hisparse,
                    async_scheduling=a.async_scheduling, cuda_graphs=a.cuda_graphs)
    t0 = time.perf_counter()
    dep = launcher.up(topo, timeout_s=400, die_with_parent=True, echo=print)
    name = "glm-5.3 widths, 4 layers, 32 experts (random)" if model else topo["model"]  # no temporary path
    out = {"topology": Path(a.config).name, "hisparse": not a.no_hisparse, "async_scheduling": a.async_scheduling,
           "cuda_graphs": a.cuda_graphs,
           "model": name,
           "startup_s": time.perf_counter() - t0,
           "serve": [], "agentx": None}
    try:
        if a.warmup_requests:
            out["warmup"] = bench_serve(dep, 1, a.warmup_requests, a.input_len, a.output_len)
        for c, n in zip(map(int, a.concurrency.split(",")), map(int, a.prompts_per_level.split(","))):
            out["serve"].append(bench_serve(dep, c, n, a.input_len, a.output_len))
            print(json.dumps(out["serve"][-1]), flush=True)
            print(split_line(out["serve"][-1]), flush=True)
            Path(a.out).write_text(json.dumps(out, indent=1))
        if a.agentx_duration > 0 and a.traces:
            out["agentx"] = bench_agentx(dep, a.traces, a.agentx_concurrency, a.agentx_duration, 10.0, 4096)
            print(json.dumps(out["agentx"]), flush=True)
    finally:
        Path(a.out).write_text(json.dumps(out, indent=1))
        launcher.down(dep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
