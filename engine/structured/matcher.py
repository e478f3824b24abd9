"""Per-request grammar state and the per-step token bitmask.

`RequestGrammar` wraps one xgrammar GrammarMatcher: it is built from the spec when a request reaches a
runner (and replays the tokens already generated: a decode engine continuing after prefill, or a
request recomputed after preemption), advances on every emitted token, and rolls back speculated
tokens that verification rejected. With `reasoning_end` it stays closed (no mask) until that text
has been generated; the bytes of the same token after the marker are fed to the matcher.

`build_bitmask` fills one bitmask row per logits row of a step (each request's next-token row in one
batched call over threads, then the draft rows): for a request verifying drafts
d1..dk, row i is the mask after d1..di (the matcher advances through the drafts it accepts, then
rolls back), so a draft the grammar rejects has probability 0 and verification rejects it.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import xgrammar as xgr

from engine.structured.grammar import GrammarBackend
from engine.structured.spec import StructuredOutputSpec

log = logging.getLogger(__name__)

_TOKEN, _GATE, _OPEN = 0, 1, 2  # what advancing one token did (for rollback)


class RequestGrammar:
    def __init__(self, backend: GrammarBackend, spec: StructuredOutputSpec, prompt_ids: list[int],
                 max_rollback: int = 8):
        self.backend = backend
        self.matcher = xgr.GrammarMatcher(backend.compile(spec))  # xgrammar keeps all history for rollback
        self.marker = spec.reasoning_end.encode()
        self.active = not self.marker or self._closed_in(prompt_ids)
        self._tail = b""  # the end of the text generated so far, while the gate is closed
        self._log: list[tuple[int, bytes]] = []
        self._max_log = max_rollback + 1

    def _closed_in(self, prompt_ids: list[int]) -> bool:
        tail = b"".join(self._bytes(t) for t in prompt_ids[-(len(self.marker) + 4):])
        return tail.rstrip().endswith(self.marker)

    def _bytes(self, token: int) -> bytes:
        tb = self.backend.token_bytes
        return tb[token] if 0 <= token < len(tb) else b""

    @property
    def is_terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False (row untouched) while the gate is closed."""
        if not self.active:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def advance(self, token: int) -> bool:
        """Accept one generated token; False (nothing changes) when the grammar rejects it."""
        if self.active:
            if not self.matcher.accept_token(token):
                return False
            self._record(_TOKEN, b"")
            return True
        before = self._tail
        text = before + self._bytes(token)
        at = text.find(self.marker)
        if at < 0:
            self._tail = text[-(len(self.marker) - 1):] if len(self.marker) > 1 else b""
            self._record(_GATE, before)
            return True
        self.active = True
        rest = text[at + len(self.marker):]
        if rest and not self.matcher.accept_string(rest):
            log.warning("the text after the reasoning end does not start the grammar: %r", rest[:32])
        self._record(_OPEN, before)
        return True

    def _record(self, kind: int, before: bytes) -> None:
        self._log.append((kind, before))
        if len(self._log) > self._max_log:
            del self._log[0]

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (speculated tokens that were not emitted)."""
        pending = 0
        for _ in range(num_tokens):
            kind, before = self._log.pop()
            if kind == _TOKEN:
                pending += 1
                continue
            if pending:
                self.matcher.rollback(pending)
                pending = 0
            self._tail = before
            if kind == _OPEN:
                self.matcher.reset()
                self.active = False
        if pending:
            self.matcher.rollback(pending)

    def replay(self, tokens: list[int]) -> bool:
        """Advance through tokens generated elsewhere (prefill, or before a preemption)."""
        for i, t in enumerate(tokens):
            if not self.advance(t):
                log.error("generated token %d (#%d) breaks the grammar; the rest is unconstrained", t, i)
                return False
        self._log.clear()
        return True


def build_bitmask(entries: list[tuple[int, RequestGrammar, list[int]]], num_rows: int,
                  vocab_size: int) -> tuple[torch.Tensor | None, list[int], list[int]]:
    """entries: (first logits row, grammar, drafts being verified) -> (bitmask [num_rows, words] on the
    host or None when no row is constrained, the rows written, per entry the drafts the grammar accepts)."""
    if not entries:
        return None, [], []
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    firsts = [(r0, g.matcher) for r0, g, _ in entries if g.active]  # a closed gate leaves its row free
    rows: list[int] = [r0 for r0, _ in firsts]
    if len(firsts) > 1:  # the rows every request has: one call, spread over threads
        _batch().batch_fill_next_token_bitmask([m for _, m in firsts], bitmask, indices=rows)
    elif firsts:
        firsts[0][1].fill_next_token_bitmask(bitmask, firsts[0][0])
    valid: list[int] = []
    for r0, g, drafts in entries:
        n = 0
        for i, d in enumerate(drafts):
            if not g.advance(d):
                break
            n += 1
            if g.is_terminated:  # a drafted stop token: nothing after it is emitted
                break
            if g.fill(bitmask, r0 + i + 1):
                rows.append(r0 + i + 1)
        g.rollback(n)
        valid.append(n)
    return (bitmask if rows else None), sorted(rows), valid


@functools.lru_cache(maxsize=1)
def _batch() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))


_kernel_failed: dict[str, str] = {}  # device type -> why xgrammar's kernel could not run there


def apply_backend(device: torch.device) -> str:
    """Which apply runs on `device`: "xgrammar", or "torch" once xgrammar's kernel failed there."""
    return "torch" if device.type in _kernel_failed else "xgrammar"


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` -> -inf, in place (xgrammar's kernel: CPU, CUDA; else plain torch)."""
    if logits.device.type not in _kernel_failed:
        try:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=logits.shape[-1], indices=rows)
            return
        except (RuntimeError, ValueError, TypeError, ImportError) as e:
            _kernel_failed[logits.device.type] = f"{type(e).__name__}: {e}"
            log.warning("xgrammar's bitmask kernel failed on %s (%s); using the torch fill", logits.device, e)
    apply_bitmask_ref(logits, bitmask, rows)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Plain torch: unpack the 32-token words and fill -inf where a bit is 0."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device)[idx]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits.index_copy_(0, idx, torch.where(allowed, logits[idx], float("-inf")))
