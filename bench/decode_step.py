"""`python -m bench.decode_step`: the engine's decode step time, eager against the padded static path
(CUDA graphs on CUDA), and with `--async-scheduling` also that path with the next step launched before the
last one's tokens are read, at several batch sizes, with or without MTP.

Per batch size and mode: B greedy requests are prefilled, a few decode steps warm up (and capture the
graphs), then the wall-clock interval between consecutive `EngineCore.step()` returns is recorded (a
synchronous step ends with its tokens read, so that is its time; with async scheduling it is the pipeline's
period); the median is reported with the number of graph captures. On CPU the static path runs without
capture (the same padded forwards).

    python -m bench.decode_step --model checkpoints/tiny-code --batches 1,16,64 --spec 3 --async-scheduling
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.core.request import Request


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode(llm: LLM, batch: int, prompt_len: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each measured decode step of `batch` requests (all prefilled before timing)."""
    core = llm.core
    vocab = llm.core.runner.cfg.model.vocab_size
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(max_tokens=10 * (warmup + steps + 2), temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        core.add_request(Request(f"b{batch}-{i}", ids, sp))
    for _ in range(warmup + 2):  # prefill, then warm-up decode steps (captures happen here)
        core.step()
    times = []
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    for i in range(batch):
        core.abort(f"b{batch}-{i}")
    core.step()
    return times


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/tiny-code")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--spec", type=int, default=0, help="MTP draft tokens per step (0: none)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--async-scheduling", action="store_true", help="also time the static path with async scheduling")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    kw = {"num_blocks": a.num_blocks, "max_num_seqs": max(batches), "device": a.device}
    if a.spec:
        kw["num_speculative_tokens"] = a.spec
    rows = []
    modes = [("eager", True, False), ("graphs", False, False)]
    if a.async_scheduling:
        modes.append(("async", False, True))
    for mode, eager, pipelined in modes:
        llm = LLM(a.model, enforce_eager=eager, async_scheduling=pipelined, **kw)
        for b in batches:
            t = time_decode(llm, b, a.prompt_len, a.steps, a.warmup)
            st = llm.core.runner.static
            rows.append({"mode": mode, "batch": b, "median_step_ms": 1e3 * statistics.median(t),
                         "captures": st.num_captures if st is not None else 0})
            print(f"{mode:6s} B={b:3d}  step {rows[-1]['median_step_ms']:8.2f} ms  captures {rows[-1]['captures']}")
    result = {"model": a.model, "spec": a.spec, "device": str(llm.core.runner.device), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
