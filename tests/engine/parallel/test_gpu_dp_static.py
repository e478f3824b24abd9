"""A DP × EP decode rank's planned step on one GPU (rank 0 of a group over the loopback transport,
engine/parallel/loopback.py): the captured step (one whole-step graph, the static dispatch inside) gives the
tokens of the same padded step run eagerly; replayed steps never synchronise with the host; HiSparse ranks
replay their per-forward graphs. On the CPU the same emulated rank runs its padded passes eagerly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.parallel.loopback import emulated_rank_core
from tests.helpers.decode_runs import no_sync

SIZES = [1, 2, 4, 8]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def _core(path, device: str, world: int = 8, **kw):
    llm = LLM(str(path), device=device, num_blocks=256, max_num_seqs=8, cuda_graph_sizes=SIZES,
              num_speculative_tokens=3, enforce_eager=False, **kw)
    return emulated_rank_core(llm.config, world)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(10, vocab, (20 + 7 * i,), generator=g).tolist() for i in range(n)]


def _run(core, prompts, tokens: int = 16, check=None) -> list[list[int]]:
    """Greedy, request i generates tokens + 2 i; `check(core)` wraps every launch once all requests decode."""
    rids = [f"p{i}" for i in range(len(prompts))]
    for i, (r, p) in enumerate(zip(rids, prompts)):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens + 2 * i)
        core.add_request(Request(r, list(p), sp))
    out = {r: [] for r in rids}
    launch = core.runner.execute_async
    while core.has_unfinished():
        decoding = all(q.num_computed_tokens >= q.num_prompt_tokens for q in core.scheduler.running)
        if check is not None and decoding and not core.scheduler.waiting:
            core.runner.execute_async = check(launch)
        try:
            for o in core.step():
                out[o.req_id].extend(o.new_token_ids)
        finally:
            core.runner.execute_async = launch
    core.step()
    return [out[r] for r in rids]


def test_emulated_rank_plans_every_decode_step_on_the_cpu(tiny_code):
    core = _core(tiny_code, "cpu", world=2)
    prompts = _prompts(3, core.cfg.model.vocab_size)
    _run(core, prompts)
    r = core.runner
    st = r.dp_stats()
    assert st["dynamic_steps"] >= 1 and st["planned_steps"] > 10  # the prompts dynamic, every decode step planned
    sg = r.device_decode.step_graphs
    assert sg.num_steps > 0 and sg.num_captures == 0  # whole steps, their padded body run eagerly
    assert r.comm.calls["ep_dispatch"] == r.comm.calls["ep_combine"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "fp8"])  # fp8: FP8 experts, rows dispatched as FP8 codes
def test_captured_dp_step_equals_its_eager_padded_step_without_host_syncs(tiny_code, quantization):
    kw = {"quantization": quantization} if quantization else {}
    captured = _core(tiny_code, "cuda", **kw)
    sg = captured.runner.device_decode.step_graphs
    assert sg.num_captures == len(SIZES) and captured.runner.static.num_captures > 0
    prompts = _prompts(5, captured.cfg.model.vocab_size)
    got = _run(captured, prompts, check=no_sync)  # a synchronising call inside a planned step raises
    assert sg.num_replays > 0 and captured.runner.dp_stats()["planned_steps"] > 10
    experts = next(m.experts for m in captured.runner.main_moe)
    assert experts.takes_fp8_rows == (quantization == "fp8")
    eager = _core(tiny_code, "cuda", **kw)
    eager.runner.static.graphs = None  # the same padded passes, run eagerly: no per-forward graph ...
    eager.runner.device_decode.step_graphs.graphs.clear()  # ... and no whole-step graph
    want = _run(eager, prompts)
    assert eager.runner.device_decode.step_graphs.num_replays == 0
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"request {i}: the captured DP step diverged from its eager padded step"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hisparse_rank_replays_planned_per_forward_graphs(code16):
    core = _core(code16, "cuda", hisparse={"host_pool_blocks": 64})
    graphs = core.runner.static.graphs
    assert graphs is not None and graphs.num_captures > 0
    out = _run(core, _prompts(3, core.cfg.model.vocab_size))  # HiSparse places pages on the host per step
    assert all(len(t) >= 16 for t in out)
    assert core.runner.dp_stats()["planned_steps"] > 5 and graphs.num_replays > 0
