"""CUDA graphs of the decode step on tiny-code (GPU only): graph replay equals the same padded forwards
run eagerly token for token, with MTP3 and with HiSparse forcing misses, across batch sizes that need
padding; one capture per bucket, none when requests join or leave. Also against --enforce-eager in
fp32 (the exact kernel modes), and HiSparse's graph decode step reads nothing back."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.hisparse.builder import HiSparseMetadataBuilder
from tests.helpers.decode_runs import run_joining_leaving, source_prompts, steps_without_syncs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8]
BF16 = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla")
FP32 = dict(device="cuda", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32")


def _graph_llm(path, capture: bool = True, whole: bool = False, **kw) -> LLM:
    """whole: greedy MTP steps as whole-step graphs (engine/runner/step_graph.py); else one graph per forward."""
    llm = LLM(str(path), enforce_eager=False, max_num_seqs=8, cuda_graph_sizes=SIZES, **kw)
    st = llm.core.runner.static
    assert st is not None and st.capture and st.graphs is not None
    if not capture:  # the same padded static forwards, run eagerly
        st.graphs = None
    if not (capture and whole):
        llm.core.runner.device_decode.step_graphs = None
    return llm


@pytest.mark.parametrize("spec", [0, 3])
def test_graph_replay_equals_eager_static(tiny_code, spec):
    kw = dict(num_blocks=256, **BF16, **({"num_speculative_tokens": spec} if spec else {}))
    eager = _graph_llm(tiny_code, capture=False, **kw)
    prompts = source_prompts(eager.tokenizer, 5)
    ref = run_joining_leaving(eager, prompts, late=2)
    llm = _graph_llm(tiny_code, **kw)
    st = llm.core.runner.static
    assert st.graphs.failed is None, st.graphs.failed
    assert st.num_captures == len(st.keys()) == len(SIZES) * (4 if spec else 1), "every key captured at start-up"
    got = run_joining_leaving(llm, prompts, late=2)
    assert got == ref
    keys = set(st.graphs.graphs)
    assert st.num_captures == len(keys) > 0, "one capture per (pass, bucket, rows)"
    assert any(bp > b for b, bp, _ in st.shapes), f"no padded batch: {dict(st.shapes)}"
    assert st.graphs.num_replays == st.num_static + st.num_reruns > st.num_captures, \
        "every static forward replays a graph"
    # new requests of the same batch sizes, joining and leaving: replay only, nothing captured again
    before = st.num_captures
    more = source_prompts(llm.tokenizer, 5, base=23)
    assert run_joining_leaving(llm, more, late=2) == run_joining_leaving(eager, more, late=2)
    assert st.num_captures == before, "a request joining or leaving re-captured a graph"
    assert llm.get_stats().num_free_blocks == 256


def test_graphs_equal_enforce_eager_fp32(tiny_code):
    """fp32 weights and KV: the graph path (padded, bound-sized indexer launches) gives the plain eager
    path's greedy tokens with MTP3."""
    kw = dict(num_blocks=256, num_speculative_tokens=3, **FP32)
    eager = LLM(str(tiny_code), enforce_eager=True, **kw)
    assert eager.core.runner.static is None
    prompts = source_prompts(eager.tokenizer, 5)
    ref = run_joining_leaving(eager, prompts, late=2)
    llm = _graph_llm(tiny_code, **kw)
    assert run_joining_leaving(llm, prompts, late=2) == ref
    assert llm.core.runner.static.graphs.failed is None, llm.core.runner.static.graphs.failed
    assert llm.core.runner.static.num_captures > 0


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_whole_step_graphs_equal_per_forward_graphs_fp32(tiny_code, async_):
    """The greedy MTP3 step as one graph per capture size gives the per-forward graphs' tokens (fp32: the
    padded requests change the GEMMs' row counts, so bf16 could differ in the last bit), captured at start-up
    only, across padded batch sizes and requests joining and leaving."""
    kw = dict(num_blocks=256, num_speculative_tokens=3, async_scheduling=async_, **FP32)
    ref_llm = _graph_llm(tiny_code, **kw)
    prompts = source_prompts(ref_llm.tokenizer, 7)
    ref = run_joining_leaving(ref_llm, prompts, late=3, tokens=20)
    del ref_llm
    llm = _graph_llm(tiny_code, whole=True, **kw)
    sg = llm.core.runner.device_decode.step_graphs
    assert sg.failed is None, sg.failed
    assert sg.num_captures == len(SIZES) == len(sg.capture_seconds), "every capture size at start-up"
    got = run_joining_leaving(llm, prompts, late=3, tokens=20)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} diverged under the whole-step graphs"
    assert sg.num_replays == sg.num_steps > 0 and llm.core.runner.device_decode.num_steps > sg.num_steps
    more = source_prompts(llm.tokenizer, 5, base=23)
    run_joining_leaving(llm, more, late=2)
    assert sg.num_captures == len(SIZES), "a request joining or leaving captured a step again"
    assert any(b < bp for b, bp, r in llm.core.runner.static.shapes if r == 4)
    assert llm.get_stats().num_free_blocks == 256


