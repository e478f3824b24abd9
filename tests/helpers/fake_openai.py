"""A fake OpenAI-compatible streaming server for testing the benchmark clients (not a model).

It sleeps in proportion to tokens (uncached prompt tokens, then one chunk per output token), keeps a
prefix cache of chained 64-token block hashes so `usage.prompt_tokens_details.cached_tokens` is
meaningful, checks the request shape the benchmark must send, and logs every request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from engine.kv.hashing import block_hashes
from engine.parallel.dist import free_port


@dataclass
class FakeLog:
    t_arrival: float
    prompt: list[int]
    max_tokens: int
    cached_tokens: int


@dataclass
class FakeOpenAI:
    prefill_s_per_token: float = 2e-6
    decode_s_per_token: float = 2e-4
    max_model_len: int | None = 8192
    vocab_size: int | None = 4096
    usage: bool = True  # False: no usage chunk (the client must count chunks)
    fail_every: int = 0  # every n-th request answers HTTP 500
    log: list[FakeLog] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    _cache: set = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": "fake-model", "object": "model"}
        if self.max_model_len is not None:
            model["max_model_len"] = self.max_model_len
        if self.vocab_size is not None:
            model["vocab_size"] = self.vocab_size
        return web.json_response({"object": "list", "data": [model]})

    def _error(self, status: int, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                                 status=status)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return self._error(400, "prompt must be a list of token ids")
        if self.vocab_size and not all(0 <= t < self.vocab_size for t in prompt):
            return self._error(400, "token id out of vocabulary")
        if not (body.get("stream") and body.get("ignore_eos") and isinstance(max_tokens, int) and max_tokens > 0):
            return self._error(400, "expected stream=true, ignore_eos=true and max_tokens > 0")
        if self.fail_every and (len(self.log) + 1) % self.fail_every == 0:
            self.log.append(FakeLog(time.perf_counter(), prompt, max_tokens, 0))
            return self._error(500, "injected failure")
        cached = self._lookup_and_insert(prompt)
        self.log.append(FakeLog(time.perf_counter(), prompt, max_tokens, cached))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, prompt, max_tokens, cached)
        finally:
            self.in_flight -= 1

    async def _stream(self, request, body, prompt, max_tokens, cached) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep((len(prompt) - cached) * self.prefill_s_per_token)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.decode_s_per_token)
            await _send(resp, {"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, {"choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                "total_tokens": len(prompt) + max_tokens, "prompt_tokens_details": {"cached_tokens": cached}}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _lookup_and_insert(self, prompt: list[int]) -> int:
        hashes = block_hashes(prompt)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._cache:
            hit += 1
        self._cache.update(hashes)
        return hit * 64


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


class RunningFake:
    """`with RunningFake(FakeOpenAI(...)) as srv:` serves on a loopback port in a background thread."""

    def __init__(self, fake: FakeOpenAI):
        self.fake = fake
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> RunningFake:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.fake.app())
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
