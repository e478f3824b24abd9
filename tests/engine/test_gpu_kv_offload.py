"""The KV offload tier on CUDA (bf16, fp8 KV, Triton): the buffer is pinned, stores and loads are DMA on the
compute stream, and a prefix the device pool evicted comes back bit for bit: the tokens equal those of an
engine that kept the prefix on the device. With HiSparse the MLA rows move host to host (after a device
sync) and the indexer keys device to host."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_ds_mla")
SP = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def turns(tiny_code):
    import difflib

    from engine.frontend.tokenizer import Tokenizer

    ids = Tokenizer(tiny_code).encode(inspect.getsource(difflib))
    prefix = ids[:512]  # 8 blocks
    return [prefix + ids[600:605], ids[1000:1900], ids[2000:2900], prefix + ids[3000:3011]]


def _serve(llm: LLM, turns) -> tuple[list[list[int]], list[int]]:
    outs = [llm.generate([t], SP)[0] for t in turns]
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _prefix_bytes(llm: LLM, turn: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    core, cache = llm.core, llm.core.runner.kv_cache
    ids = [core.kv.pool.lookup(h).block_id for h in Request("x", turn, SP).block_hashes(64)[:8]]
    return [(cache.mla[b].clone(), cache.index[b].clone()) for b in ids]


@pytest.mark.parametrize("hisparse", [False, True])
def test_cuda_tier_is_pinned_and_serves_an_evicted_prefix_bit_for_bit(tiny_code, turns, hisparse):
    kw = {"hisparse": {"host_pool_blocks": 16}} if hisparse else {}
    blocks = 96 if hisparse else 16  # HiSparse: device pages and a 65-block hot buffer; the host pool holds 16
    ref, ref_cached = _serve(LLM(str(tiny_code), num_blocks=256, **CUDA), turns)  # the prefix stays on the GPU
    assert ref_cached[3] == 512
    llm = LLM(str(tiny_code), num_blocks=blocks, kv_offloading_size=0.25, **CUDA, **kw)
    buf = llm.core.runner.kv_offload
    assert all(host.is_pinned() for _, host in buf.pairs) and buf.num_blocks > 16
    assert buf.host_copies == hisparse  # HiSparse's MLA rows live in host memory
    got, cached = [llm.generate([turns[0]], SP)[0].token_ids], []
    before = _prefix_bytes(llm, turns[0])
    for t in turns[1:]:
        (out,) = llm.generate([t], SP)
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    st = llm.get_stats()
    assert cached[-1] == 512 and st.kv_offload.num_loaded >= 8, "the prefix came back from the host tier"
    assert got == ref
    after = _prefix_bytes(llm, turns[3])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
    assert st.kv_offload.load_bytes == st.kv_offload.num_loaded * buf.block_bytes
    assert st.num_free_blocks == st.num_blocks