@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp8-splitk", "fp8-splitk-sm90-mla"])
def test_graphs_equal_eager_on_a_real_dimension_stack(tmp_path, weights, monkeypatch):
    """GLM-5.3 widths (4 layers, 32 routed experts, random bf16 or FP8 block-scaled weights, fp8 KV) with
    MTP3: graph replay gives the padded eager forwards' tokens across padded batch sizes, with no capture
    after start-up. fp8-splitk: every decode projection is the split-K GEMM (kernels.fp8_splitk, the default),
    whose launches share one set of tile counters inside each graph; fp8: the earlier decode launch;
    sm90-mla: sparse MLA through the warp-specialised CUDA kernel (kernels/sparse_mla_sm90.py), captured too."""
    import kernels.fp8_gemm
    import kernels.sparse_mla_sm90 as sm90
    from bench.serving.gpu_system import random_model_dir

    monkeypatch.setattr(kernels.fp8_gemm, "SPLITK_DECODE", weights.startswith("fp8-splitk"))
    sm90_launches = []
    if weights.endswith("sm90-mla"):
        launch = sm90.launch
        monkeypatch.setattr(sm90, "launch", lambda *a, **k: (sm90_launches.append(k["rows"]), launch(*a, **k))[1])

    path = random_model_dir(tmp_path / "glm4", layers=4, experts=32)
    if weights != "bf16":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        (path / "config.json").write_text(json.dumps(cfg))
    kw = dict(num_blocks=256, load_format="dummy", num_speculative_tokens=3, max_model_len=4096, **BF16)
    eager = _graph_llm(path, capture=False, **kw)
    prompts = source_prompts(eager.tokenizer, 5)
    ref = run_joining_leaving(eager, prompts, late=2)
    del eager
    torch.cuda.empty_cache()
    llm = _graph_llm(path, **kw)
    st = llm.core.runner.static
    before = st.num_captures
    assert st.graphs.failed is None and before == len(st.keys()), st.graphs.failed
    assert run_joining_leaving(llm, prompts, late=2) == ref
    assert st.num_captures == before and st.graphs.num_replays > 0
    assert any(bp > b for b, bp, _ in st.shapes)
    assert bool(sm90_launches) == weights.endswith("sm90-mla")
    if weights != "bf16":
        assert type(llm.core.runner.model.model.layers[0].self_attn.q_a_proj).__name__ == "Fp8Linear"


HOST_BLOCKS = 64
LONG = 10 * 64 + 2  # prompt tokens: more pages than the whole device pool, so no request is ever resident


def _hisparse_kw(spec: int, **kw) -> dict:
    """A device pool of 4 hot buffers and one block (code16: top-k 16): with LONG prompts every request decodes
    from its hot buffer, misses every step."""
    hot_blocks = 1 if spec == 0 else 2
    return dict(num_blocks=4 * hot_blocks + 1, hisparse={"host_pool_blocks": HOST_BLOCKS}, **kw,
                **({"num_speculative_tokens": spec} if spec else {}))


