"""Sampler and speculative verification: parameters, filtering, seeds, distribution preservation."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.runner.sampler import (
    RowParams,
    RowSpec,
    Sampler,
    draw_rows,
    filtered_probs,
    keyed_exponentials,
    sampled_order,
)
from engine.runner.speculative import StepRows, SyntheticAcceptance, acceptance_rate_for_length, verify


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-2), "max_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(stop=[""]), "stop"),
])
def test_invalid_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def _probs(logits, **kw):
    return filtered_probs(logits, RowParams.of([SamplingParams(**kw)] * logits.shape[0], logits.device))


def _rows(ids, nd, params, k, q=None, q_off=None, pos0=None):
    """StepRows of B requests with nd[b] drafts each (rows laid out back to back); pos0[b]: the position of the
    token request b's first row draws (default 100)."""
    order = sampled_order(params)
    row_start = [sum(1 + n for n in nd[:b]) for b in range(len(nd))]
    return StepRows(ids=torch.tensor(ids), row_start=torch.tensor(row_start), nd=torch.tensor(nd), nd_host=nd, k=k,
                    params=RowParams.of(params, torch.device("cpu")), order=order,
                    order_t=torch.tensor(order, dtype=torch.int64), q=q,
                    q_off=torch.tensor(q_off if q_off is not None else [0] * len(nd)),
                    pos0=torch.tensor(pos0 if pos0 is not None else [100] * len(nd)))


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.count_nonzero(_probs(logits, top_k=2)[0]) == 2
    p = _probs(logits, top_p=0.7)[0]
    assert torch.count_nonzero(p) == 2 and torch.isclose(p[0], torch.tensor(0.5 / 0.75))
    assert torch.count_nonzero(_probs(logits, min_p=0.4)[0]) == 2  # keeps p >= 0.2


def test_filters_per_row_in_one_batch():
    """Each row gets its own filters in one call, bit for bit what it gets alone or beside other rows."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(top_k=20), SamplingParams(top_p=0.8, temperature=1.3),
              SamplingParams(min_p=0.05), SamplingParams(top_k=50, top_p=0.9, min_p=0.01, temperature=0.5)]
    batch = filtered_probs(x, RowParams.of(params, x.device))
    for i, p in enumerate(params):
        alone = filtered_probs(x[i:i + 1], RowParams.of([p], x.device))[0]
        assert torch.equal(alone, batch[i])
        assert torch.isclose(alone.sum(), torch.tensor(1.0))
    assert [int(torch.count_nonzero(r)) for r in batch[1:2]] == [20]


def test_penalties_follow_vllm_semantics():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    row = RowSpec(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [1])
    x = s.penalise(logits, [row])[0]
    assert x.tolist() == [1.0, -4.0, 1.0]
    row = RowSpec(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [], [2, 2])
    assert s.penalise(logits, [row])[0].tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25]


def test_seeded_draw_independent_of_batch():
    s = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sp, seeded, greedy = SamplingParams(), SamplingParams(seed=1234), SamplingParams(temperature=0.0)
    alone, _, _ = draw_rows(s, logits[1:2], RowParams.of([seeded], logits.device), torch.tensor([7]))
    batch, _, order = draw_rows(s, logits, RowParams.of([sp, seeded, greedy], logits.device), torch.tensor([3, 7, 5]))
    assert alone[0] == batch[1] and order == [0]  # only the unseeded row draws from the engine's generator
    assert batch[2] == logits[2].argmax()  # greedy rows stay greedy and draw nothing


def test_keyed_noise_is_a_function_of_seed_position_and_token():
    e = keyed_exponentials(torch.tensor([5, 5, 6, -3]), torch.tensor([10, 11, 10, 10]), 4000)
    again = keyed_exponentials(torch.tensor([6, 5]), torch.tensor([10, 10]), 4000)
    assert torch.equal(e[2], again[0]) and torch.equal(e[0], again[1])
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2]) and not torch.equal(e[0], e[3])
    assert (e > 0).all() and torch.isfinite(e).all()
    # Exp(1): mean and variance 1, and the race picks token v with probability p_v
    assert abs(e.mean().item() - 1.0) < 0.02 and abs(e.var().item() - 1.0) < 0.05
    p = torch.softmax(torch.randn(8, generator=torch.Generator().manual_seed(2)), -1)
    n = 20000
    picks = (p / keyed_exponentials(torch.full((n,), 9), torch.arange(n), 8)).argmax(-1)
    tv = 0.5 * (torch.bincount(picks, minlength=8).float() / n - p).abs().sum().item()
    assert tv <= 0.02, tv


def test_rejection_sampling_preserves_target_distribution():
    """First emitted token over 20,000 trials (one request each, one batch) matches the target (TV <= 0.02)."""
    V, trials = 6, 20000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    d = torch.multinomial(q, trials, replacement=True, generator=g)
    logits = torch.stack([p.log().expand(trials, V), torch.randn(trials, V, generator=g)], dim=1).reshape(-1, V)
    ids = torch.stack([torch.zeros_like(d), d], dim=1).reshape(-1).tolist()
    rows = _rows(ids, [1] * trials, [SamplingParams()] * trials, k=1,
                 q=q.expand(trials, V).contiguous(), q_off=list(range(trials)))
    n_acc, emitted = verify(Sampler(torch.device("cpu"), 0), logits, rows)
    counts = torch.bincount(emitted[:, 0], minlength=V).float()
    tv = 0.5 * (counts / trials - p).abs().sum().item()
    assert tv <= 0.02, f"total variation {tv:.4f}"
    assert 0 < n_acc.sum() < trials


def test_seeded_verification_independent_of_batch():
    """A seeded request's verification gives the same tokens whatever its batch."""
    V = 40
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, V, generator=g)
    q = torch.softmax(torch.randn(3, V, generator=g), -1)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = verify(Sampler(torch.device("cpu"), 0), logits[3:7], _rows([0, 5, 6, 7], [3], [sp], 3, q=q))
    mates = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    batch = verify(Sampler(torch.device("cpu"), 1), logits,
                   _rows([0, 1, 2, 0, 5, 6, 7], [1, 0, 3], [mates[0], mates[1], sp], 3, q=q, q_off=[0, 0, 0]))
    assert batch[0][2] == alone[0][0] and torch.equal(batch[1][2, : int(alone[0][0]) + 1],
                                                      alone[1][0, : int(alone[0][0]) + 1])


