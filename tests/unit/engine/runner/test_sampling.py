"""Sampler and speculative verification: parameters, filtering, seeds, distribution preservation."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.runner.sampler import RowSpec, Sampler
from engine.runner.spec import SyntheticAcceptance, acceptance_rate_for_length, verify_drafts


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-2), "max_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(stop=[""]), "stop"),
])
def test_invalid_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def _row(**kw):
    return RowSpec(SamplingParams(**kw), [], [], None)


def test_filters_top_k_top_p_min_p():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.count_nonzero(s.probs(logits, [_row(top_k=2)])[0]) == 2
    p = s.probs(logits, [_row(top_p=0.7)])[0]
    assert torch.count_nonzero(p) == 2 and torch.isclose(p[0], torch.tensor(0.5 / 0.75))
    assert torch.count_nonzero(s.probs(logits, [_row(min_p=0.4)])[0]) == 2  # keeps p >= 0.2
    g = s.probs(logits, [_row(temperature=0.0)])[0]
    assert g.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_penalties_follow_vllm_semantics():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    row = RowSpec(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [1], None)
    x = s._penalised(logits.clone(), [row])[0]
    assert x.tolist() == [1.0, -4.0, 1.0]
    row = RowSpec(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [], [2, 2], None)
    assert s._penalised(logits.clone(), [row])[0].tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25]


def test_seeded_draw_independent_of_batch():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def gen():
        return torch.Generator().manual_seed(1234)

    alone = s.draw(torch.softmax(logits[1:2], -1), [gen()])
    batch = s.draw(torch.softmax(logits, -1), [None, gen(), None])
    assert alone[0] == batch[1]


def test_rejection_sampling_preserves_target_distribution():
    """First emitted token over 20,000 seeded trials matches the target softmax (TV <= 0.02)."""
    V, trials = 6, 20000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    sampler = Sampler(torch.device("cpu"), 0)
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(V)
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        target = torch.stack([p, torch.softmax(torch.randn(V, generator=gen), -1)])
        tokens, _ = verify_drafts(sampler, target, [d], q[None], greedy=False, generator=gen)
        counts[tokens[0]] += 1
    tv = 0.5 * (counts / trials - p).abs().sum().item()
    assert tv <= 0.02, f"total variation {tv:.4f}"


def test_greedy_verification_accepts_longest_agreeing_prefix():
    V = 5
    rows = torch.eye(V)[[2, 3, 1, 4]]  # target argmax per row: 2, 3, 1, 4
    tokens, n = verify_drafts(Sampler(torch.device("cpu"), 0), rows, [2, 3, 0], None, True, None)
    assert (tokens, n) == ([2, 3, 1], 2)
    tokens, n = verify_drafts(Sampler(torch.device("cpu"), 0), rows, [2, 3, 1], None, True, None)
    assert (tokens, n) == ([2, 3, 1, 4], 3)


def test_synthetic_acceptance_mean_length():
    a = acceptance_rate_for_length(2.99, 3)
    assert abs(a + a * a + a ** 3 - 1.99) < 1e-9
    syn = SyntheticAcceptance(2.99, 3, seed=0)
    steps = 4000
    mean = sum(1 + syn.num_accepted(3) for _ in range(steps)) / steps
    assert abs(mean - 2.99) <= 0.05, mean
