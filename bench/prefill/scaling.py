"""PCP × DCP × EP prefill on several GPUs (NCCL) against one GPU, on a real-dimension GLM-5.3 layer stack.

    python -m bench.prefill.scaling check --pcp 2 --out check.json          # NCCL engine == one-GPU engine
    python -m bench.prefill.scaling time --pcp 1 --out t-1.json             # one GPU (= one DP rank)
    python -m bench.prefill.scaling time --pcp 2 --dcp 1 --ep --out t-2x1.json
    python -m bench.prefill.scaling time --pcp 2 --dcp 2 --ep --out t-2x2.json
    python -m bench.prefill.scaling report t-*.json check.json             # markdown tables

`check` compares the multi-rank engine (PCP = DCP = EP = --pcp) with the single-rank engine on GPU 0:
the trained tiny-code checkpoint in exact mode (fp32 weights, KV and indexer, the torch attention path:
same tolerance as the CPU tests), the same checkpoint in serving mode (bf16, fp8 KV, Triton kernels), and
the GLM-5.3 stack (random weights drawn per expert, so EP ranks hold the same experts as one GPU).

`time` measures, through the engine (scheduler, chunked prefill, paged fp8 KV, sampling), for one
configuration: TTFT of fresh prompts; a second turn (1,024 new tokens after a cached prefix); the NCCL
bytes one rank receives per layer on a 32K prompt; a step of --new tokens after a cached context of
--contexts tokens with the per-layer context all-gather prefetched (overlapped) and not; the KV capacity.
Every run sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # before any rank starts: the spawned ranks inherit the environment

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.prefill.ranks import RANKS, rank_stats, reset_comm_counters, set_kv_prefetch
from bench.prefill.stack import _ids, _time_prefill, stack_dir

TAGS = ("pcp_kv", "pcp_index", "dcp_ctx", "hidden", "ep_dispatch", "ep_combine", "ep_counts")
EXACT = dict(dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32", attention_backend="torch")
SERVING = dict(dtype="bfloat16", kv_cache_dtype="fp8_ds_mla")


def _llm(model: str, a, pcp: int, dcp: int, ep: bool, **kw):
    from engine import LLM

    return LLM(model, rank_pool=RANKS, device=a.device, prefill_context_parallel_size=pcp,
               decode_context_parallel_size=dcp,
               enable_expert_parallel=ep and pcp > 1, **kw)


def _free(llm) -> None:
    if hasattr(llm.core, "shutdown"):
        llm.core.shutdown()  # its ranks go back to RANKS: the next multi-rank engine reuses them
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _compare(ref: dict, got: dict) -> dict:
    """Per prompt: max |diff| relative to max |ref|, top-1 agreement, mean cosine; greedy tokens equal."""
    rows = {}
    for n, a in ref["logits"].items():
        b = got["logits"][n]
        rows[n] = {"rel_err": float((a - b).abs().max() / a.abs().max()),
                   "top1": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                   "cos": float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())}
    same = [x == y for x, y in zip(ref["greedy"], got["greedy"])]
    # bf16 GEMMs of other shapes round differently: report how far the sequences agree, not just whether
    agree = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
             for x, y in zip(ref["greedy"], got["greedy"])]
    return {"prompts": rows, "greedy_equal": sum(same), "greedy_total": len(same), "greedy_agree_tokens": agree}


def _probe(llm, prompts: dict[int, list[int]], greedy: list[list[int]], n: int) -> dict:
    return {"logits": {k: llm.prompt_logits(ids).float().cpu() for k, ids in prompts.items()},
            "greedy": _greedy(llm, greedy, n) if greedy else []}


def check(a) -> dict:
    tc, N = str(a.tiny_code), a.pcp
    from engine.frontend.tokenizer import Tokenizer

    tok = Tokenizer(tc)
    text = (Path(__file__).resolve().parents[2] / "engine" / "core" / "scheduler.py").read_text()
    code = tok.encode(text * 4)
    tc_prompts = {n: code[:n] for n in (1, 3, 2 * N - 1, 127, 1000, 3000)}
    greedy = [code[i * 500: i * 500 + 200 + 37 * i] for i in range(4)]
    stack = str(stack_dir(a.preset, a.layers, Path(tempfile.mkdtemp(prefix="stack-"))))
    vocab = json.loads((Path(stack) / "config.json").read_text())["vocab_size"]
    stack_prompts = {n: _ids(n, n, vocab) for n in (2 * N - 1, a.check_len // 4 + 1, a.check_len)}
    cases = {"tiny-code exact (fp32)": (tc, EXACT, tc_prompts, greedy, {}),
             "tiny-code serving (bf16, fp8 KV)": (tc, SERVING, tc_prompts, greedy, {}),
             f"{a.preset} x{a.layers} layers serving (bf16, fp8 KV)":
                 (stack, SERVING, stack_prompts, [], dict(load_format="dummy", max_model_len=a.check_len + 64))}
    out = {"pcp": N, "dcp": N, "ep": True, "cases": {}}
    for name, (model, mode, prompts, gr, extra) in cases.items():
        res = {}
        for cfg in ((1, 1, False), (N, N, True)):
            llm = _llm(model, a, *cfg, num_blocks=a.check_blocks, **mode, **extra)
            if cfg[0] > 1:
                llm.core.check_outputs = True  # every step: all ranks sampled the same tokens
            res[cfg[0]] = _probe(llm, prompts, gr, 32)
            _free(llm)
        out["cases"][name] = _compare(res[1], res[N])
        print(json.dumps({name: out["cases"][name]}), flush=True)
    return out


def _cached_step(llm, ids: list[int], cached: int) -> tuple[float, int]:
    """Time ids with ids[:cached] already primed; returns (seconds, prefix tokens the engine found cached)."""
    before = llm.get_stats().prefix_hits
    t = _time_prefill(llm, ids)
    return t, llm.get_stats().prefix_hits - before


def _comm_per_layer(llm, ids: list[int]) -> dict:
    """Bytes rank 0 received on one fresh prompt, per layer that runs the collective: the MLA and indexer
    all-gathers per attention layer (the MTP layer's KV is computed too), EP per MoE layer."""
    mc = llm.config.model
    attn, moe = mc.num_hidden_layers + 1, mc.mlp_layer_types.count("sparse") + 1
    reset_comm_counters(llm.core)
    _time_prefill(llm, ids)
    s = rank_stats(llm.core)[0]["comm_bytes"]
    per = {t: s[t] / (moe if t.startswith("ep_") else 1 if t == "hidden" else attn) for t in TAGS if s.get(t)}
    return {"prompt": len(ids), "attn_layers": attn, "moe_layers": moe, "total": sum(s.values()), **per}


def _ttft_rows(llm, a, vocab: int) -> dict:
    rows, seed = {}, 1
    for L in a.lengths:
        times = []
        for _ in range(a.reps):
            seed += 1
            times.append(_time_prefill(llm, _ids(L, seed, vocab)))
        new = min(1024, L // 4)
        ids = _ids(L, seed + 1000, vocab)
        _time_prefill(llm, ids[:L - new], 2)
        turn2, hit = _cached_step(llm, ids, L - new)
        rows[L] = {"ttft_s": statistics.median(times), "all_s": times, "second_turn_s": turn2, "second_turn_hit": hit}
        print(json.dumps({"ttft": {L: rows[L]}}), flush=True)
    return rows


def _context_sweep(llm, a, vocab: int, multi: bool) -> dict:
    """A step of a.new tokens after P cached tokens, prefetch on / off, for P in a.contexts."""
    base = _ids(max(a.contexts), 7, vocab)
    _time_prefill(llm, base, 2)
    rows, seed = {}, 100
    for P in a.contexts:
        row = {}
        for prefetch in ((True, False) if multi else (True,)):
            if multi:
                set_kv_prefetch(llm.core, prefetch)
            times, hits = [], []
            for _ in range(a.reps):
                seed += 1
                t, hit = _cached_step(llm, base[:P] + _ids(a.new, seed, vocab), P)
                times.append(t)
                hits.append(hit)
            row["on" if prefetch else "off"] = {"step_s": statistics.median(times), "all_s": times, "hit": min(hits)}
        if multi:
            set_kv_prefetch(llm.core, True)
        rows[P] = row
        print(json.dumps({"context": {P: row}}), flush=True)
    return rows


def timings(a) -> dict:
    path = str(stack_dir(a.preset, a.layers, Path(tempfile.mkdtemp(prefix="stack-"))))
    max_len = max(max(a.lengths), max(a.contexts) + a.new) + 2048
    t0 = time.perf_counter()
    llm = _llm(path, a, a.pcp, a.dcp, a.ep, load_format="dummy", max_num_batched_tokens=a.chunk,
               max_model_len=max_len, gpu_memory_utilization=a.gpu_memory_utilization, num_blocks=a.num_blocks,
               num_speculative_tokens=None, **SERVING)
    vocab, multi = llm.config.model.vocab_size, a.pcp > 1
    kv = llm.core.kv
    out = {"pcp": a.pcp, "dcp": a.dcp, "ep": a.ep and multi, "layers": a.layers, "chunk": a.chunk, "new": a.new,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "torch": torch.__version__, "build_s": time.perf_counter() - t0,
           "kv_blocks_per_rank": kv.num_blocks, "kv_capacity_tokens": kv.num_blocks * kv.tokens_per_block}
    for n in (min(4096, max(a.lengths)), min(16384, max(a.lengths))):  # compile + warm up every shape class
        _time_prefill(llm, _ids(n, 10_000 + n, vocab))
    out["ttft"] = _ttft_rows(llm, a, vocab)
    if multi:
        L = 32768 if 32768 <= max_len - 2048 else min(a.lengths)
        out["comm_bytes_per_layer"] = _comm_per_layer(llm, _ids(L, 555, vocab))
        print(json.dumps({"comm": out["comm_bytes_per_layer"]}), flush=True)
    out["context"] = _context_sweep(llm, a, vocab, multi)
    if multi:  # what a step after the longest cached context moves (DCP: the context shards)
        P = max(a.contexts)
        out["comm_context"] = {"cached": P, **_comm_per_layer(llm, _ids(P, 7, vocab) + _ids(a.new, 999, vocab))}
        print(json.dumps({"comm_context": out["comm_context"]}), flush=True)
    _free(llm)
    return out


def profile(a) -> dict:
    """torch.profiler table of rank 0 for one step of a.new tokens after max(a.contexts) cached tokens."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    path = str(stack_dir(a.preset, a.layers, Path(tempfile.mkdtemp(prefix="stack-"))))
    P = max(a.contexts)
    llm = _llm(path, a, a.pcp, a.dcp, a.ep, load_format="dummy", max_num_batched_tokens=a.chunk,
               max_model_len=P + a.new + 2048, gpu_memory_utilization=a.gpu_memory_utilization,
               num_blocks=a.num_blocks, num_speculative_tokens=None, **SERVING)
    vocab = llm.config.model.vocab_size
    base = _ids(P, 7, vocab)
    _time_prefill(llm, base, 2)
    _cached_step(llm, base + _ids(a.new, 1, vocab), P)  # warm up this shape
    if a.cprofile:  # where rank 0's host time goes, by Python function
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        t, hit = _cached_step(llm, base + _ids(a.new, 3, vocab), P)
        prof.disable()
        print(f"step {t * 1e3:.1f} ms (under cProfile)")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts, with_stack=True) as prof:
        t, hit = _cached_step(llm, base + _ids(a.new, 2, vocab), P)
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"step {t * 1e3:.1f} ms, {hit} cached")
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))
    print(prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=12,
                                                      max_name_column_width=40, max_src_column_width=100))
    _free(llm)
    return {"step_s": t, "hit": hit}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("check", "time", "profile", "report"))
    p.add_argument("files", nargs="*", help="report: the JSON files of check/time runs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--pcp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--ep", action="store_true", help="expert parallelism over the PCP ranks")
    p.add_argument("--preset", default="glm-5.3", help="shape of the stack (tiny: a CPU smoke run)")
    p.add_argument("--layers", type=int, default=6, help="layers of the glm-5.3 stack (3 dense + the rest MoE)")
    p.add_argument("--lengths", type=_ints, default=[8192, 32768, 131072, 262144])
    p.add_argument("--contexts", type=_ints, default=[8192, 32768, 65536, 131072, 253952])
    p.add_argument("--new", type=int, default=8192, help="new tokens of a context-sweep step")
    p.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per rank (default: from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tiny-code", default="checkpoints/tiny-code")
    p.add_argument("--check-len", type=int, default=4096, help="longest stack prompt of `check`")
    p.add_argument("--check-blocks", type=int, default=512)
    p.add_argument("--cprofile", action="store_true", help="profile: also rank 0's Python functions")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.what == "report":
        from bench.prefill.report import report

        print(report([json.loads(Path(f).read_text()) for f in a.files]))
        return 0
    if a.device == "cuda" and torch.cuda.device_count() < a.pcp:
        raise SystemExit(f"--pcp {a.pcp} needs {a.pcp} CUDA GPUs, found {torch.cuda.device_count()}")
    res = {"kind": a.what, **{"check": check, "time": timings, "profile": profile}[a.what](a)}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
