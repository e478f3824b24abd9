r"""`pdserve bench serve`: random or fixed-length prompts at a request rate or a fixed concurrency,
with `vllm bench serve`'s metrics (TTFT, TPOT, ITL, E2EL percentiles, throughput, goodput).

    pdserve bench serve --url http://127.0.0.1:8000 --input-len 1024 --output-len 128 \
        --num-prompts 200 --request-rate 4 --goodput ttft:2000 tpot:50

Prompts are random token ids (unique per request, so nothing is prefix-cached); with
`--random-range-ratio r` lengths are uniform in [len·(1-r), len·(1+r)], with r = 0 they are fixed.
Arrivals follow a gamma process (`--burstiness 1` = Poisson); `--request-rate inf` sends all at once,
bounded by `--max-concurrency`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from bench.serving import results
from bench.serving.agentx import float_list
from bench.serving.client import RequestRecord, make_session, stream_completion
from bench.serving.metrics import Window, goodput, summarize
from bench.serving.progress import ProgressBar
from bench.serving.target import wait_ready


def sample_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    if mean < 1 or not 0 <= ratio < 1:
        raise ValueError(f"lengths need mean >= 1 and 0 <= --random-range-ratio < 1 (got {mean}, {ratio})")
    lo, hi = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return rng.integers(lo, hi + 1, size=n).tolist()


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    ins = sample_lengths(rng, args.input_len, args.random_range_ratio, args.num_prompts)
    outs = sample_lengths(rng, args.output_len, args.random_range_ratio, args.num_prompts)
    return [(rng.integers(args.min_token_id, vocab_size, size=n).tolist(), m) for n, m in zip(ins, outs)]


def arrival_gaps(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slo = {}
    for item in items or []:
        key, _, value = item.partition(":")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:MS pairs such as ttft:500, got {item!r}") from None
    return slo


async def run_requests(args, url: str, model: str, prompts) -> tuple[list[RequestRecord], float, float]:
    gaps = arrival_gaps(np.random.default_rng(args.seed + 1), len(prompts), args.request_rate, args.burstiness)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    records: list[RequestRecord] = []

    async with make_session() as http:
        async def one(prompt, max_tokens):
            async with limit:
                rec = await stream_completion(http, url, model, prompt, max_tokens)
                records.append(rec)

        bar = ProgressBar("serve", float(len(prompts)), lambda: {"errors": sum(r.error is not None for r in records)},
                          lambda: "run", enabled=not args.no_progress, done=lambda: len(records), unit=" req")
        bar.start()
        t0 = time.perf_counter()
        tasks = []
        for (prompt, max_tokens), gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        await asyncio.gather(*tasks)
        await bar.stop()
    return records, t0, time.perf_counter()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="default: the first of GET /v1/models")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="0: fixed lengths")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--metric-percentiles", type=float_list, default=[50, 90, 99])
    p.add_argument("--vocab-size", type=int, help="default: /v1/models, else 4096")
    p.add_argument("--min-token-id", type=int, default=16)
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", help="write the metrics as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict:
    slo = parse_goodput(args.goodput)
    info = asyncio.run(wait_ready(args.url, timeout_s=60))
    model = args.model or info["model"]
    prompts = make_prompts(args, args.vocab_size or info.get("vocab_size") or 4096)
    records, t0, t1 = asyncio.run(run_requests(args, args.url, model, prompts))
    window = Window(t0, max([t1, *(r.t_end for r in records)]))
    out = {"benchmark": "serve", "model_id": model, "num_prompts": args.num_prompts,
           "request_rate": args.request_rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
           **summarize(records, window, num_gpus=args.num_gpus, percentiles=args.metric_percentiles)}
    if slo:
        out["request_goodput"] = goodput(records, window, slo)
    out.update(input_lens=[r.prompt_len for r in records], output_lens=[r.output_tokens for r in records],
               ttfts=[r.ttft_s if r.ok else None for r in records], errors=[r.error or "" for r in records])
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 2
    keys = ["completed", "num_errors", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "request_goodput"] + [k for k in out if k.endswith("_ms")]
    width = max(len(k) for k in keys)
    print("\n".join(f"{k:<{width}}  {out[k]:.3f}" if isinstance(out.get(k), float) else f"{k:<{width}}  {out.get(k)}"
                    for k in keys if k in out))
    if args.result_file:
        results.write_json(out, args.result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
