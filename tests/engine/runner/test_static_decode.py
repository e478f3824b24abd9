"""The padded-bucket static-buffer decode path on CPU (what CUDA graphs replay, run without capture):
greedy tokens identical to the plain eager path, with and without MTP3, across batch sizes that need
padding and requests joining and leaving; --enforce-eager turns it off."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
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
    from engine.runner.static_decode import eager_forward

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
