#!/bin/bash
# One model's calibration and measured runs on one GPU, as recorded here (the comparison runs afterwards anywhere):
#   OUT=DIR bash bench/data/simulate/gpu-h100-2026-12-08/run_model.sh MODEL TRACES [RUNS [FIRST]]
# MODEL: tiny (checkpoints/tiny-code) or glm4l (the GLM-5.3 widths, 4 layers, 32 experts, dummy weights);
# writes $OUT/MODEL/{topo.yaml,profile.json,real-N.json,gpu.txt,calibrate.log}, each run's result.json copied flat.
# RUNS measured runs (default 1) numbered from FIRST (default 1); the calibration only when FIRST is 1. About 200 s
# for the calibration and 265 s a run: `MODEL TRACES` first, then `MODEL TRACES 1 2` on the same machine.
set -u
M=$1; TRACES=$2; RUNS=${3:-1}; FIRST=${4:-1}
W=$OUT/$M; mkdir -p "$W"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$W/gpu.txt"
git rev-parse --short HEAD >> "$W/gpu.txt" 2>/dev/null || true
stop() { pkill -f "services\.\(prefill\|decode\|router\|kvstore\)" 2>/dev/null; sleep 1; }
python - "$M" "$W" <<'PY'
import sys, yaml
from pathlib import Path
from bench.serving.gpu_system import topology, random_model_dir
m, w = sys.argv[1], Path(sys.argv[2])
model = str(random_model_dir(Path("/tmp/glm4l"))) if m == "glm4l" else None
topo = topology(Path("configs/topology.gpu-1.yaml"), Path(f"/tmp/run-{m}"), model, m == "glm4l", None)
(w / "topo.yaml").write_text(yaml.safe_dump(topo))
PY
stop
if [ "$FIRST" = 1 ]; then
  timeout 280 python -u -m services.cli bench calibrate --config "$W/topo.yaml" --out "$W/profile.json" \
    --transfer-gbs 25 --transfer-latency-s 0.002 --request-overhead-s 0.005 --through-services \
    --traces "$TRACES" --token-scale 0.02 --max-context 4096 --source "one GPU through the services" \
    > "$W/calibrate.log" 2>&1
  echo "calibrate rc=$?" | tee -a "$W/gpu.txt"
fi
for n in $(seq "$FIRST" $((FIRST + RUNS - 1))); do
  stop
  timeout 280 python -u -m services.cli bench agentx --fresh-server "$W/topo.yaml" --traces "$TRACES" \
    --concurrency 4,16 --token-scale 0.02 --think-time-scale 0.05 --max-think-time 2 --fit-traces \
    --max-context 4096 --duration 90 --warmup 10 --drain-timeout 15 --seed 1 --num-gpus 1 \
    --output-dir "/tmp/real-$M-$n" > "/tmp/agentx-$M-$n.log" 2>&1
  echo "agentx $n rc=$?" | tee -a "$W/gpu.txt"
  cp "/tmp/real-$M-$n/result.json" "$W/real-$n.json"
done
stop
