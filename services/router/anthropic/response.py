"""A chat-completions result as a Messages response: content blocks, stop_reason, usage.

    message.reasoning_content -> {"type": "thinking", "thinking", "signature": ""}
    message.content           -> {"type": "text", "text"}
    message.tool_calls[]      -> {"type": "tool_use", "id", "name", "input": <arguments decoded>}
    finish_reason             -> stop_reason: tool_calls (or any tool call made) "tool_use",
                                 length "max_tokens" (or "model_context_window_exceeded" when
                                 max_tokens was lowered to fit the context), a stop string of the request
                                 "stop_sequence" (with `stop_sequence` set), anything else "end_turn"
    usage                     -> input_tokens (prompt tokens not read from the prefix cache),
                                 cache_read_input_tokens (those read), output_tokens
Signatures are empty: this server does not sign its thinking, and ignores signatures sent back.
"""

from __future__ import annotations

import json
import uuid


def tool_use_id(call_id: str | None) -> str:
    return call_id or "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(finish: str | None, matched, stop_sequences: list[str] | None, called_tools: bool,
                capped: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and its vLLM-style `stop_reason`;
    `capped`: max_tokens was lowered to the room left in the context window."""
    if called_tools or finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return ("model_context_window_exceeded" if capped else "max_tokens"), None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": max(u.get("prompt_tokens", 0) - cached, 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u.get("completion_tokens", 0)}


def _tool_block(call: dict) -> dict:
    fn = call.get("function") or {}
    raw = fn.get("arguments") or "{}"
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):  # the tool's input must be an object: keep what the model wrote
        args = {"arguments": raw}
    return {"type": "tool_use", "id": tool_use_id(call.get("id")), "name": fn.get("name", ""), "input": args}


def content_blocks(message: dict) -> list[dict]:
    blocks = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    blocks += [_tool_block(c) for c in message.get("tool_calls") or ()]
    return blocks


def message_from_chat(chat: dict, msg_id: str, model: str, stop_sequences: list[str] | None,
                      capped: bool = False) -> dict:
    choice = chat["choices"][0]
    blocks = content_blocks(choice.get("message") or {})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences,
                                   any(b["type"] == "tool_use" for b in blocks), capped)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}
