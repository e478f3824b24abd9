"""Turning logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Every step samples all its rows in one batch, with the same code on the host path and in the device decode
step (engine/runner/device_step.py), so the two give the same tokens:

    parameters   per row on the device (`RowParams`: float32 bit patterns in int lists, so the device step
                 sends them in its one host -> device copy and the host path decodes the same ints)
    filters      temperature, top-k, softmax, top-p, min-p, one tensor op each over the rows; what a filter
                 keeps is renormalised by a second softmax (a row's own sum, never one over the batch)
    drawing      an exponential race per row, argmax(p / E) with E ~ Exp(1) — an exact draw from p, also
                 from weights that do not sum to 1. Rows without a seed take E from one call of the engine's
                 generator. A seeded request's E is a function of (seed, the position of the token drawn,
                 token id) alone (`keyed_exponentials`, a counter-based hash): its token at a position
                 depends on nothing but its seed and the distribution there — not on the batch, on which
                 engine draws it (prefill, then decode, then another decode after a migration), on how
                 many draws came before, nor on MTP's drafts (a seeded request verifies drafts against its
                 keyed draw, as a greedy one against its argmax: engine/runner/speculative.py)
    greedy rows  the argmax of their logits; they draw nothing
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams
from engine.runner.inputs import device_index


@dataclass
class RowSpec:
    """One logits row as the host processes it: its request's parameters and the tokens seen so far."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: tuple[int, ...] = ()
    grammar: bool = False  # a grammar masks this row: it decides when stopping is allowed (not min_tokens)

    @property
    def host_processed(self) -> bool:
        """Whether `Sampler.penalise` changes this row: penalties, or stop tokens masked until min_tokens."""
        p = self.params
        return p.needs_penalties or (bool(self.eos_ids) and len(self.output_ids) < p.min_tokens and not self.grammar)


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


@dataclass
class RowParams:
    """Sampling parameters of N rows as device tensors, and their SamplingParams (host: which filters run)."""

    params: list[SamplingParams]
    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0: off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32

    @staticmethod
    def encode(params: list[SamplingParams]) -> tuple[list[int], list[int], list[int], list[int]]:
        """-> int lists (temperature, top_k, top_p, min_p; floats as their float32 bits) for `decode`."""
        return ([_f32_bits(p.temperature) for p in params], [max(p.top_k, 0) for p in params],
                [_f32_bits(p.top_p) for p in params], [_f32_bits(p.min_p) for p in params])

    @classmethod
    def decode(cls, params: list[SamplingParams], cols) -> RowParams:
        """cols: `encode`'s four lists as int64 device tensors (the device step's extras)."""
        t, k, p, m = cols

        def f32(c):
            return c.to(torch.int32).view(torch.float32)

        return cls(params, f32(t), k, f32(p), f32(m))

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> RowParams:
        return cls.decode(params, torch.tensor(cls.encode(params), dtype=torch.int64).to(device))

    def select(self, rows: list[int], idx: torch.Tensor) -> RowParams:
        """The rows `rows` (host), `idx` being the same indices on the device."""
        return RowParams([self.params[i] for i in rows], self.temperature[idx], self.top_k[idx], self.top_p[idx],
                         self.min_p[idx])


