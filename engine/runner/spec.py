"""MTP speculative decoding: verifying drafts against the target, and the synthetic-acceptance mode.

Verification of drafts d1..dk with target distributions p_0..p_k (rows of the verify pass) and the
draft distributions q_1..q_k they were drawn from:
  greedy:    accept d_i while d_i == argmax p_{i-1}; emit the accepted drafts + argmax of the next row;
  sampled:   accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection emit a
             token from norm(max(0, p_{i-1} - q_i)); if all pass, a bonus token from p_k. This leaves the
             output distribution exactly p (standard speculative sampling).
"""

from __future__ import annotations

import torch

from engine.runner.sampler import Sampler


def verify_drafts(sampler: Sampler, target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                  greedy: bool, generator: torch.Generator | None) -> tuple[list[int], int]:
    """target_probs [k+1, V] -> (emitted tokens, number of drafts accepted)."""
    k = len(drafts)
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        n = 0
        while n < k and drafts[n] == best[n]:
            n += 1
        return drafts[:n] + [best[n]], n
    for i, d in enumerate(drafts):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([d]), 1.0)
        ratio = float(p[d]) / max(float(q[d]), 1e-30)
        if sampler.uniform(generator) < min(1.0, ratio):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p
        tok = int(sampler.draw(dist[None], [generator])[0])
        return drafts[:i] + [tok], i
    tok = int(sampler.draw(target_probs[k][None], [generator])[0])
    return list(drafts) + [tok], k


def acceptance_rate_for_length(mean_length: float, k: int) -> float:
    """Per-position acceptance a with 1 + a + a^2 + ... + a^k = mean_length (bisection; monotone in a)."""
    target = mean_length - 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticAcceptance:
    """Benchmark mode: each draft position is accepted with a fixed probability, whatever the weights,
    so every configuration gets the same speculative speed-up (mean accepted length L incl. the bonus)."""

    def __init__(self, mean_length: float, k: int, seed: int):
        self.rate = acceptance_rate_for_length(mean_length, k)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed ^ 0xACCE)

    def num_accepted(self, num_drafts: int) -> int:
        n = 0
        while n < num_drafts and float(torch.rand((), generator=self.generator)) < self.rate:
            n += 1
        return n
