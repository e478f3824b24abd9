"""`python -m bench.kernels.moe_align`: the three ways to sort MoE assignments by local expert, timed from
CUDA-graph replays (what a decode step pays): the one-program sort (`align_by_expert_small`), the counting sort
over many programs (`align_by_expert_many`) and the eager radix sort (`align_by_expert`), over the assignment
counts of decode: a rank's own (B · (1 + k) · 8) and the static EP dispatch's (8 ranks' rows, one in eight of
their assignments local). Picks `kernels.moe_routing.MANY_MIN_ASSIGNMENTS`.

    python -m bench.kernels.moe_align --out align.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels.timing import time_rotating
from kernels.moe_routing import MAX_SMALL_ASSIGNMENTS, align_by_expert, align_by_expert_many, align_by_expert_small

E_TOTAL, E_LOCAL, K = 256, 32, 8  # one EP8 rank of GLM-5.3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assignments", default="256,512,1024,2048,4096,8192,16384,65536")
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for A in (int(x) for x in a.assignments.split(",")):
        g = torch.Generator().manual_seed(A)
        ids = torch.randint(0, E_TOTAL, (A // K, K), generator=g).to(dev)
        row = {"assignments": A}
        ways = {"many": align_by_expert_many, "eager": align_by_expert}
        if A <= MAX_SMALL_ASSIGNMENTS:
            ways["small"] = align_by_expert_small
        for name, fn in ways.items():
            row[f"{name}_us"] = 1e6 * time_rotating([lambda fn=fn: fn(ids, E_LOCAL, 0, a.block_m)] * 8, dev)
        rows.append(row)
        print("  ".join(f"{k} {v:9.1f}" if isinstance(v, float) else f"{k} {v:6d}" for k, v in row.items()), flush=True)
    res = {"rows": rows, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "block_m": a.block_m}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
