"""The attention-backend contract (engine.attention.base), one test per backend on CPU: the torch
reference, HiSparse around it, and a CP rank's backend (one rank). The Triton backend's contract test
runs in the Triton interpreter (tests/kernels/engine/attention/test_triton_backend.py).

Each checks: the backend satisfies the protocol; its metadata builder fills static buffers (same
addresses step after step, one H2D copy each) and padding requests do not change the real rows'
results; begin_forward attaches the backend's typed per-forward state.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.hisparse.stack import Contexts, decode_meta, fill_pages, hisparse_manager, place, stack_config
from engine.attention.base import AttentionBackend
from engine.attention.metadata import build_metadata
from engine.attention.static import StaticMetadataBuilder
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config.presets import preset
from engine.hisparse.forward import FORWARD_STATE, ForwardState
from engine.kv.cache import KVCacheSpec, PagedKVCache
from engine.parallel.cp_backend import CPAttentionBackend
from engine.parallel.step import CP_STEP, CPStep, build_step

BS = 16


def _spec(topk: int = 8) -> tuple:
    cfg = preset("tiny", index_topk=topk)
    return cfg, KVCacheSpec.from_model(cfg, block_size=BS, kv_cache_dtype="float32", indexer_precision="fp32")


def _history(backend, cache, spec, tables, seq_lens, gen):
    """Every position of every request written once through `backend` (plain metadata)."""
    meta = build_metadata(positions=[p for S in seq_lens for p in range(S)],
                          slot_mapping=[t[p // BS] * BS + p % BS for t, S in zip(tables, seq_lens) for p in range(S)],
                          query_lens=list(seq_lens), seq_lens=list(seq_lens), block_tables=tables, block_size=BS,
                          device="cpu")
    T = meta.num_tokens
    backend.store_kv(cache, 0, torch.randn(T, spec.latent_dim, generator=gen),
                     torch.randn(T, spec.rope_dim, generator=gen), meta)
    backend.store_index_k(cache, 0, torch.randn(T, spec.index_head_dim, generator=gen), meta)


def _step_rows(tables, seq_lens, pad_reqs: int):
    """One decode row per request at its last position (slot -1: the history wrote it), + padding requests."""
    rows = [(t, [S - 1], S, [0], [-1]) for t, S in zip(tables, seq_lens)]
    return rows + [([], [0], 1, [0], [-1])] * pad_reqs


def test_torch_backend_contract():
    cfg, spec = _spec()
    be = TorchAttentionBackend(spec)
    assert isinstance(be, AttentionBackend) and not be.graph_safe
    gen = torch.Generator().manual_seed(0)
    tables, lens = [[3, 1, 4], [0, 5], [2]], [40, 20, 9]
    cache = PagedKVCache(spec, 8, "cpu", fill=0.0)
    _history(be, cache, spec, tables, lens, gen)
    builder = be.metadata_builder(max_rows=8, max_reqs=8, max_blocks=4, device="cpu")
    assert isinstance(builder, StaticMetadataBuilder)
    H = cfg.index_n_heads
    q_idx, w = torch.randn(3, H, spec.index_head_dim, generator=gen), torch.rand(3, H, generator=gen)
    q = torch.randn(3, cfg.num_attention_heads, spec.latent_dim + spec.rope_dim, generator=gen)
    outs, ptrs = [], set()
    for pad in (0, 1, 5):  # the same three requests, padded to 3, 4 and 8
        ids, meta, _ = builder.build(_step_rows(tables, lens, pad))
        be.begin_forward(meta)
        ptrs.add((ids.data_ptr(), meta.positions.data_ptr(), meta.block_table.data_ptr(), meta.seq_lens.data_ptr()))
        n = meta.num_tokens
        qi = torch.cat([q_idx, q_idx.new_zeros((n - 3, *q_idx.shape[1:]))])
        sel = be.indexer_topk(cache, 0, qi, torch.cat([w, w.new_zeros((n - 3, H))]), meta, cfg.index_topk)
        out, lse = be.sparse_mla(cache, 0, torch.cat([q, q.new_zeros((n - 3, *q.shape[1:]))]), sel, meta, 0.1)
        outs.append((sel[:3], out[:3], lse[:3]))
    assert len(ptrs) == 1, "the builder must hand out the same buffers every step"
    assert builder.num_h2d == 3
    for sel, out, lse in outs[1:]:
        assert torch.equal(sel, outs[0][0]) and torch.equal(out, outs[0][1]) and torch.equal(lse, outs[0][2])
    # the static metadata says what build_metadata says about the real requests
    ref = build_metadata(positions=[S - 1 for S in lens], slot_mapping=[-1] * 3, query_lens=[1] * 3,
                         seq_lens=lens, block_tables=tables, block_size=BS, device="cpu")
    sel_ref = be.indexer_topk(cache, 0, q_idx, w, ref, cfg.index_topk)
    out_ref, _ = be.sparse_mla(cache, 0, q, sel_ref, ref, 0.1)
    assert torch.equal(sel_ref, outs[0][0]) and torch.equal(out_ref, outs[0][1])


def test_hisparse_backend_contract():
    cfg = stack_config("tiny", 4)
    spec = KVCacheSpec.from_model(cfg, block_size=64, kv_cache_dtype="float32", indexer_precision="fp32")
    ctx = Contexts(context=6 * cfg.index_topk, batch=3, steps=2)
    mgr = hisparse_manager(cfg, spec, ctx, "cpu", offload_only=False)
    be = mgr.wrap(TorchAttentionBackend(spec))
    assert isinstance(be, AttentionBackend) and not be.graph_safe
    assert isinstance(be.metadata_builder(4, 4, 8, "cpu"), StaticMetadataBuilder)  # the inner backend's builder
    fill_pages(mgr.cache.mla, mgr.cache.index, spec)
    seq_len = ctx.context + 1
    place(mgr, ctx, seq_len)
    table = ctx.table("cpu")
    meta = decode_meta(table, seq_len, [f"r{b}" for b in range(ctx.batch)])
    assert FORWARD_STATE.get(meta) is None
    be.begin_forward(meta)
    fw = FORWARD_STATE.get(meta)
    assert isinstance(fw, ForwardState) and len(fw.paths) == ctx.batch
    gen = torch.Generator().manual_seed(1)
    K = cfg.index_topk
    sel = torch.stack([torch.randperm(seq_len - 1, generator=gen)[:K] for _ in range(ctx.batch)]).to(torch.int32)
    q = torch.randn(ctx.batch, cfg.num_attention_heads, spec.latent_dim + spec.rope_dim, generator=gen)
    out, lse = be.sparse_mla(mgr.cache, 0, q, sel, meta, 0.1)
    assert FORWARD_STATE.get(meta) is fw, "begin_forward's state is the one the layers use"
    # the host pool holds every row: the torch reference on it is what the device pool must give
    ref_meta = decode_meta(table, seq_len, [])
    ref_out, ref_lse = TorchAttentionBackend(spec).sparse_mla(mgr.cache, 0, q, sel, ref_meta, 0.1)
    assert mgr.stats().misses > 0, "the device pool holds hot buffers only: the selections must miss"
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


class _OneRankComm:
    """A RankComm of one rank (the collectives the CP backend uses at PCP = DCP = 1)."""

    rank, world_size = 0, 1

    def all_gather_padded(self, own: torch.Tensor, max_rows: int, tag: str) -> torch.Tensor:
        out = own.new_zeros((1, max_rows, *own.shape[1:]))
        out[0, : own.shape[0]] = own
        return out


def test_cp_backend_contract():
    cfg, spec = _spec()
    inner = TorchAttentionBackend(spec)
    be = CPAttentionBackend(inner, _OneRankComm())
    assert isinstance(be, AttentionBackend) and not be.graph_safe
    assert isinstance(be.metadata_builder(4, 4, 4, "cpu"), StaticMetadataBuilder)
    gen = torch.Generator().manual_seed(2)
    tables, lens = [[3, 1, 4], [0, 5]], [40, 20]
    caches = [PagedKVCache(spec, 8, "cpu", fill=0.0) for _ in range(2)]
    g_state = gen.get_state()
    _history(inner, caches[0], spec, tables, lens, gen)
    gen.set_state(g_state)
    par = SimpleNamespace(prefill_context_parallel_size=1, decode_context_parallel_size=1,
                          cp_kv_cache_interleave_size=1)
    runner = SimpleNamespace(cfg=SimpleNamespace(parallel=par), block_size=BS, device=torch.device("cpu"), rank=0,
                             slot_fn=lambda blocks, pos, bs: [blocks[p // bs] * bs + p % bs for p in pos])
    reqs = [SimpleNamespace(req_id=f"r{i}", block_ids=t) for i, t in enumerate(tables)]
    rows = [(r, 0, [0] * S) for r, S in zip(reqs, lens)]
    _, meta, step, _ = build_step(runner, rows, [0])
    be.begin_forward(meta)
    assert isinstance(CP_STEP.get(meta), CPStep) and CP_STEP.get(meta) is step
    T = meta.num_tokens
    latent = torch.randn(T, spec.latent_dim, generator=gen)
    rope = torch.randn(T, spec.rope_dim, generator=gen)
    be.store_kv(caches[1], 0, latent, rope, meta)
    be.store_index_k(caches[1], 0, torch.randn(T, spec.index_head_dim, generator=gen), meta)
    assert torch.equal(caches[0].mla, caches[1].mla) and torch.equal(caches[0].index, caches[1].index)
    q = torch.randn(T, cfg.num_attention_heads, spec.latent_dim + spec.rope_dim, generator=gen)
    qi = torch.randn(T, cfg.index_n_heads, spec.index_head_dim, generator=gen)
    w = torch.rand(T, cfg.index_n_heads, generator=gen)
    sel = be.indexer_topk(caches[1], 0, qi, w, meta, cfg.index_topk)
    assert torch.equal(sel, inner.indexer_topk(caches[1], 0, qi, w, meta, cfg.index_topk))
    out, _ = be.sparse_mla(caches[1], 0, q, sel, meta, 0.1)
    assert torch.equal(out, inner.sparse_mla(caches[1], 0, q, sel, meta, 0.1)[0])
    CP_STEP.put(meta, None)
    try:
        be.begin_forward(meta)
    except RuntimeError as e:
        assert "CP_STEP" in str(e)
    else:
        raise AssertionError("a CP forward without its step plan must fail clearly")


def test_derived_rows_carry_their_requests_per_request_ints():
    """`derive` (the MTP draft passes' batch, built on the device): a subset of the last build's requests, in a
    new order, takes its block-table rows and its per-request ints (HiSparse's page-table row and hot slot) with
    it; padding requests get the pad values and an empty table row; positions give slots in their own blocks."""
    b = StaticMetadataBuilder(max_rows=16, max_reqs=4, max_blocks=3, block_size=BS, device="cpu", num_req_ints=2)
    tables = [[5], [1, 2], [7, 3, 4]]
    rows = [(t, [len(t) * BS - 1], len(t) * BS, [9], [-1]) for t in tables]
    b.build(rows, req_ints=([10, 11, 12], [-1, 21, 22]))
    _, meta = b.derive(torch.tensor([BS + 3, 4]), [BS + 4, 5, 1], 3, requests=torch.tensor([2, 0]),
                       pad_req_ints=(99, -1))
    assert b.req_ints[:, :3].tolist() == [[12, 10, 99], [22, -1, -1]]
    assert meta.block_table[:, 0].tolist() == [7, 5, 0] and meta.block_table[0].tolist() == [7, 3, 4]
    assert meta.slot_mapping.tolist() == [3 * BS + 3, 5 * BS + 4, -1] and meta.seq_lens.tolist() == [BS + 4, 5, 1]
