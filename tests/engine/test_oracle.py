"""Our engine against transformers' GlmMoeDsaForCausalLM (fp32, CPU), and chunking invariance."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.helpers.hf_oracle import write_oracle_checkpoint

pytest.importorskip("transformers")

LENGTHS = (1, 37, 200)


@pytest.fixture(scope="module", params=["A", "B"])
def oracle(request, tmp_path_factory):
    path, model = write_oracle_checkpoint(request.param, tmp_path_factory.mktemp(f"hf{request.param}"))
    return path, model


def _exact_llm(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", indexer_precision="fp32",
               num_blocks=64, **kw)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_prompt_logits_match_transformers(oracle):
    path, hf = oracle
    llm = _exact_llm(path)
    vocab = hf.config.vocab_size
    for n in LENGTHS:
        ids = _prompt(n, vocab, seed=n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        ours = llm.prompt_logits(ids)
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"len {n}: max|diff| {err:.3g} vs max|logit| {ref.abs().max():.3g}"
    assert llm.get_stats().num_free_blocks == 64, "prompt_logits leaked KV blocks"


def test_sparse_selection_is_active(oracle):
    """The oracle prompts are longer than top-k, so the indexer really chooses (not dense attention)."""
    path, hf = oracle
    assert max(LENGTHS) > hf.config.index_topk
    llm = _exact_llm(path)
    backend = llm.core.runner.backend
    llm.prompt_logits(_prompt(200, hf.config.vocab_size, seed=1))
    assert backend.indexer_rows_scored > 0


@pytest.mark.parametrize("chunk", [7, 64, 1])
def test_chunked_and_token_by_token_match_one_shot(oracle, chunk):
    """Chunks of 7 and 64 tokens, and one token per step (= decode through the cache), give the logits
    of a single prefill."""
    path, hf = oracle
    ids = _prompt(200 if chunk != 1 else 120, hf.config.vocab_size, seed=7)
    whole = _exact_llm(path).prompt_logits(ids)
    chunked = _exact_llm(path, max_num_batched_tokens=chunk).prompt_logits(ids)
    err = (whole - chunked).abs().max().item()
    assert err <= 1e-4 * whole.abs().max().item(), f"chunk {chunk}: max|diff| {err:.3g}"
