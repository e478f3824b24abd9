"""`python -m bench.kernels.hisparse --out FILE`: HiSparse's two per-step kernels alone, over their knobs
(CUDA only; CUDA-event medians).

    copy  the row copy (kernels.hisparse_gather): random 656-B fp8_ds_mla rows from a pinned host pool into
          device blocks, as many as one full layer's misses at batch 64 (10% of 64 x 2,048) and four times
          that (a group of layers in one launch), against one DMA copy of the same bytes
    plan  the plan (kernels.hisparse_plan): B requests at 1M context, top-k 2,048, an LRU of 4,096 rows (with
          --plan-spec 3 the MTP3 shape: 4 rows of the top-k per request, 8,256 hot rows), 10% of each selection
          new per step (the state is warmed by as many steps as the LRU needs to fill); its rows ascending as
          the indexer kernels emit them, planned by a sort of the entries and by the merge of the rows
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from bench.hisparse.stack import TopkStream
from engine.hisparse.hot_buffer import HotBuffers
from engine.hisparse.layout import HotLayout
from kernels import hisparse_gather, hisparse_plan

ROW = 656
BS = 64


def _time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn over `reps` calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_copy(dev, rows_list: list[int], tiles: list[tuple[int, int]], vecs: list[int],
               pools_gib: list[float]) -> list[dict]:
    """Rows drawn uniformly from the first `pool` GiB of a pinned host pool (the pool a request's context
    spans: a smaller one is easier on the GPU's translation of host addresses)."""
    host_blocks, dev_blocks = int(max(pools_gib) * 2**30) // (BS * ROW), 4 * 64 * 80  # hot buffers: 64 req x 4 layers
    host = torch.empty((host_blocks, BS, ROW), dtype=torch.uint8).pin_memory()
    devc = torch.empty((dev_blocks, BS, ROW), dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    default = dict(hisparse_gather.COPY_TILE)
    out = []
    for n in rows_list:
        flat = host.view(-1)[: n * ROW]
        ms = _time(lambda: devc.view(-1)[: n * ROW].copy_(flat, non_blocking=True))
        out.append({"kernel": "dma", "rows": n, "ms": round(ms, 4), "gb_per_s": round(n * ROW / ms / 1e6, 1)})
        print(json.dumps(out[-1]), flush=True)
        for pool in pools_gib:
            src = torch.randint(0, int(pool * 2**30) // ROW, (n,), generator=g, device=dev)
            dst = torch.randperm(dev_blocks * BS, generator=g, device=dev)[:n]
            for vec in vecs:
                for r, w in tiles:
                    hisparse_gather.COPY_TILE.update(rows=r, warps=w, max_vec=vec)
                    ms = _time(lambda: hisparse_gather.copy_rows(host, src, devc, dst))
                    out.append({"kernel": "copy_rows", "rows": n, "pool_gib": pool, "tile_rows": r, "warps": w,
                                "vec": vec, "ms": round(ms, 4), "gb_per_s": round(n * ROW / ms / 1e6, 1)})
                    print(json.dumps(out[-1]), flush=True)
    hisparse_gather.COPY_TILE.update(default)
    return out


def _ascending(t: torch.Tensor) -> torch.Tensor:
    """Each row's valid positions ascending, then -1: a row as the indexer kernels emit it."""
    big = torch.iinfo(t.dtype).max
    s = torch.where(t >= 0, t, big).sort(dim=1).values
    return torch.where(s == big, -1, s)


def bench_plan(dev, batches: list[int], warps: list[int | None], context: int = 1048448, topk: int = 2048,
               spec: int = 0, ways: tuple[str, ...] = ("sort", "merge")) -> list[dict]:
    """`spec` drafts: each request plans 1 + spec rows of the top-k (the MTP verify rows) over a hot buffer of
    at least (1 + spec) x top-k rows; warps None = the launcher's pick. The rows come ascending (as the indexer
    kernels emit them); `ways`: "sort" plans them as rows in any order (the kernel sorts its entries), "merge"
    with rows_sorted (binary searches between the rows)."""
    layout = HotLayout.create(topk, 2 * topk, spec, BS)
    n = 1 + spec
    out = []
    for B, way in ((B, w) for B in batches for w in ways):
        merge = way == "merge"
        for nw in warps:
            hot = HotBuffers(layout, 1, B, dev)
            for s in range(B):
                hot.assign(s, list(range(s * layout.num_blocks, (s + 1) * layout.num_blocks)))
            ar = torch.arange(B, device=dev)
            entry_rows = dst_row = torch.arange(B * n, device=dev).view(B, n)
            start = torch.full((B,), context - 1, dtype=torch.int64, device=dev)
            table_slot, hot_slot = ar.clone(), ar.clone()
            hot_base = torch.full((B,), -(-context // BS) * BS, dtype=torch.int64, device=dev)
            page_table = torch.full((B, -(-context // BS) + 1), -1, dtype=torch.int32, device=dev)
            host_table = torch.arange(B * page_table.shape[1], dtype=torch.int32, device=dev).view(B, -1)
            sel = torch.empty((B * n, topk), dtype=torch.int32, device=dev)
            counters = torch.zeros(4, dtype=torch.int64, device=dev)
            stream = TopkStream(B * n, topk, 0.1, dev, seed=1)
            lens = torch.full((B * n,), context, dtype=torch.int32, device=dev)

            def step():
                hot.clock += 1
                hisparse_plan.plan_hot(_ascending(stream.next(lens)), entry_rows, start, hot_slot, table_slot,
                                       hot_base, page_table, host_table, hot.blocks, hot.row_pos, hot.stamp, 0,
                                       hot.clock, dst_row, sel, counters, ROW, BS, num_warps=nw, rows_sorted=merge)
            t0 = time.perf_counter()
            step()  # the first call compiles the kernel for this warp count (each warp count compiles once)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            for _ in range(11):  # fill the LRU (2 x top-k rows) and reach the steady hit rate
                step()
            c0 = counters.clone()
            topks = [_ascending(stream.next(lens)) for _ in range(20)]
            it = iter(topks * 2)

            def plan_only():
                hot.clock += 1
                hisparse_plan.plan_hot(next(it), entry_rows, start, hot_slot, table_slot, hot_base, page_table,
                                       host_table, hot.blocks, hot.row_pos, hot.stamp, 0, hot.clock, dst_row, sel,
                                       counters, ROW, BS, num_warps=nw, rows_sorted=merge)
            ms = _time(plan_only, reps=20, warmup=0)
            hits, misses = (counters - c0)[:2].tolist()
            out.append({"kernel": "plan", "way": way, "batch": B, "spec": spec, "lru_rows": layout.lru_rows,
                        "warps": nw,
                        "ms": round(ms, 4),
                        "first_call_s": round(first_s, 2), "hit_rate": round(hits / max(hits + misses, 1), 3)})
            print(json.dumps(out[-1]), flush=True)
    return out


def bench_launch(dev, n: int = 16, reps: int = 2000) -> list[dict]:
    """Host microseconds to launch the row copy of `n` rows: through copy_rows, through the JIT function
    directly, and through the compiled kernel's launcher (what the JIT ends with), against one torch op."""
    import time

    host = torch.zeros((64, BS, ROW), dtype=torch.uint8).pin_memory()
    devc = torch.zeros((64, BS, ROW), dtype=torch.uint8, device=dev)
    slots = torch.arange(n, device=dev)
    sw, dw = host.view(torch.int32), devc.view(torch.int32)
    words = sw.shape[-1]
    args = (sw, dw, slots, slots, n, BS, sw.stride(0), sw.stride(1), BS, dw.stride(0), dw.stride(1),
            dw, slots, BS, dw.stride(0), dw.stride(1), 0, 0)
    consts = dict(NUM_WORDS=words, VEC=4, BLOCK_R=16, BLOCK_W=256, HAS_DST2=False)
    grid = (-(-n // 16),)
    kernel = hisparse_gather._copy_rows_kernel[grid](*args, **consts, num_warps=8)
    stream = torch.cuda.current_stream().cuda_stream
    every = args + tuple(consts.values())

    def compiled():
        kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *every)

    from kernels.triton_support import CompiledKernel, _no_launch_hooks

    launcher = CompiledKernel(hisparse_gather._copy_rows_kernel)
    print(json.dumps({"no_launch_hooks": _no_launch_hooks()}), flush=True)
    x = torch.zeros(16, device=dev)
    ways = {"launcher": lambda: launcher(grid, args, consts, 8),
            "copy_rows": lambda: hisparse_gather.copy_rows(host, slots, devc, slots),
            "jit_call": lambda: hisparse_gather._copy_rows_kernel[grid](*args, **consts, num_warps=8),
            "compiled_run": compiled, "torch_add_": lambda: x.add_(1),
            "current_stream": lambda: torch.cuda.current_stream()}
    out = []
    for name, fn in ways.items():
        try:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            us = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            out.append({"kernel": "launch", "way": name, "host_us": round(us, 2)})
        except Exception as e:  # noqa: BLE001 - report what this Triton does not offer
            out.append({"kernel": "launch", "way": name, "failed": f"{type(e).__name__}: {e}"})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--copy-rows", default="13107,52428", help="rows of the copy kernel's cases ('': none)")
    p.add_argument("--tiles", default="4x1,8x2,16x4,16x8,32x4,32x8", help="rows-per-program x warps")
    p.add_argument("--vecs", default="1,4", help="largest words per access (1: the kernel before the hints)")
    p.add_argument("--pools-gib", default="2.75", help="host pool sizes the rows are drawn from")
    p.add_argument("--plan-batches", default="1,64")
    p.add_argument("--plan-warps", default="auto", help="warp counts, or auto (the launcher's pick)")
    p.add_argument("--plan-spec", type=int, default=0, help="MTP drafts: 1 + spec rows of the top-k per request")
    p.add_argument("--plan-ways", default="sort,merge", help="sort (rows in any order), merge (rows_sorted)")
    p.add_argument("--launch", action="store_true", help="only the host cost of one launch, several ways")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels.hisparse needs CUDA")
    dev = torch.device("cuda")
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    if args.launch:
        rows = bench_launch(dev)
        with open(args.out, "w") as f:
            json.dump({"command": "python -m bench.kernels.hisparse " + " ".join(argv or []),
                       "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "python": platform.python_version(), "rows": rows}, f, indent=1)
        return
    rows = bench_copy(dev, [int(n) for n in args.copy_rows.split(",")], tiles, [int(v) for v in args.vecs.split(",")],
                      [float(x) for x in args.pools_gib.split(",")]) if args.copy_rows else []
    if args.plan_batches:
        batches = [int(b) for b in args.plan_batches.split(",")]
        warps = [None if w == "auto" else int(w) for w in args.plan_warps.split(",")]
        rows += bench_plan(dev, batches, warps, spec=args.plan_spec, ways=tuple(args.plan_ways.split(",")))
    with open(args.out, "w") as f:
        json.dump({"command": "python -m bench.kernels.hisparse " + " ".join(argv or []),
                   "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "python": platform.python_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
