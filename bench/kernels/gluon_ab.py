"""The indexer's prefill score kernel, Gluon against Triton on the same inputs: `python -m bench.kernels.gluon_ab`.

For S = 8K / 128K / 1M (SIZES=..., 2,048 query rows, the bench.kernels.indexer cases): the score kernel alone and
the whole `indexer_topk` call (do_bench and torch.profiler device time, % of the floor) with
PDSERVE_INDEXER_GLUON=0 and =1, then whether the two kernels' scores agree (finite positions, largest difference
over the row scale, bitwise-equal fraction) and how many picks the two selections share. JSON to $OUT/gluon-ab.json.
"""
import json
import os

import torch

from bench.kernels.indexer import ROW, Case, D, H, _agreement, _score_outputs
from bench.kernels.timing import ceilings, device_time, time_plain
from kernels.indexer_fused import PREFILL

dev = torch.device("cuda")
out_dir = os.environ.get("OUT", "/tmp")
res = {"torch": torch.__version__, "triton": __import__("triton").__version__, "rows": []}
ceil = ceilings(dev)
res["ceil"] = ceil
print("ceilings", ceil, flush=True)


def flag(v):
    os.environ["PDSERVE_INDEXER_GLUON"] = v


def one(S: int) -> dict:
    case = Case(dev, [S], 2048, 2048)
    cfg = PREFILL
    T = 2048
    rows = min(T, max(cfg.block_t, (1 << 30) // (4 * S)))
    flops = 2 * H * D * int((case.pos + 1).sum())
    floor = max(S * ROW / (ceil["copy_tbps"] * 1e12), flops / (2 * ceil["bf16_tflops"] * 1e12))
    row = {"S": S, "floor_us": floor * 1e6}
    outs = {}

    def call():
        return case.select("fused", cfg)

    for v in ("0", "1"):
        flag(v)
        launch, scores, gmax = _score_outputs(dev, case, cfg, rows)
        scores.fill_(float("nan"))
        gmax.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        outs[v] = (scores.clone(), gmax.clone())
        t_scores = time_plain(launch, dev, rep_ms=200) * T / rows
        outs[v + "sel"] = call()
        t_call = time_plain(call, dev, rep_ms=300)
        t_dev, kernels = device_time(call, dev)
        row[f"gluon={v}"] = dict(score_us=t_scores * 1e6, score_tflops=flops / t_scores / 1e12,
                                 call_us=t_call * 1e6, device_us=t_dev * 1e6, device_floor_frac=floor / t_dev,
                                 kernels={k[:50]: round(x * 1e6, 1) for k, x in kernels.items()})
        print(S, v, row[f"gluon={v}"], flush=True)
    a, b = outs["0"], outs["1"]
    fin = torch.isfinite(a[0])
    row["scores_same_finite"] = bool(torch.equal(fin, torch.isfinite(b[0])))
    scale = a[0].masked_fill(~fin, 0).abs().amax().item()
    row["scores_max_rel_diff"] = ((a[0] - b[0]).masked_fill(~fin, 0).abs().max().item()) / max(scale, 1e-9)
    row["scores_bitwise_equal_frac"] = float((a[0] == b[0])[fin].float().mean().item())
    row["gmax_same_finite"] = bool(torch.equal(torch.isfinite(a[1]), torch.isfinite(b[1])))
    row["picks_agreement"] = _agreement(outs["0sel"], outs["1sel"], rows=64)
    print(S, {k: v for k, v in row.items() if not k.startswith("gluon")}, flush=True)
    return row


for S in [int(x) for x in os.environ.get("SIZES", "8192,131072,1048576").split(",")]:
    res["rows"].append(one(S))
    torch.cuda.empty_cache()
    json.dump(res, open(os.path.join(out_dir, "gluon-ab.json"), "w"), indent=1)
