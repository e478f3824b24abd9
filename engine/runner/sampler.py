"""Turning logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Sampling draws an exponential race per row, argmax(p / E) with E ~ Exp(1) — an exact draw from p —
from the request's own generator when it has a seed, so a seeded request samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams


@dataclass
class RowSpec:
    """One logits row to sample: its request's parameters and the tokens seen so far."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    eos_ids: tuple[int, ...] = ()
    grammar: bool = False  # a grammar masks this row: it decides when stopping is allowed (not min_tokens)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    # ---- distribution --------------------------------------------------------------------------
    def probs(self, logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
        """Processed target distribution per row [N, V] (one-hot of the argmax for greedy rows)."""
        x = self._penalised(logits.float().clone(), rows)
        out = torch.empty_like(x)
        for i, r in enumerate(rows):
            out[i] = _filtered_probs(x[i], r.params)
        return out

    def _penalised(self, x: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
        V = x.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if r.eos_ids and len(r.output_ids) < p.min_tokens and not r.grammar:
                stop_ids = [t for t in (*r.eos_ids, *p.stop_token_ids) if t < V]
                x[i, stop_ids] = float("-inf")
            if not p.needs_penalties:
                continue
            out_counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.long, device=x.device), minlength=V)[:V]
            if p.repetition_penalty != 1.0:
                seen = out_counts > 0
                if r.prompt_ids:
                    seen[torch.tensor(r.prompt_ids, dtype=torch.long, device=x.device)] = True
                row = x[i]
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                x[i] = torch.where(seen, penalised, row)
            x[i] -= p.frequency_penalty * out_counts.float() + p.presence_penalty * (out_counts > 0).float()
        return x

    # ---- drawing -------------------------------------------------------------------------------
    def draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row from probs [N, V] (greedy rows are one-hot, so the race returns them)."""
        noise = torch.empty_like(probs)
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g if g is not None else self.generator)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, generator: torch.Generator | None) -> float:
        return float(torch.rand((), generator=generator if generator is not None else self.generator,
                                device=self.device))

    def sample(self, logits: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
        return self.draw(self.probs(logits, rows), [r.generator for r in rows])


def _filtered_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.greedy:
        out = torch.zeros_like(x)
        out[x.argmax()] = 1.0
        return out
    x = x / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
        drop = before >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: list[int | None]) -> list[dict[int, float] | None]:
    """Raw-model logprobs (before any processing): the chosen token's plus the top-n of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list[dict[int, float] | None] = []
    for i, k in enumerate(n):
        if k is None:
            out.append(None)
            continue
        d: dict[int, float] = {}
        if k > 0:
            vals, ids = lp[i].topk(k)
            d.update(zip(ids.tolist(), vals.tolist()))
        t = int(tokens[i])
        d[t] = float(lp[i, t])
        out.append(d)
    return out
