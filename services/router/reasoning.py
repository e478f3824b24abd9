"""Reasoning parsers: a model's `<think>...</think>` text split from its answer, whole or streamed.

`--reasoning-parser glm45` (GLM-4.5 through GLM-5): the reasoning is the text between `<think>` and
`</think>` at the start of the output. A chat template with thinking on ends the prompt inside an
open `<think>`; the output then starts in the reasoning (`starts_in_reasoning(prompt)` says so), and
a `<think>` the model writes again at its very start is dropped.
With `enable_thinking: false` the template closes it (`</think>`) and the router parses nothing.

Streaming: `feed(text)` takes each new piece of output text and returns `(reasoning, content)` deltas;
a tail that may be the start of a marker is held back until the next piece decides it, and `finish()`
releases it. Feeding the whole text at once gives the same split as feeding it one character at a
time, so a streamed response always assembles to the non-streamed one.
"""

from __future__ import annotations


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ThinkReasoningParser:
    """`<think>` opens the reasoning only at the very start of the output; `</think>` ends it once.
    States: start (a `<think>` may still come) -> reasoning -> content, or start -> content."""

    start, end = "<think>", "</think>"

    def __init__(self, in_reasoning: bool = False):
        self._state, self._inside = "start", in_reasoning
        self._buf = ""
        self.saw_reasoning = in_reasoning

    @classmethod
    def starts_in_reasoning(cls, prompt: str) -> bool:
        """True when the prompt leaves a `<think>` open (the template turned thinking on)."""
        tail = prompt.rstrip()
        return tail.endswith(cls.start) or tail.rfind(cls.start) > tail.rfind(cls.end)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            if self.start.startswith(self._buf) and len(self._buf) < len(self.start):
                return "", ""  # could still become <think>
            if self._buf.startswith(self.start):  # also when the prompt opened it: the model may repeat it
                self._buf, self._state, self.saw_reasoning = self._buf[len(self.start):], "reasoning", True
            else:
                self._state = "reasoning" if self._inside else "content"
        if self._state == "reasoning":
            at = self._buf.find(self.end)
            if at < 0:
                keep = _held_prefix(self._buf, self.end)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf, self._state = self._buf[:at], self._buf[at + len(self.end):], "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held tail, once the output is complete."""
        rest, self._buf = self._buf, ""
        inside = self._state == "reasoning" or (self._state == "start" and self._inside)
        return (rest, "") if inside else ("", rest)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output at once: (reasoning or None when there was none, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.saw_reasoning else None), c1 + c2


REASONING_PARSERS = {"glm45": ThinkReasoningParser}


def reasoning_parser(name: str | None):
    """The parser class named by `--reasoning-parser` (None: no parsing)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
