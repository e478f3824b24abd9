"""Chat-completions stream chunks as the Responses API's SSE events (`event: <type>` / `data: <json>`,
every event with a `sequence_number` counting from 0).

    response.created, response.in_progress          (the response, status in_progress, no output)
    per output item, in the order the model wrote them:
        response.output_item.added                  {output_index, item (status in_progress)}
        reasoning:  response.content_part.added {part: reasoning_text} · response.reasoning_text.delta ·
                    response.reasoning_text.done · response.content_part.done
        message:    response.content_part.added {part: output_text} · response.output_text.delta ·
                    response.output_text.done · response.content_part.done
        function_call: response.function_call_arguments.delta · response.function_call_arguments.done
        response.output_item.done                   {output_index, item (completed, or incomplete)}
    response.completed | response.incomplete (max_output_tokens) | response.failed   (the whole response)
A chat delta of another kind (content after reasoning, a new tool call) closes the open item and opens
the next. Arguments go out as the chat stream gives them: whole calls, in a few fragments, whose
concatenation is the call's `arguments`. A failure after the stream began (an engine lost, the response
not stored) is an `error` event {code, message, param}, then response.failed, and the stream ends.
There is no `[DONE]` line: the final response event ends the stream, as in OpenAI's API.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from services.router.responses import parse_sse
from services.router.responses_api import response
from services.router.responses_api.response import new_id

_STATUS_CODE = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def error_code(status: int) -> str:
    """The Response's `error.code` for an HTTP status of the chat path."""
    return _STATUS_CODE.get(status, "server_error")


class ResponseEvents:
    """One streamed response's state: its items so far, the open one and its text, finish and usage."""

    def __init__(self, resp: dict, encrypted: bool, count: Callable[[str], int]):
        self.resp, self.encrypted, self.count = resp, encrypted, count
        self.seq = 0
        self.items: list[dict] = []
        self.open: tuple | None = None  # ("reasoning",) | ("message",) | ("function_call", chat call index)
        self.text = ""  # the open item's text or arguments
        self.finish, self.usage, self.failed = None, None, False

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [self.event(kind, response=self.resp) for kind in ("response.created", "response.in_progress")]

    # ---- items --------------------------------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, key: tuple, item: dict, part: dict | None) -> list[str]:
        out = self._close()
        self.open, self.text = key, ""
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if part is not None:
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        kind, where, text, out = self.open[0], self._where(), self.text, []
        if kind == "function_call":
            item = {**self.items[-1], "arguments": text, "status": status}
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text))
        elif kind == "message":
            item = response.message_item(where["item_id"], text, status)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            item = response.reasoning_item(where["item_id"], text, status, self.encrypted)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        self.items[-1], self.open = item, None
        return out + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _open_text(self, kind: str) -> list[str]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        return self._open((kind,), item, part)

    def _text(self, kind: str, delta: str) -> list[str]:
        out = self._open_text(kind) if self.open != (kind,) else []
        self.text += delta
        if kind == "message":
            return out + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                     logprobs=[])]
        return out + [self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)]

    def _tool_call(self, tc: dict) -> list[str]:
        out, fn = [], tc.get("function") or {}
        key = ("function_call", tc.get("index", 0))
        if self.open != key or tc.get("id"):
            item = response.function_call_item(new_id("fc"), tc.get("id") or new_id("call"), fn.get("name") or "",
                                               "", "in_progress")
            out += self._open(key, item, None)
        if fn.get("arguments"):
            self.text += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return out

    # ---- the chat stream ----------------------------------------------------------------------------------
    def feed(self, chunk: dict) -> list[str]:
        """Events for one chat chunk (a dict of the chat stream)."""
        if "error" in chunk:
            return self.error(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for tc in delta.get("tool_calls") or ():
                out += self._tool_call(tc)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self) -> tuple[list[str], dict]:
        """The events that close the output, and the final response (its event comes from `final`)."""
        out = [] if self.items else self._open_text("message")  # nothing written: one empty message
        cut = self.finish == "length" and self.open is not None and self.open[0] != "function_call"
        out += self._close("incomplete" if cut else "completed")
        u = response.usage(self.usage, response.reasoning_tokens(self.items, self.count))
        return out, response.finish(self.resp, self.items, self.finish, u)

    def final(self, resp: dict) -> str:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(resp["status"],
                                                                                            "response.failed")
        return self.event(kind, response=resp)

    def fail(self, code: str, message: str, param: str | None = None) -> list[str]:
        """An error event, then the response as failed (its open item left incomplete); the stream ends."""
        self.failed = True
        if self.open is not None:
            self.items[-1] = {**self.items[-1], "status": "incomplete"}
        return [self.event("error", code=code, message=message, param=param),
                self.event("response.failed", response=response.failed(self.resp, self.items, code, message))]

    def error(self, chunk: dict) -> list[str]:
        """The chat stream's error chunk (an OpenAI error body; `code` is the HTTP status when numeric)."""
        err = chunk.get("error") or {}
        code = err.get("code")
        status = code if isinstance(code, int) else 400 if err.get("type") == "invalid_request_error" else 500
        return self.fail(error_code(status), str(err.get("message") or "the response failed"), err.get("param"))


async def events(chat_sse, state: ResponseEvents, save: Callable[[dict], Awaitable[None]] | None):
    """The Responses events of a chat SSE body (an async iterator of `data: ...` strings). `save` stores
    the final response before its event goes out, so a client that continues from it at once finds it."""
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
    closing, resp = state.end()
    for e in closing:
        yield e
    if save is not None and resp["status"] != "failed":
        try:
            await save(resp)
        except Exception as exc:  # noqa: BLE001 - the client hears of it as the stream's failure
            for e in state.fail("server_error", f"the response could not be stored: {exc}"):
                yield e
            return
    yield state.final(resp)