@pytest.mark.parametrize("spec", [0, 3])
def test_hisparse_graph_replay_equals_eager_static(code16, spec):
    """HiSparse decode under CUDA graphs (routing, plan, miss copies on the side stream and the new rows' backup
    all inside the graph): replay gives the same padded forwards run eagerly token for token, with misses every
    decode step, across padded batch sizes; every key captured at start-up, none when requests join or leave."""
    kw = _hisparse_kw(spec, **BF16)
    eager = _graph_llm(code16, capture=False, **kw)
    prompts = source_prompts(eager.tokenizer, 4, base=LONG)
    ref = run_joining_leaving(eager, prompts, late=2)
    llm = _graph_llm(code16, **kw)
    st = llm.core.runner.static
    assert llm.core.runner.backend.graph_safe and st.pad and isinstance(st.builder, HiSparseMetadataBuilder)
    assert st.graphs.failed is None, st.graphs.failed
    assert st.num_captures == len(st.keys()) == len(SIZES) * (4 if spec else 1), "every key captured at start-up"
    mgr = llm.core.runner.hisparse
    steps, step = [], llm.core.step

    def counted():  # (graph replays, misses) per engine step
        n, m = st.graphs.num_replays, mgr.read_counters()[1]
        out = step()
        steps.append((st.graphs.num_replays - n, mgr.read_counters()[1] - m))
        return out

    llm.core.step = counted
    got = run_joining_leaving(llm, prompts, late=2)
    assert got == ref
    assert st.graphs.failed is None, st.graphs.failed
    assert any(bp > b for b, bp, _ in st.shapes), f"no padded batch: {dict(st.shapes)}"
    assert st.graphs.num_replays == st.num_static + st.num_reruns > 0, "every static forward replays a graph"
    decode = [m for n, m in steps if n]
    assert decode and all(m > 0 for m in decode), f"a replayed decode step without misses: {steps}"
    assert llm.get_stats().hisparse.copy_path == "triton"
    assert llm.core.runner.device_decode.num_syncs == 0
    before = st.num_captures
    more = source_prompts(llm.tokenizer, 4, base=LONG + 5)
    assert run_joining_leaving(llm, more, late=2) == run_joining_leaving(eager, more, late=2)
    assert st.num_captures == before, "a request joining or leaving re-captured a graph"
    assert not mgr.residency.reqs and bool((mgr.page_table[mgr.spare_slot] == -1).all())
    assert llm.get_stats().num_free_blocks == HOST_BLOCKS


def test_hisparse_graphs_equal_enforce_eager_fp32(code16):
    """fp32 weights and KV, MTP3, misses every step: HiSparse under CUDA graphs (padded) gives the greedy tokens of
    HiSparse with --enforce-eager (unpadded, host-built routing), and of resident decode."""
    kw = _hisparse_kw(3, **FP32)
    plain = LLM(str(code16), num_blocks=64, enforce_eager=True, num_speculative_tokens=3, **FP32)
    prompts = source_prompts(plain.tokenizer, 4, base=LONG)
    resident = run_joining_leaving(plain, prompts, late=2)
    ref = run_joining_leaving(LLM(str(code16), enforce_eager=True, **kw), prompts, late=2)
    llm = _graph_llm(code16, **kw)
    assert run_joining_leaving(llm, prompts, late=2) == ref == resident
    st = llm.core.runner.static
    assert st.graphs.failed is None and st.num_captures == len(st.keys()), st.graphs.failed
    assert llm.get_stats().hisparse.misses > 0


def test_hisparse_graph_decode_step_never_syncs(code16):
    """Steady HiSparse decode under CUDA graphs, MTP3, misses every step: every launch of a step (placement,
    static build, replays, device verification and drafting) runs under sync-debug "error"; nothing is read back."""
    llm = _graph_llm(code16, **_hisparse_kw(3, **BF16))
    runner = llm.core.runner
    rids = [f"s{i}" for i in range(4)]
    for rid, p in zip(rids, source_prompts(llm.tokenizer, 4, base=LONG)):
        llm.core.add_request(Request(rid, p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    for _ in range(4):
        llm.core.step()
    captures, misses = runner.static.num_captures, runner.hisparse.read_counters()[1]
    steps_without_syncs(llm, 12)
    assert runner.device_decode.num_syncs == 0 and runner.static.num_captures == captures
    assert runner.static.graphs.failed is None, runner.static.graphs.failed
    assert runner.hisparse.read_counters()[1] > misses
    for rid in rids:
        llm.core.abort(rid)
    llm.core.step()
