"""Incremental detokenization and stop strings.

Decoding only the tail window keeps each step O(1) in the output length: text for the new tokens is
decode(ids[prefix:]) minus decode(ids[prefix:read]); a trailing U+FFFD means an incomplete UTF-8
sequence, so we wait for the next token before emitting it. With stop strings, the last
(longest stop - 1) characters are held back until they cannot begin a stop string, so streamed text
never has to be retracted.
"""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams
from engine.frontend.tokenizer import Tokenizer

_WINDOW = 6  # tokens of context kept in front of the new ones (byte-level merges settle within it)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tok = tokenizer
        self.params = params
        self.ids: list[int] = []
        self.output_text = ""
        self._prefix = 0
        self._read = 0
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.stop_hit: str | None = None
        self._emitted = 0  # characters of output_text already handed out

    def update(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that can be released now (stop strings applied)."""
        if self.stop_hit is None:
            self._decode(new_ids)
        hold = 0 if self.stop_hit is not None else max(self._max_stop - 1, 0)
        return self._release(len(self.output_text) - hold)

    def flush(self) -> str:
        """The held-back tail, once the request is finished."""
        return self._release(len(self.output_text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.output_text[self._emitted:upto]
        self._emitted = upto
        return out

    def _decode(self, new_ids: list[int]) -> None:
        skip = self.params.skip_special_tokens
        before_len = len(self.output_text)
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read], skip)
        full = self.tok.decode(self.ids[self._prefix:], skip)
        if full.endswith("\ufffd") or len(full) < len(prefix_text):
            return
        self.output_text += full[len(prefix_text):]
        self._prefix = max(0, len(self.ids) - _WINDOW)
        self._read = len(self.ids)
        self._check_stop(before_len)

    def _check_stop(self, before_len: int) -> None:
        if not self.params.stop:
            return
        lo = max(0, before_len - self._max_stop + 1)
        best = None
        for s in self.params.stop:
            i = self.output_text.find(s, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self.stop_hit = s
        keep = i + len(s) if self.params.include_stop_str_in_output else i
        self.output_text = self.output_text[:keep]
