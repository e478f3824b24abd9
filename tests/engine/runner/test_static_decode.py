"""The padded-bucket static-buffer decode path on CPU (what CUDA graphs replay, run without capture):
greedy tokens identical to the plain eager path, with and without MTP3, across batch sizes that need
padding and requests joining and leaving; --enforce-eager turns it off."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.hisparse.builder import HiSparseMetadataBuilder
from tests.helpers.decode_runs import run_joining_leaving, source_prompts

SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("spec", [0, 3])
def test_static_padded_decode_equals_eager(tiny_code, spec):
    kw = dict(num_blocks=128, max_num_seqs=8, cuda_graph_sizes=SIZES)
    if spec:
        kw["num_speculative_tokens"] = spec
    eager = LLM(str(tiny_code), enforce_eager=True, **kw)
    assert eager.core.runner.static is None
    prompts = source_prompts(eager.tokenizer, 5)
    ref = run_joining_leaving(eager, prompts, late=2, tokens=10)
    llm = LLM(str(tiny_code), enforce_eager=False, **kw)
    got = run_joining_leaving(llm, prompts, late=2, tokens=10)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} diverged on the static path"
    st = llm.core.runner.static
    assert st.num_captures == 0  # CPU: the same padded forwards, eagerly
    padded = {(b, bp, r) for b, bp, r in st.shapes if bp > b}
    assert padded, f"no forward needed padding: {dict(st.shapes)}"
    assert all(bp in SIZES for _, bp, _ in st.shapes)
    assert {b for b, _, _ in st.shapes} >= {3, 5}, "the batch grew and shrank across steps"
    if spec:
        assert {r for _, _, r in st.shapes} == {1, 1 + spec}  # verify / catch-up rows, and draft steps
        assert llm.get_stats().spec_accepted > 0
    assert st.builder.num_h2d == st.num_static - st.num_derived, "one host -> device copy per built forward"
    assert (st.num_derived > 0) == bool(spec), "the MTP draft passes derive their batch on the device"
    assert llm.get_stats().num_free_blocks == 128


def test_enforce_eager_and_cpu_default(tiny_code):
    assert LLM(str(tiny_code), num_blocks=16).core.runner.static is None  # CPU default: eager
    assert LLM(str(tiny_code), num_blocks=16, enforce_eager=True).core.runner.static is None
    st = LLM(str(tiny_code), num_blocks=16, enforce_eager=False, max_num_seqs=20).core.runner.static
    assert st.sizes == [1, 2, 4, 8, 16, 20]
    assert [st.bucket(n) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


def test_start_up_keys_and_padding_only_batches_write_nothing(tiny_code):
    """The keys captured at start-up on CUDA (every bucket of the target and MTP passes, with 1 and 1 + k
    rows per request); a batch of padding requests only runs through both passes and writes no KV."""
    from engine.runner.padded_batch import eager_forward

    llm = LLM(str(tiny_code), num_blocks=16, enforce_eager=False, max_num_seqs=4, num_speculative_tokens=3)
    runner = llm.core.runner
    st = runner.static
    assert st.graphs is None and st.num_captures == 0  # CPU: nothing to capture
    assert st.keys() == [(kind, size, R) for kind in ("target", "mtp") for R in (1, 4) for size in (1, 2, 4)]
    before = [runner.kv_cache.mla.clone(), runner.kv_cache.index.clone()]
    hidden_size = llm.core.cfg.model.hidden_size
    for kind, size, R in st.keys():
        batch = st.dummy(size, R)
        assert batch.key == (size, R) and batch.real_idx.numel() == 0
        assert (batch.meta.slot_mapping == -1).all()
        prev = torch.zeros((size * R, hidden_size)) if kind == "mtp" else None
        out = eager_forward(runner, kind, batch.input_ids, batch.meta, prev)
        assert out.shape[0] == size * R  # padding rows read block 0, whatever it holds
    after = [runner.kv_cache.mla, runner.kv_cache.index]
    same = all(a.view(torch.uint8).equal(b.view(torch.uint8)) for a, b in zip(before, after))
    assert same, "a padding-only batch wrote KV"


HOST_BLOCKS = 64
LONG = 10 * 64 + 2  # prompt tokens: more pages than the whole device pool, so no request is ever resident


def _hisparse_llm(code16, spec: int, eager: bool) -> LLM:
    """A device pool of 4 hot buffers and one block (code16's top-k 16): with LONG prompts every request decodes
    from its hot buffer, misses every step."""
    hot_blocks = 1 if spec == 0 else 2
    return LLM(str(code16), num_blocks=4 * hot_blocks + 1, max_num_seqs=8, cuda_graph_sizes=SIZES,
               hisparse={"host_pool_blocks": HOST_BLOCKS}, enforce_eager=eager,
               **({"num_speculative_tokens": spec} if spec else {}))


def _count_steps(llm: LLM) -> list[tuple[int, int]]:
    """(static forwards, HiSparse misses) of every engine step from now on."""
    core, st, mgr = llm.core, llm.core.runner.static, llm.core.runner.hisparse
    steps, step = [], core.step

    def counted():
        n, m = st.num_static, mgr.read_counters()[1]
        out = step()
        steps.append((st.num_static - n, mgr.read_counters()[1] - m))
        return out

    core.step = counted
    return steps


@pytest.mark.parametrize("spec", [0, 3])
def test_hisparse_static_padded_decode_equals_eager(code16, spec):
    """HiSparse decode on the padded static path (each request's routing from the static buffers, what CUDA graphs
    replay) gives the eager path's greedy tokens with misses every decode step, with and without MTP3, across batch
    sizes that need padding and requests joining and leaving; nothing leaks."""
    eager = _hisparse_llm(code16, spec, eager=True)
    prompts = source_prompts(eager.tokenizer, 4, base=LONG)
    ref = run_joining_leaving(eager, prompts, late=2, tokens=8)
    llm = _hisparse_llm(code16, spec, eager=False)
    steps = _count_steps(llm)
    assert run_joining_leaving(llm, prompts, late=2, tokens=8) == ref
    st = llm.core.runner.static
    assert st.pad and isinstance(st.builder, HiSparseMetadataBuilder) and st.num_captures == 0
    assert (st.num_derived > 0) == bool(spec), "the MTP draft passes derive their batch (and its routing) on the device"
    assert any(bp > b for b, bp, _ in st.shapes), f"no forward needed padding: {dict(st.shapes)}"
    assert {b for b, _, _ in st.shapes} >= {1, 2, 3, 4}, "the batch grew and shrank across steps"
    decode = [m for n, m in steps if n]
    assert len(decode) >= 8 // (1 + spec) and all(m > 0 for m in decode), f"a decode step without misses: {steps}"
    assert llm.core.runner.device_decode.num_steps > 0
    mgr = llm.core.runner.hisparse
    assert not mgr.residency.reqs and len(mgr.residency.free_hot) == mgr.residency.max_hot
    assert bool((mgr.page_table[mgr.spare_slot] == -1).all()) and llm.get_stats().num_free_blocks == HOST_BLOCKS


def test_hisparse_static_path_with_the_plan_kernel(code16):
    """The same with the plan and slot kernels of the GPU (kernels.hisparse_plan, in Triton's interpreter): the
    padded batch plans its padding requests too (no entries, the spare hot slot), 3 requests padded to 4. Without
    MTP (the interpreter runs every kernel of every forward; the test above covers MTP3's passes)."""
    eager = _hisparse_llm(code16, 0, eager=True)
    prompts = source_prompts(eager.tokenizer, 3, base=6 * 64 + 2)  # still more pages than this pool's 5 blocks
    ref = run_joining_leaving(eager, prompts, tokens=3)
    llm = _hisparse_llm(code16, 0, eager=False)
    llm.core.runner.hisparse.fused_plan = True
    assert run_joining_leaving(llm, prompts, tokens=3) == ref
    assert (3, 4, 1) in llm.core.runner.static.shapes and llm.get_stats().hisparse.misses > 0


def test_hisparse_padding_only_batches_change_nothing(code16):
    """Padding requests route as harmless under HiSparse: with requests decoding from their hot buffers, a batch of
    padding requests only, through every key of both passes (what start-up captures), writes no KV (host pool,
    device pool, index cache), no page table, no hot-buffer state and no counter."""
    from engine import SamplingParams
    from engine.core.request import Request
    from engine.hisparse.forward import STATIC_ROUTING
    from engine.runner.padded_batch import eager_forward

    llm = _hisparse_llm(code16, 3, eager=False)
    core, runner = llm.core, llm.core.runner
    mgr, st = runner.hisparse, runner.static
    for i, p in enumerate(source_prompts(llm.tokenizer, 4, base=LONG)):
        core.add_request(Request(f"q{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    for _ in range(4):
        core.step()
    assert mgr.residency.count_states()["host"] == 4 and mgr.read_counters()[1] > 0
    state = (runner.kv_cache.mla, runner.kv_cache.index, runner.kv_cache.pool.mla, mgr.page_table, mgr.hot.row_pos,
             mgr.hot.stamp, mgr.hot.blocks, mgr.counters)
    before = [t.clone() for t in state]
    hidden = llm.core.cfg.model.hidden_size
    for kind, size, R in st.keys():
        batch = st.dummy(size, R)
        assert STATIC_ROUTING.get(batch.meta).paths == ["pad"] * size
        eager_forward(runner, kind, batch.input_ids, batch.meta,
                      torch.zeros((size * R, hidden)) if kind == "mtp" else None)
    changed = [i for i, (a, b) in enumerate(zip(before, state)) if not a.view(torch.uint8).equal(b.view(torch.uint8))]
    assert not changed, f"a padding-only batch changed state {changed}"
    for i in range(4):
        core.abort(f"q{i}")
    core.step()


def test_capture_all_times_every_key_and_logs_progress(tiny_code, monkeypatch, caplog):
    """Start-up capture (run here through a stand-in for the CUDA graphs) records each key's time and logs
    its progress, so a slow start shows in the service's log which keys it spent on."""
    import logging

    import engine.runner.static_decode as sd

    llm = LLM(str(tiny_code), num_blocks=16, enforce_eager=False, max_num_seqs=4, num_speculative_tokens=3)
    st = llm.core.runner.static
    seen = []

    class Graphs:  # what capture_all calls of engine.runner.cuda_graphs.DecodeGraphs
        failed = None

        def static_prev(self, prev):
            return prev

        def capture(self, kind, batch, prev):
            seen.append((kind, *batch.key))
            return sd.eager_forward(llm.core.runner, kind, batch.input_ids, batch.meta, prev)

    st.graphs = Graphs()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(sd, "PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger=sd.__name__):
        st.capture_all()
    assert seen == st.keys() and list(st.capture_seconds) == st.keys()
    assert all(t > 0 for t in st.capture_seconds.values())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"capturing {len(seen)} decode graphs (sizes 1,2,4)")
    assert lines[-1].startswith(f"captured {len(seen)} decode graphs in")
    assert any(m.startswith(f"captured 1 of {len(seen)} decode graphs") for m in lines), lines
    assert llm.get_stats().num_free_blocks == 16  # padding-only batches wrote nothing
