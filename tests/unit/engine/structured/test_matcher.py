"""Grammar checks, compiled-grammar caching, the per-request matcher (reasoning gate, draft rollback,
replay) and the bitmask applied to logits, on the tiny-code tokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.frontend.tokenizer import Tokenizer
from engine.structured import StructuredOutputSpec as Spec
from engine.structured.grammar import GrammarBackend, backend_for, check_spec
from engine.structured.matcher import RequestGrammar, apply_bitmask, apply_bitmask_ref, build_bitmask
from tests.conftest import TINY_CODE

VOCAB = 4096


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY_CODE)


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return backend_for(str(TINY_CODE), VOCAB, (0,))


def _allowed(g: RequestGrammar) -> torch.Tensor:
    bm, rows, _ = build_bitmask([(0, g, [])], 1, VOCAB)
    logits = torch.zeros(1, VOCAB)
    if bm is not None:
        apply_bitmask(logits, bm, rows)
    return torch.isfinite(logits[0])


@pytest.mark.parametrize("spec, msg", [
    (Spec.json_schema({"type": "frob"}), "invalid JSON schema"),
    (Spec.json_schema({"type": "object", "properties": 3}), "properties must be an object"),
    (Spec.regex("[a-"), "invalid regex"),
    (Spec.regex("(?<=a)b"), "invalid regex"),
    (Spec.grammar('root ::= undefined_rule'), "invalid grammar"),
    (Spec.grammar('start ::= "a"'), "invalid grammar"),
])
def test_bad_specs_are_rejected_without_a_tokenizer(spec, msg, backend):
    with pytest.raises(ValueError, match=msg):
        check_spec(spec)
    with pytest.raises(ValueError, match=msg):
        backend.compile(spec)


def test_compiled_grammars_are_cached_by_spec(backend):
    spec = Spec.regex("cache-[0-9]{3}")
    n = backend.num_compiles
    first = backend.compile(spec)
    assert backend.compile(Spec.regex("cache-[0-9]{3}")) is first and backend.num_compiles == n + 1


def test_mask_allows_only_grammar_tokens_and_eos_at_the_end(tok, backend):
    g = RequestGrammar(backend, Spec.regex("ab"), [5])
    ok = _allowed(g)
    assert not ok[0]  # EOS not allowed yet
    assert all(tok.decode([t]) and "ab".startswith(tok.decode([t])) for t in ok.nonzero().flatten().tolist())
    for t in tok.encode("ab"):
        assert g.advance(t)
    ok = _allowed(g)
    assert ok.nonzero().flatten().tolist() == [0]  # complete: only EOS
    assert g.advance(0) and g.is_terminated


def test_rejected_token_changes_nothing_and_rollback_restores(tok, backend):
    g = RequestGrammar(backend, Spec.choice(["alpha", "beta"]), [5], max_rollback=4)
    before = _allowed(g)
    assert not g.advance(tok.encode("zzz")[0])
    a = tok.encode("alpha")
    assert g.advance(a[0])
    assert not torch.equal(_allowed(g), before)
    g.rollback(1)
    assert torch.equal(_allowed(g), before)


def test_reasoning_gate_opens_after_the_marker_split_over_tokens(tok, backend):
    g = RequestGrammar(backend, Spec.regex("y[0-9]", reasoning_end="</think>"), tok.encode("<|user|>hi"))
    assert not g.active and bool(_allowed(g).all())  # free while thinking
    ids = tok.encode("x</think>")
    assert len(ids) > 2  # the marker is several tokens here
    for t in ids:
        assert g.advance(t)
    assert g.active
    ok = _allowed(g).nonzero().flatten().tolist()
    assert ok and all(tok.decode([t]).startswith("y") for t in ok)
    g.rollback(2)  # back inside the marker: free again, then the same tokens open it again
    assert not g.active
    for t in ids[-2:]:
        assert g.advance(t)
    assert g.active


def test_prompt_that_closed_thinking_starts_the_grammar(tok, backend):
    spec = Spec.regex("y[0-9]", reasoning_end="</think>")
    assert RequestGrammar(backend, spec, tok.encode("<|assistant|>\n</think>\n")).active
    assert not RequestGrammar(backend, spec, tok.encode("<|assistant|>\n<think>")).active


def test_drafts_masks_follow_the_accepted_prefix(tok, backend):
    g = RequestGrammar(backend, Spec.regex("abc|abd"), [5], max_rollback=4)
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    bad = tok.encode("q")[0]
    bm, rows, valid = build_bitmask([(1, g, [a, b, bad])], 5, VOCAB)
    assert rows == [1, 2, 3] and valid == [2]  # rows after the first invalid draft stay free
    logits = torch.zeros(5, VOCAB)
    apply_bitmask(logits, bm, rows)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[4]).all()
    assert bool(torch.isfinite(logits[2, a])) is False and bool(torch.isfinite(logits[2, b]))
    assert not torch.isfinite(logits[3, bad])
    assert torch.equal(_allowed(g), torch.isfinite(logits[1]))  # the matcher was rolled back


def test_a_drafted_stop_token_ends_the_rows(tok, backend):
    g = RequestGrammar(backend, Spec.regex("ab"), [5], max_rollback=4)
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    _, rows, valid = build_bitmask([(0, g, [a, b, 0])], 4, VOCAB)  # 0: EOS, then nothing may follow
    assert valid == [3] and rows == [0, 1, 2] and not g.is_terminated  # rolled back: the matcher goes on
    assert g.advance(a)


def test_replay_reaches_the_same_state(tok, backend):
    spec = Spec.json_schema({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]})
    ids = tok.encode('{"k": "v')
    live = RequestGrammar(backend, spec, [5])
    for t in ids:
        assert live.advance(t)
    again = RequestGrammar(backend, spec, [5])
    assert again.replay(ids)
    assert torch.equal(_allowed(live), _allowed(again))
    assert not RequestGrammar(backend, spec, [5]).replay(tok.encode("nope"))


def test_xgrammar_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (6, (VOCAB + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(6, VOCAB, generator=gen)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bm, [0, 2, 5])
    apply_bitmask_ref(b, bm, [0, 2, 5])
    assert torch.equal(a, b) and torch.equal(a[1], logits[1])
    assert torch.isinf(a[0]).any() and torch.isfinite(a[0]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_apply_matches_the_reference(tok, backend):
    from engine.structured.matcher import apply_backend

    g = RequestGrammar(backend, Spec.json_schema({"type": "object"}), [5])
    bm, rows, _ = build_bitmask([(1, g, [])], 3, VOCAB)
    logits = torch.randn(3, VOCAB, device="cuda")
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bm, rows)
    apply_bitmask_ref(b, bm, rows)
    assert apply_backend(a.device) == "xgrammar"  # the kernel ran, not the fallback
    assert torch.equal(a, b) and torch.equal(a[0], logits[0]) and torch.isinf(a[1]).any()
