"""Chat-completions stream chunks as Anthropic's SSE events.

    message_start  (usage counted so far: none; the totals come in message_delta)
    ping
    per block, in the order the model wrote them:
        content_block_start {index, content_block: thinking | text | tool_use{id, name, input: {}}}
        content_block_delta {index, delta: thinking_delta | text_delta | input_json_delta}...
        content_block_stop  {index}
    message_delta  {delta: {stop_reason, stop_sequence}, usage: totals}
    message_stop
A chat delta of another kind (reasoning after text, a new tool call index) closes the open block and
opens the next. Tool arguments go out as `input_json_delta.partial_json` fragments exactly as the
chat stream gives them; their concatenation is the call's JSON input. An error chunk becomes an
`error` event and ends the stream (no message_stop). `with_pings` interleaves `ping` events while
the model is silent (a long prefill), so proxies keep the connection open.
"""

from __future__ import annotations

import asyncio
import json

from services.router.anthropic import response
from services.router.anthropic.errors import from_openai
from services.router.responses import parse_sse

PING_INTERVAL_S = 10.0


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


PING = event("ping", {})


class MessageStream:
    """One response's event state: the open block, its index, the finish and usage seen so far."""

    def __init__(self, msg_id: str, model: str, stop_sequences: list[str] | None, capped: bool = False):
        self.msg_id, self.model, self.stop_sequences = msg_id, model, stop_sequences
        self.capped = capped  # max_tokens was lowered to fit the context window
        self.index = -1  # index of the last opened block
        self.open: tuple | None = None  # ("text",) | ("thinking",) | ("tool_use", chat tool-call index)
        self.called_tools = False
        self.finish, self.matched, self.usage = None, None, None
        self.failed = False

    def start(self) -> list[str]:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": response.usage(None)}
        return [event("message_start", {"message": message}), PING]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _open(self, key: tuple, block: dict) -> list[str]:
        out = self._close()
        self.index, self.open = self.index + 1, key
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> list[str]:
        return [event("content_block_delta", {"index": self.index, "delta": delta})]

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open != (kind,):
            out += self._open((kind,), {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        field = "thinking" if kind == "thinking" else "text"
        return out + self._delta({"type": f"{field}_delta", field: text})

    def _tool_call(self, tc: dict) -> list[str]:
        out, fn = [], tc.get("function") or {}
        key = ("tool_use", tc.get("index", 0))
        if self.open != key or tc.get("id"):
            self.called_tools = True
            out += self._open(key, {"type": "tool_use", "id": response.tool_use_id(tc.get("id")),
                                    "name": fn.get("name") or "", "input": {}})
        if fn.get("arguments"):
            out += self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        return out

    def feed(self, chunk: dict) -> list[str]:
        """Events for one chat chunk (a dict of the chat stream)."""
        if "error" in chunk:
            return self.error(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._text("thinking", reasoning)
            if delta.get("content"):
                out += self._text("text", delta["content"])
            for tc in delta.get("tool_calls") or ():
                out += self._tool_call(tc)
            if choice.get("finish_reason"):
                self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return out

    def error(self, chunk: dict) -> list[str]:
        """The chat stream's error chunk (an OpenAI error body; `code` is the HTTP status when numeric)."""
        self.failed = True
        err = chunk.get("error") or {}
        code = err.get("code")
        status = code if isinstance(code, int) else 400 if err.get("type") == "invalid_request_error" else 500
        return [event("error", {"error": from_openai(status, chunk)[1]["error"]})]

    def end(self) -> list[str]:
        if self.failed:
            return []
        reason, sequence = response.stop_reason(self.finish, self.matched, self.stop_sequences, self.called_tools,
                                                self.capped)
        return self._close() + [event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                        "usage": response.usage(self.usage)}),
                                event("message_stop", {})]


async def events(chat_sse, state: MessageStream):
    """The Anthropic events of a chat SSE body (an async iterator of `data: ...` strings)."""
    for e in state.start():
        yield e
    async for piece in chat_sse:
        for chunk in parse_sse(piece if isinstance(piece, str) else piece.decode()):
            if chunk is None:
                continue
            for e in state.feed(chunk):
                yield e
            if state.failed:
                return
    for e in state.end():
        yield e


async def with_pings(source, interval_s: float = PING_INTERVAL_S):
    """`source`'s items, with a ping event whenever `interval_s` passes without one."""
    it = source.__aiter__()
    pending = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield PING
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await it.aclose()
