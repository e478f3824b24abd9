"""A scripted stand-in for the router's Flow (not a model): `generate` yields the output a test sets,
records the prompt token ids and sampling params it was given, and fills the request's stats. The
router's HTTP and gRPC APIs run on top of it in-process, so the API layers are tested without engines.

The output is either `pieces` (one chunk each, as written) or, when `script` is set, that text split
into one token per chunk and detokenized as the engines do (so chunk borders fall where tokens do)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.tokenizer import Tokenizer
from services.router.flow import Chunk


class StubRouting:
    """The routing the router's APIs ask about: Redis is up and every role has an instance."""

    redis_ok = True

    async def require(self, role: str) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class FakeFlow:
    tokenizer: Tokenizer
    pieces: list[str] = field(default_factory=lambda: ["Hello", " world"])
    script: str | None = None  # set: the output, one token per chunk (pieces are ignored)
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    error: BaseException | None = None  # raised with the last piece (at once when there are none)
    prompts: list[list[int]] = field(default_factory=list)
    params: list = field(default_factory=list)
    routing: StubRouting = field(default_factory=StubRouting)

    def _chunks(self, params) -> list[tuple[list[int], str]]:
        if self.script is None:
            return [(self.tokenizer.encode(text) or [0], text) for text in self.pieces]
        detok = IncrementalDetokenizer(self.tokenizer, params)
        ids = self.tokenizer.encode(self.script)
        return [([t], detok.update([t]) + (detok.flush() if i == len(ids) - 1 else "")) for i, t in enumerate(ids)]

    async def generate(self, ids, params, stats, cache_salt=None):
        self.prompts.append(list(ids))
        self.params.append(params)
        stats.cached_tokens = self.cached_tokens
        chunks = self._chunks(params)
        if self.error is not None and not chunks:
            raise self.error
        for i, (token_ids, text) in enumerate(chunks):
            last = i == len(chunks) - 1
            stats.completion_tokens += len(token_ids)
            if last and self.error is not None:
                raise self.error
            yield Chunk(token_ids, text, None, self.finish_reason if last else None,
                        self.stop_reason if last else None)