def test_seeded_tokens_do_not_depend_on_drafts_or_where_the_step_starts():
    """A seeded request's token at a position is its keyed draw there: the same whether it comes as a draft
    accepted in a verify step, as the bonus token, or as the only row of a step (a prefill after a migration
    draws position p alone, the undisturbed decode drew it inside a verify step)."""
    V = 30
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, V, generator=g)  # rows predicting positions 50, 51, 52, 53
    sp = SamplingParams(temperature=1.0, seed=77)
    s = Sampler(torch.device("cpu"), 0)
    one_by_one = [int(verify(s, logits[i:i + 1], _rows([0], [0], [sp], 3, pos0=[50 + i]))[1][0, 0]) for i in range(4)]
    for drafts in ([9, 9, 9], one_by_one[:3], one_by_one[:1] + [9, 9]):  # none, all, one agreeing
        n, tokens = verify(s, logits, _rows([0, *drafts], [3], [sp], 3, pos0=[50]))
        n = int(n[0])
        assert tokens[0, : n + 1].tolist() == one_by_one[: n + 1]
        assert n == next((i for i, (d, t) in enumerate(zip(drafts, one_by_one)) if d != t), 3)


def test_greedy_verification_accepts_longest_agreeing_prefix():
    V = 5
    rows = torch.eye(V)[[2, 3, 1, 4]]  # target argmax per row: 2, 3, 1, 4
    greedy = [SamplingParams(temperature=0.0)] * 2
    n, tokens = verify(Sampler(torch.device("cpu"), 0), torch.cat([rows, rows]),
                       _rows([9, 2, 3, 0, 9, 2, 3, 1], [3, 3], greedy, 3))
    assert n.tolist() == [2, 3]
    assert tokens[0, :3].tolist() == [2, 3, 1] and tokens[1].tolist() == [2, 3, 1, 4]


def test_synthetic_acceptance_mean_length():
    a = acceptance_rate_for_length(2.99, 3)
    assert abs(a + a * a + a ** 3 - 1.99) < 1e-9
    syn = SyntheticAcceptance(2.99, 3, seed=0)
    steps = 4000
    mean = sum(1 + syn.num_accepted(3) for _ in range(steps)) / steps
    assert abs(mean - 2.99) <= 0.05, mean
