"""TritonAttentionBackend against TorchAttentionBackend on the same metadata (tiny model shapes)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.metadata import build_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.config.presets import preset
from engine.kv.cache import KVCacheSpec, PagedKVCache
from tests.helpers.kernel_inputs import as_sets, assert_attention_close, gpu, interp, same_bytes

BLOCK = 16


def _meta(reqs: list[tuple[list[int], int]], tables: list[list[int]], device):
    """reqs: (query positions, seq_len) per request; slots follow each request's block table."""
    positions = [p for rows, _ in reqs for p in rows]
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for b, (rows, _) in enumerate(reqs) for p in rows]
    return build_metadata(positions=positions, slot_mapping=slots, query_lens=[len(r) for r, _ in reqs],
                          seq_lens=[s for _, s in reqs], block_tables=tables, block_size=BLOCK, device=device)


def check_backend(kv_dtype: str, indexer_precision: str, device, seq_lens, step_rows, num_blocks: int, topk: int):
    cfg = preset("tiny", index_topk=topk)
    spec = KVCacheSpec.from_model(cfg, block_size=BLOCK, kv_cache_dtype=kv_dtype, indexer_precision=indexer_precision)
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for S in seq_lens:
        n = -(-S // BLOCK)
        tables.append(perm[at: at + n])
        at += n
    caches = [PagedKVCache(spec, num_blocks, device, fill=float("nan")) for _ in range(2)]
    backends = [TorchAttentionBackend(spec), TritonAttentionBackend(spec)]
    # history: every position of every request written once, through each backend
    hist = _meta([(list(range(S)), S) for S in seq_lens], tables, device)
    T = hist.num_tokens
    latent = torch.randn(T, spec.latent_dim, generator=gen).to(device)
    rope = torch.randn(T, spec.rope_dim, generator=gen).to(device)
    keys = torch.randn(T, spec.index_head_dim, generator=gen).to(device)
    for be, cache in zip(backends, caches):
        be.store_kv(cache, 0, latent, rope, hist)
        be.store_index_k(cache, 0, keys, hist)
    assert same_bytes(caches[0].mla, caches[1].mla) and same_bytes(caches[0].index, caches[1].index)
    # one step: query rows at the given positions
    meta = _meta([(rows, S) for rows, S in zip(step_rows, seq_lens)], tables, device)
    H, D = cfg.index_n_heads, spec.index_head_dim
    q = torch.randn(meta.num_tokens, H, D, generator=gen).to(device)
    w = (torch.rand(meta.num_tokens, H, generator=gen) * 0.2).to(device)
    sel = [be.indexer_topk(c, 0, q, w, meta, topk) for be, c in zip(backends, caches)]
    assert sel[0].shape == sel[1].shape and sel[1].dtype == torch.int32
    # scores are summed in another order (and fp8 MMA accumulates in reduced precision on the GPU):
    # near-ties of the k-th score may flip; anything beyond that is a bug
    allowed = 0 if device == "cpu" else (2 if indexer_precision == "fp32" else topk // 50)
    for t, (a, b) in enumerate(zip(as_sets(sel[0]), as_sets(sel[1]))):
        assert len(a) == len(b) and len(set(a) ^ set(b)) <= 2 * allowed, f"row {t}: selections differ"
    assert backends[0].indexer_rows_scored == backends[1].indexer_rows_scored
    qa = torch.randn(meta.num_tokens, cfg.num_attention_heads, spec.latent_dim + spec.rope_dim, generator=gen)
    outs = [be.sparse_mla(c, 0, qa.to(device), sel[0], meta, 0.2) for be, c in zip(backends, caches)]
    assert outs[1][0].dtype == qa.dtype and outs[1][0].shape == outs[0][0].shape
    assert_attention_close(outs[1][0], outs[1][1], outs[0][0], outs[0][1])


@interp
@pytest.mark.parametrize("kv_dtype,indexer_precision", [("fp8_ds_mla", "fp8"), ("float32", "fp32")])
def test_triton_backend_matches_torch_interp(kv_dtype, indexer_precision):
    # a prefill chunk continuing a cached prompt, a decode row, a request shorter than top-k
    check_backend(kv_dtype, indexer_precision, "cpu", seq_lens=[40, 30, 5],
                  step_rows=[list(range(24, 40)), [29], [0, 1, 2, 3, 4]], num_blocks=9, topk=16)


def test_get_attention_backend():
    spec = KVCacheSpec.from_model(preset("tiny"))
    assert get_attention_backend(spec, "cpu").name == "torch"
    assert get_attention_backend(spec, "cpu", "triton").name == "triton"
    assert get_attention_backend(spec, "cuda", "torch").name == "torch"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        get_attention_backend(spec, "cpu", "flash")


@pytest.mark.parametrize("kv_dtype,indexer_precision", [("fp8_ds_mla", "fp8"), ("float32", "fp32")])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_triton_backend_matches_torch_gpu(kv_dtype, indexer_precision, mark):
    check_backend(kv_dtype, indexer_precision, "cuda", seq_lens=[3000, 700, 40],
                  step_rows=[list(range(2000, 2256)), [699], list(range(40))], num_blocks=400, topk=512)


@interp
def test_tiny_model_forward_matches_torch_backend_interp():
    """The whole tiny model (indexer, shared top-k layers, MoE) over one 40-token prompt in shuffled pages:
    the Triton backend's hidden states equal the torch backend's."""
    from engine.attention.metadata import build_metadata
    from engine.model.context import ForwardContext
    from engine.model.layers import rope_cos_sin, rope_inv_freq
    from engine.model.model import GlmDsaForCausalLM

    torch.manual_seed(0)
    cfg = preset("tiny")
    model = GlmDsaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    T, table = 40, [4, 1, 3]
    ids = torch.randint(0, cfg.vocab_size, (T,))
    hidden = []
    for name in ("torch", "triton"):
        spec = KVCacheSpec.from_model(cfg, block_size=BLOCK)
        meta = build_metadata(positions=list(range(T)), slot_mapping=[table[p // BLOCK] * BLOCK + p % BLOCK
                                                                      for p in range(T)],
                              query_lens=[T], seq_lens=[T], block_tables=[table], block_size=BLOCK, device="cpu")
        cos, sin = rope_cos_sin(meta.positions, rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta))
        ctx = ForwardContext(meta=meta, kv_cache=PagedKVCache(spec, 6, "cpu", fill=float("nan")),
                             backend=get_attention_backend(spec, "cpu", name), cos=cos, sin=sin)
        with torch.no_grad():
            hidden.append(model(ids, ctx))
    assert T > cfg.index_topk  # the sparse selection is active
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-4, atol=1e-5)


def check_contract(kv_dtype: str, indexer_precision: str, device, seq_lens, num_blocks: int, topk: int):
    """The contract (engine.attention.base) for the Triton backend: a decode step from the static builder,
    padded by a request, with `max_seq_len_bound` set (the graph-capturable launches: no host layout)
    selects and attends like the torch backend on plain metadata."""
    from engine.attention.base import AttentionBackend

    cfg = preset("tiny", index_topk=topk)
    spec = KVCacheSpec.from_model(cfg, block_size=BLOCK, kv_cache_dtype=kv_dtype, indexer_precision=indexer_precision)
    tri, ref = TritonAttentionBackend(spec), TorchAttentionBackend(spec)
    assert isinstance(tri, AttentionBackend) and tri.graph_safe
    gen = torch.Generator().manual_seed(11)
    perm = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # block 0: the padding request's
    tables, at = [], 0
    for S in seq_lens:
        n = -(-S // BLOCK)
        tables.append(perm[at: at + n])
        at += n
    cache = PagedKVCache(spec, num_blocks, device, fill=0.0)
    hist = _meta([(list(range(S)), S) for S in seq_lens], tables, device)
    T = hist.num_tokens
    ref.store_kv(cache, 0, torch.randn(T, spec.latent_dim, generator=gen).to(device),
                 torch.randn(T, spec.rope_dim, generator=gen).to(device), hist)
    ref.store_index_k(cache, 0, torch.randn(T, spec.index_head_dim, generator=gen).to(device), hist)
    width = -(-max(seq_lens) // BLOCK) + 1
    builder = tri.metadata_builder(max_rows=8, max_reqs=8, max_blocks=width, device=device)
    B = len(seq_lens)
    rows = [(t, [S - 1], S, [0], [-1]) for t, S in zip(tables, seq_lens)] + [([], [0], 1, [0], [-1])]
    _, meta, _ = builder.build(rows)
    meta.max_seq_len_bound = width * BLOCK
    plain = _meta([([S - 1], S) for S in seq_lens], tables, device)
    H = cfg.index_n_heads
    q = torch.randn(B + 1, H, spec.index_head_dim, generator=gen).to(device)
    w = (torch.rand(B + 1, H, generator=gen) * 0.2).to(device)
    sel = tri.indexer_topk(cache, 0, q, w, meta, topk)
    sel_ref = ref.indexer_topk(cache, 0, q[:B], w[:B], plain, topk)
    allowed = 0 if device == "cpu" else (2 if indexer_precision == "fp32" else topk // 50)  # near-ties
    for t, (a, b) in enumerate(zip(as_sets(sel[:B]), as_sets(sel_ref))):
        assert len(a) == len(b) and len(set(a) ^ set(b)) <= 2 * allowed, f"row {t}: selections differ"
    qa = torch.randn(B + 1, cfg.num_attention_heads, spec.latent_dim + spec.rope_dim, generator=gen).to(device)
    out, lse = tri.sparse_mla(cache, 0, qa, sel, meta, 0.2)
    ref_out, ref_lse = ref.sparse_mla(cache, 0, qa[:B], sel_ref, plain, 0.2)
    assert_attention_close(out[:B], lse[:B], ref_out, ref_lse)


@interp
def test_triton_backend_contract_interp():
    check_contract("float32", "fp32", "cpu", seq_lens=[40, 30, 5], num_blocks=9, topk=16)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_triton_backend_contract_gpu(mark):
    check_contract("fp8_ds_mla", "fp8", "cuda", seq_lens=[3000, 700, 40], num_blocks=400, topk=512)