def filtered_probs(x: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """Processed target distribution of each (non-greedy) row of x [N, V]: temperature, top-k, softmax, top-p,
    min-p, renormalised. A filter runs when some row uses it; a row that does not use it comes out of it
    bit for bit unchanged, so which filters the other rows use does not change a row's distribution."""
    V = x.shape[-1]
    x = x.float() / rp.temperature[:, None]
    ks = [p.top_k for p in rp.params if 0 < p.top_k < V]
    if ks:
        k = rp.top_k
        on = (k > 0) & (k < V)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k.clamp(1, max(ks)) - 1)[:, None])
        x = x.masked_fill(on[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    keep = None
    if any(p.top_p < 1.0 for p in rp.params):
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        drop = (before >= rp.top_p[:, None]) & (rp.top_p < 1.0)[:, None]
        keep = torch.empty_like(drop).scatter_(1, order, ~drop)
    if any(p.min_p > 0.0 for p in rp.params):
        above = probs >= rp.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        keep = above if keep is None else keep & above
    if keep is None:
        return probs
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)


def sampled_order(params: list[SamplingParams]) -> list[int]:
    """The rows that draw from the engine's generator (one call for all of them): non-greedy, no seed."""
    return [i for i, p in enumerate(params) if not p.greedy and p.seed is None]


def seeded_rows(params: list[SamplingParams]) -> list[int]:
    """The rows that draw keyed noise (`keyed_exponentials`): non-greedy with a seed."""
    return [i for i, p in enumerate(params) if not p.greedy and p.seed is not None]


_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2^31: a 32-bit value times it stays inside int64 on every device


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def keyed_exponentials(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[n, V] Exp(1) noise where row i is a function of (seeds[i], positions[i]) and the token id alone
    (int64 [n] each): the same numbers on any device, in any batch, at any step. Two independent 32-bit hashes
    per entry make a 64-bit uniform; E = -log(u)."""
    seeds, positions = seeds.long(), positions.long()
    key = _mix32(_mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))[:, None]
    v = torch.arange(V, dtype=torch.int64, device=seeds.device)[None, :]
    hi = _mix32(key ^ _mix32(v))
    lo = _mix32(hi ^ _mix32((v + 0x9E3779B9) & _MASK32) ^ 0x5BD1E995)
    u = ((hi.double() * 2.0 ** 32 + lo.double() + 0.5) * 2.0 ** -64).clamp_(max=1.0 - 2.0 ** -53)  # in (0, 1)
    return (-torch.log(u)).float()


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    # ---- host-side logits processing ------------------------------------------------------------
    def penalise(self, x: torch.Tensor, rows: list[RowSpec]) -> torch.Tensor:
        """min_tokens (stop tokens masked) and the repetition / frequency / presence penalties: x itself when
        no row needs them, else a processed copy."""
        if not any(r.host_processed for r in rows):
            return x
        x, V = x.clone(), x.shape[1]
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

    # ---- random numbers (the rows without a seed: one call of the engine's generator) ---------------
    def exponentials(self, n: int, V: int) -> torch.Tensor:
        """[n, V] Exp(1)."""
        return torch.empty((n, V), device=self.device).exponential_(generator=self.generator)

    def uniforms(self, n: int, k: int) -> torch.Tensor:
        """[n, k] U(0, 1)."""
        u = torch.zeros((n, k), device=self.device)
        if n and k:
            u.uniform_(generator=self.generator)
        return u


def keyed_draws(x: torch.Tensor, rp: RowParams, rows: list[int], positions: torch.Tensor) -> torch.Tensor:
    """The seeded rows' tokens: row rows[i] of x drawn from its distribution with the keyed noise of its
    request's seed at positions[i] (the sequence position of the token drawn), one per row."""
    idx = device_index(rows, x.device)
    seeds = device_index([rp.params[i].seed for i in rows], x.device)  # pinned, non-blocking: no sync
    probs = filtered_probs(x[idx], rp.select(rows, idx))
    return (probs / keyed_exponentials(seeds, positions, x.shape[-1])).argmax(dim=-1)


def draw_rows(sampler: Sampler, x: torch.Tensor, rp: RowParams,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """One token per row of x [n, V] (rows of different requests: the MTP draft steps); `positions` [n]: the
    sequence position of each row's token (what a seeded row's draw is keyed on). -> (tokens [n], the
    distributions the unseeded non-greedy rows drew from [S, V], which rows those are, in `sampled_order`). A
    seeded row's draw is coupled to the target's keyed draw at the same position, so its drafts are accepted
    as often as the two distributions agree; it keeps no distribution."""
    tokens = x.argmax(dim=-1)
    seeded = seeded_rows(rp.params)
    if seeded:
        if positions is None:
            raise ValueError("seeded rows need the positions of the tokens they draw")
        idx = device_index(seeded, x.device)
        tokens.index_copy_(0, idx, keyed_draws(x, rp, seeded, positions[idx]))
    order = sampled_order(rp.params)
    if not order:
        return tokens, None, []
    idx = device_index(order, x.device)
    probs = filtered_probs(x[idx], rp.select(order, idx))
    tokens.index_copy_(0, idx, (probs / sampler.exponentials(len(order), x.shape[-1])).argmax(dim=-1))
    return tokens, probs, order


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
