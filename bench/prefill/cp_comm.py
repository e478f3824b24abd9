"""PCP x DCP communication volume per engine step, per collective (≈ per layer), measured on CPU/gloo.

Every collective of a rank counts its bytes by tag (engine/parallel/dist.py: what the rank receives —
the all-gather output, the all-to-all receive buffer — or, for reduce-scatter, what it sends):

    pcp_kv     new MLA rows (latent + rope) of all ranks, once per layer        [all-gather]
    pcp_index  new indexer keys, once per full-indexer layer                     [all-gather]
    dcp_ctx    prior context shards (MLA row + index key bytes), once per layer  [all-gather, prefetched]
    hidden     final hidden rows that sampling / prompt logits read, once per forward
    ep_*       MoE token dispatch / combine, per MoE layer                       [all-to-all]
    dcp_q, dcp_cand, dcp_merge   the DCP decode path: queries, top-k candidates, LSE merge

    python -m bench.prefill.cp_comm --configs 2x1,2x2,4x4 --prompt-len 1024 --prefix-len 1024

Scenarios (one engine step each, counters of rank 0): a fresh prompt of L tokens; L new tokens after a
cached prefix of P tokens; one decode token after a context of L + 1. Also the wall time of the
prefix step with the context prefetch on and off (CPU timings are only indicative).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.prefill.ranks import RANKS, rank_stats, reset_comm_counters, set_kv_prefetch

TAGS = ("pcp_kv", "pcp_index", "dcp_ctx", "hidden", "ep_dispatch", "ep_meta", "ep_combine",
        "dcp_q", "dcp_cand", "dcp_merge")


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step_counters(core) -> dict:
    reset_comm_counters(core)
    core.step()
    s = rank_stats(core)[0]
    return {t: (s["comm_calls"].get(t, 0), s["comm_bytes"].get(t, 0)) for t in TAGS}


def _finish(core) -> None:
    while core.has_unfinished():
        core.step()


def measure(llm, L: int, P: int, reps: int) -> tuple[dict, list[float], list[float]]:
    from engine import SamplingParams
    from engine.core.request import Request

    core, vocab = llm.core, llm.config.model.vocab_size
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.add_request(Request("fresh", _ids(L, 1, vocab), sp))
    out = {"prefill": _step_counters(core), "decode": _step_counters(core)}
    _finish(core)
    prefix = _ids(P, 2, vocab)
    # max_tokens=2: a request finishing in its prefill step is freed before its blocks are published
    llm.generate([prefix], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    core.add_request(Request("warm", prefix + _ids(L, 3, vocab), sp))
    out["prefill+prefix"] = _step_counters(core)
    _finish(core)
    times = {True: [], False: []}
    for i in range(reps):
        for prefetch in (True, False):
            set_kv_prefetch(core, prefetch)
            core.add_request(Request(f"t{i}{prefetch}", prefix + _ids(L, 10 + 2 * i + prefetch, vocab), sp))
            t0 = time.perf_counter()
            core.step()
            times[prefetch].append(time.perf_counter() - t0)
            _finish(core)
    set_kv_prefetch(core, True)
    return out, times[True], times[False]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a random `tiny` preset checkpoint)")
    p.add_argument("--configs", default="2x1,2x2,4x4", help="PCPxDCP list")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    from engine import LLM
    from engine.loading.checkpoint import make_checkpoint

    model = a.model or str(make_checkpoint(tempfile.mkdtemp() + "/ckpt", preset="tiny", seed=0))
    print("bytes rank 0 received per step (collectives), by tag\n")
    print(f"| PCP×DCP | scenario | {' | '.join(TAGS)} |")
    print("|---|---|" + "---|" * len(TAGS))
    timing = []
    for cfg in a.configs.split(","):
        pcp, dcp = (int(x) for x in cfg.split("x"))
        llm = LLM(model, rank_pool=RANKS, device="cpu", dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, num_blocks=256,
                  prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp,
                  enable_expert_parallel=a.expert_parallel)
        out, on, off = measure(llm, a.prompt_len, a.prefix_len, a.reps)
        for scenario, tags in out.items():
            cells = [f"{b:,} ({c})" if c else "–" for c, b in tags.values()]
            print(f"| {pcp}×{dcp} | {scenario} | {' | '.join(cells)} |")
        timing.append((cfg, statistics.median(on), statistics.median(off)))
        llm.core.shutdown()  # its ranks go back to RANKS for the next configuration of this size
    print("\n| PCP×DCP | prefill+prefix step, prefetch on (s) | prefetch off (s) |\n|---|---|---|")
    for cfg, on, off in timing:
        print(f"| {cfg} | {on:.3f} | {off:.3f} |")


if __name__ == "__main__":
    main()
