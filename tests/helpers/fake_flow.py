"""A scripted stand-in for the router's Flow (not a model): `generate` yields the text pieces a test
sets, records the prompt token ids it was given, and fills the request's stats. The router's HTTP
API runs on top of it in-process, so the API layers are tested without engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.frontend.tokenizer import Tokenizer
from services.router.flow import Chunk


@dataclass
class _Routing:
    redis_ok: bool = True


@dataclass
class FakeFlow:
    tokenizer: Tokenizer
    pieces: list[str] = field(default_factory=lambda: ["Hello", " world"])
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    error: BaseException | None = None  # raised with the last piece (at once when there are none)
    prompts: list[list[int]] = field(default_factory=list)
    params: list = field(default_factory=list)
    routing: _Routing = field(default_factory=_Routing)

    async def generate(self, ids, params, stats, cache_salt=None):
        self.prompts.append(list(ids))
        self.params.append(params)
        stats.cached_tokens = self.cached_tokens
        if self.error is not None and not self.pieces:
            raise self.error
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            token_ids = self.tokenizer.encode(text) or [0]
            stats.completion_tokens += len(token_ids)
            if last and self.error is not None:
                raise self.error
            yield Chunk(token_ids, text, None, self.finish_reason if last else None,
                        self.stop_reason if last else None)
