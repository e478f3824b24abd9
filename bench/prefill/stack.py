"""Single-GPU prefill of a real-dimension GLM-5.3 layer stack (random weights, fp8 KV, Triton kernels).

    python -m bench.prefill.stack --layers 4 --lengths 8192,32768,131072 --out prefill.json

Measures, through the engine (scheduler, chunked prefill, paged fp8 KV), after `--warmup` untimed passes of each
length's shapes (a fresh prompt, a cached second turn and each PCP size's rank-0 chunks: Triton compiles a kernel
variant the first time a shape needs it, which otherwise lands in the timed figures):
  * TTFT of one fresh prompt per length (median of --reps, distinct tokens so nothing is cached);
  * TTFT of a second turn: 1,024 new tokens (L/4 for short L) after a cached prefix, L in all;
  * the per-rank work of a PCP-N step on one GPU: rank 0's two DualChunkSwap chunks (chunk 0 and chunk
    2N-1 of 2N) computed with everything before each chunk cached — the compute one rank does,
    without the all-gathers — and the speed-up bound T(1 rank) / T(rank 0).
With `--layers` of the 78 the figures are per stack; `per_layer_ms` divides by the layer count (the
embedding and lm_head are included once, so it slightly overstates a layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def stack_dir(preset: str, layers: int, out: Path) -> Path:
    from engine.config.presets import preset_dict

    d = preset_dict(preset, num_hidden_layers=layers)
    d.pop("indexer_types", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(d))
    return out


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab // 8, vocab - 1, (n,), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_prefill(llm, ids: list[int], max_tokens: int = 1) -> float:
    """Seconds of `llm.generate` (greedy, `max_tokens`), device work included."""
    from engine import SamplingParams

    _sync()
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    _sync()
    return time.perf_counter() - t


def _cached_tail(llm, ids: list[int], start: int, end: int) -> float:
    """Time computing ids[start:end] with ids[:start] already in the prefix cache."""
    if start:
        _time_prefill(llm, ids[:start])
    return _time_prefill(llm, ids[:end])


def _pcp_sizes(sizes: list[int], L: int) -> list[int]:
    """The PCP sizes whose 2N chunks of an L-token prompt are whole pages (64 tokens)."""
    return [n for n in sizes if (L // (2 * n)) % 64 == 0]


def _pcp_rank0(llm, ids: list[int], n: int) -> float:
    """Seconds of PCP-n rank 0's work on ids: chunk 0, then chunk 2n-1 after the rest is cached."""
    c = len(ids) // (2 * n)
    return _cached_tail(llm, ids, 0, c) + _cached_tail(llm, ids, (2 * n - 1) * c, 2 * n * c)


def run(args) -> dict:
    from engine import LLM

    path = stack_dir(args.preset, args.layers, Path(tempfile.mkdtemp(prefix="stack-")))
    cpu = args.device == "cpu"
    llm = LLM(str(path), device=args.device, dtype="float32" if cpu else "bfloat16", kv_cache_dtype="fp8_ds_mla",
              load_format="dummy", num_blocks=4096 if cpu else None,
              max_num_batched_tokens=args.chunk, max_model_len=max(args.lengths) + 2048,
              gpu_memory_utilization=0.85, num_speculative_tokens=None)
    if args.indexer != "auto":
        backend = llm.core.runner.backend
        if not hasattr(type(backend), "indexer_impl"):
            raise SystemExit(f"--indexer needs the Triton attention backend, this engine runs {backend.name!r}")
        backend.indexer_impl = args.indexer
    vocab = llm.config.model.vocab_size
    _time_prefill(llm, _ids(min(4096, max(args.lengths)), 0, vocab))  # compile + warm up
    out = {"preset": args.preset, "layers": args.layers, "chunk": args.chunk, "indexer": args.indexer, "lengths": {},
           "device": torch.cuda.get_device_name() if not cpu else "cpu"}
    seed = 1
    for L in args.lengths:
        print(f"length {L}: {args.warmup} warm-up pass(es), then timed", file=sys.stderr, flush=True)
        new = min(1024, L // 4)  # the second turn's new tokens
        for _ in range(args.warmup):
            seed += 1
            _time_prefill(llm, _ids(L, seed, vocab))
            _cached_tail(llm, _ids(L - new, seed + 3000, vocab) + _ids(new, seed + 4000, vocab), L - new, L)
            for n in _pcp_sizes(args.pcp, L):
                _pcp_rank0(llm, _ids(L, seed + 6000 + n, vocab), n)
        times = []
        for _ in range(args.reps):
            seed += 1
            times.append(_time_prefill(llm, _ids(L, seed, vocab)))
        base = _ids(L - new, seed + 1000, vocab)
        turn2 = _cached_tail(llm, base + _ids(new, seed + 2000, vocab), L - new, L)
        row = {"ttft_s": statistics.median(times), "all_s": times, "second_turn_s": turn2,
               "per_layer_ms": 1e3 * statistics.median(times) / args.layers, "pcp_rank0": {}}
        for n in _pcp_sizes(args.pcp, L):
            seed += 1
            rank = _pcp_rank0(llm, _ids(L, seed + 5000, vocab), n)
            row["pcp_rank0"][n] = {"rank0_s": rank, "speedup_bound": row["ttft_s"] / rank,
                                   "efficiency": row["ttft_s"] / rank / n}
        out["lengths"][L] = row
        print(json.dumps({L: row}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill.stack", description=__doc__)
    p.add_argument("--preset", default="glm-5.3", help="shape of the stack (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    p.add_argument("--pcp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed passes of each length's shapes first")
    p.add_argument("--indexer", choices=("auto", "fused", "radix"), default="auto",
                   help="the indexer's kernel path (auto: fused on sm_90+)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("bench.prefill.stack needs a CUDA GPU (or --device cpu with --preset tiny)")
    res = run(a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
