r"""A service's first minutes: how long it takes to start, and how much kernel compiling is left for its traffic.

    python -m bench.serving.cold_start --traces DIR --out cold.json                   # a cold start
    python -m bench.serving.cold_start --traces DIR --warmup --out warm-up.json       # engines start with --warmup
    python -m bench.serving.cold_start --traces DIR --cache-dir C --out restart.json  # a restart on a kept cache

A Triton kernel compiles a variant at the first launch of each combination of its arguments' classes
(kernels/jit_variants.py), 0.5-2 s inside an engine step. The topology (default configs/topology.gpu-1.yaml) is
started once with its own Triton cache directory (`TRITON_CACHE_DIR`: empty, or `--cache-dir` to measure a restart
that keeps it), then `bench agentx` runs `--passes` times at `--concurrency` for `--pass-duration` seconds, each
pass with other sessions. Recorded: the start-up time; the compiled variants in the cache after start-up and after
each pass, by kernel what each pass compiled, and what the cache holds at the end; each pass's client figures
(completed requests, TTFT p50 / p90, TPOT p50) and the engines' own step counts and mean step times over it. A
service that compiles nothing under traffic shows the same variant count after every pass and steps as fast in the
first pass as in the last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.serving.engine_counters import STEP_COUNTERS, engine_counters
from bench.serving.gpu_system import ROOT, topology


def compiled_variants(cache_dir: Path) -> Counter:
    """{kernel name: variants} in a Triton cache directory (one metadata file per compiled variant)."""
    return Counter(p.stem for p in Path(cache_dir).rglob("*.json") if not p.name.startswith("__grp__"))


def cold_topology(config: Path, run_dir: Path, cache_dir: Path, warmup: bool) -> dict:
    """The topology with fresh ports, its own Triton cache for every service, and (warmup) `--warmup` engines."""
    topo = topology(config, run_dir, None, False, None)
    topo.setdefault("env", {})["TRITON_CACHE_DIR"] = str(cache_dir)
    for kind in ("prefill", "decode"):
        if kind in topo["services"] and warmup:
            topo["services"][kind].setdefault("args", {})["warmup"] = True
    return topo


def _steps(dep) -> dict[str, dict[str, float]]:
    return engine_counters(dep.redis_url, STEP_COUNTERS)


def _pass_figures(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    out = {}
    for role, now in after.items():
        n = now[STEP_COUNTERS[0]] - before.get(role, {}).get(STEP_COUNTERS[0], 0.0)
        s = now[STEP_COUNTERS[1]] - before.get(role, {}).get(STEP_COUNTERS[1], 0.0)
        out[role] = {"steps": n, "mean_step_ms": 1e3 * s / n if n else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.cold_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "topology.gpu-1.yaml"))
    p.add_argument("--traces", required=True)
    p.add_argument("--warmup", action="store_true", help="start the engines with --warmup")
    p.add_argument("--cache-dir", help="Triton cache to start from and keep (default: a new, empty one)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--pass-duration", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.passes < 1 or a.pass_duration <= 0 or a.concurrency < 1:
        p.error("--passes, --pass-duration and --concurrency must be positive")
    from services.launch import launcher

    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    cache = Path(a.cache_dir) if a.cache_dir else work / "triton"
    cache.mkdir(parents=True, exist_ok=True)
    out = {"config": Path(a.config).name, "warmup": a.warmup, "cache_dir_kept": bool(a.cache_dir),
           "variants_before": sum(compiled_variants(cache).values()), "passes": []}
    t0 = time.perf_counter()
    dep = launcher.up(cold_topology(Path(a.config), work / "run", cache, a.warmup), timeout_s=900,
                      die_with_parent=True, echo=print)
    out["startup_s"] = time.perf_counter() - t0
    seen = compiled_variants(cache)
    out["variants_after_startup"] = sum(seen.values())
    try:
        for i in range(a.passes):
            before = _steps(dep)
            res = work / f"pass{i}"
            subprocess.run([sys.executable, "-m", "services.cli", "bench", "agentx", "--url", dep.url, "--traces",
                            a.traces, "--concurrency", str(a.concurrency), "--token-scale", "0.02",
                            "--think-time-scale", "0.05", "--max-think-time", "2", "--fit-traces", "--max-context",
                            "4096", "--duration", str(a.pass_duration), "--warmup", "5", "--drain-timeout", "15",
                            "--seed", str(11 + i), "--num-gpus", "1", "--no-progress", "--output-dir", str(res)],
                           check=False, timeout=a.pass_duration + 120)
            level = json.loads((res / "result.json").read_text())["levels"][0] if (res / "result.json").exists() \
                else {}
            now = compiled_variants(cache)
            out["passes"].append({
                "variants_after": sum(now.values()),
                "compiled_by_kernel": dict((now - seen).most_common()),  # what this pass's traffic compiled
                "client": {k: level.get(k) for k in ("completed", "p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms")},
                "engines": _pass_figures(before, _steps(dep))})
            seen = now
            print(json.dumps(out["passes"][-1]), flush=True)
            Path(a.out).write_text(json.dumps(out, indent=1))
    finally:
        launcher.down(dep)
        out["variants_by_kernel"] = dict(compiled_variants(cache).most_common())
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
