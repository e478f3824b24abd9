"""OpenAI response bodies (completion / chat, whole or as SSE chunks) built from the flow's chunks."""

from __future__ import annotations

import json
import time

from engine.frontend.tokenizer import Tokenizer


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def parse_sse(text: str) -> list[dict | None]:
    """The chunks in a piece of a chat SSE body (`data: <json>` lines; `[DONE]` is None): what the
    Anthropic and Responses layers read back from the chat stream."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:].strip()
            out.append(None if payload == "[DONE]" else json.loads(payload))
    return out


class Formatter:
    """One response's shared fields (id, created, model) and its token-level formatting."""

    def __init__(self, kind: str, req_id: str, model: str, tok: Tokenizer):
        self.kind, self.req_id, self.model, self.tok = kind, req_id, model, tok
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.req_id, "object": obj, "created": self.created, "model": self.model}

    # ---- logprobs --------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], lps: list[dict] | None, offset: int) -> dict | None:
        if lps is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, d in zip(token_ids, lps):
            s = self.tok.decode([t], skip_special_tokens=False)
            out["tokens"].append(s)
            out["token_logprobs"].append(d.get(t))
            out["top_logprobs"].append({self.tok.decode([k], skip_special_tokens=False): v for k, v in d.items()})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def chat_logprobs(self, token_ids: list[int], lps: list[dict] | None, top_n: int) -> dict | None:
        if lps is None:
            return None
        content = []
        for t, d in zip(token_ids, lps):
            s = self.tok.decode([t], skip_special_tokens=False)
            tops = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": d.get(t), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.tok.decode([k], skip_special_tokens=False),
                                              "logprob": v, "bytes": list(self.tok.decode([k]).encode())}
                                             for k, v in tops]})
        return {"content": content}

    # ---- streaming chunks --------------------------------------------------------------------------
    def chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None,
              stop_reason=None, first: bool = False, token_ids: list[int] | None = None) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = self._base("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            obj = self._base("text_completion")
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj["choices"] = [choice]
        return obj

    def usage_chunk(self, u: dict) -> dict:
        obj = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        obj["choices"] = []
        obj["usage"] = u
        return obj

    # ---- whole responses ---------------------------------------------------------------------------
    def full(self, choices: list[dict], u: dict) -> dict:
        obj = self._base("chat.completion" if self.kind == "chat" else "text_completion")
        obj["choices"] = choices
        obj["usage"] = u
        return obj

    def full_choice(self, index: int, text: str, logprobs: dict | None, finish: str | None, stop_reason,
                    token_ids: list[int] | None = None) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice
