"""Decode runs whose batch changes under the engine: what the static-path, CUDA-graph and device-step tests compare."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import torch

from engine import LLM, SamplingParams
from engine.core.request import Request

_SEQ = itertools.count()

# greedy beside sampled requests: temperature only, top-k, top-p, min-p and all three, seeded and unseeded
MIXED = [SamplingParams(temperature=0.0),
         SamplingParams(temperature=0.8),
         SamplingParams(temperature=1.0, top_k=20, seed=1),
         SamplingParams(temperature=0.9, top_p=0.9),
         SamplingParams(temperature=1.2, min_p=0.05, seed=2),
         SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, seed=3),
         SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.1, seed=4)]


def source_prompts(tok, n: int, base: int = 17) -> list[list[int]]:
    """n prompts cut from a stdlib module's source, prompt i `base + 9 i` tokens long."""
    import difflib

    ids = tok.encode(inspect.getsource(difflib))
    return [ids[i * 300: i * 300 + base + 9 * i] for i in range(n)]


def run_joining_leaving(llm: LLM, prompts, late: int = 0, tokens: int = 12,
                        sampling: list[SamplingParams] | None = None) -> list[list[int]]:
    """Greedy (or request i with sampling[i]'s parameters), ignore_eos; request i generates tokens + 3 i (they
    leave one by one); the last `late` join two steps after the others (the batch grows mid-decode). -> each
    request's tokens, in prompt order."""
    core = llm.core
    rids = [f"j{next(_SEQ)}" for _ in prompts]
    toks = {r: [] for r in rids}

    def add(i):
        sp = sampling[i] if sampling is not None else SamplingParams(temperature=0.0)
        sp = dataclasses.replace(sp, max_tokens=tokens + 3 * i, ignore_eos=True)
        core.add_request(Request(rids[i], list(prompts[i]), sp))

    for i in range(len(prompts) - late):
        add(i)
    steps = 0
    while core.has_unfinished() or steps < 2:
        if steps == 2:
            for i in range(len(prompts) - late, len(prompts)):
                add(i)
        for o in core.step():
            toks[o.req_id].extend(o.new_token_ids)
        steps += 1
    core.step()
    return [toks[r] for r in rids]


def no_sync(launch):
    """`launch` (a runner's execute_async) run under torch.cuda.set_sync_debug_mode("error")."""
    def wrapped(sched):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


def steps_without_syncs(llm: LLM, n: int) -> None:
    """`n` engine steps whose launches run under torch.cuda.set_sync_debug_mode("error"): a synchronising CUDA
    call inside a step's launch raises (what the device step and the HiSparse graphs promise)."""
    runner = llm.core.runner
    launch = runner.execute_async
    runner.execute_async = no_sync(launch)
    try:
        for _ in range(n):
            llm.core.step()
    finally:
        runner.execute_async = launch
