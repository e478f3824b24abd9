"""The Response object: its fields echoed from the request, the output items of a chat result, status
and usage. The stream (stream.py) builds the same items from chat deltas, so a streamed response ends
equal to the one returned whole.

    message.reasoning_content -> {"type": "reasoning", "id": "rs_…", "summary": [],
                                  "content": [{"type": "reasoning_text", "text"}]}
                                 (+ "encrypted_content" with include reasoning.encrypted_content)
    message.content           -> {"type": "message", "id": "msg_…", "role": "assistant", "status",
                                  "content": [{"type": "output_text", "text", "annotations": []}]}
    message.tool_calls[]      -> {"type": "function_call", "id": "fc_…", "call_id", "name", "arguments", "status"}
    finish_reason length      -> status "incomplete", incomplete_details {"reason": "max_output_tokens"}
                                 (the last reasoning or message item "incomplete" too)
    finish_reason abort       -> status "failed", error {"code": "server_error", ...}
    anything else             -> status "completed"
    usage                     -> input_tokens (the prompt), input_tokens_details.cached_tokens (read from
                                 the prefix cache), output_tokens, output_tokens_details.reasoning_tokens
                                 (the reasoning text's tokens, counted by encoding it), total_tokens
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from services.router.responses_api.convert import encode_reasoning
from services.router.responses_api.models import ResponsesRequest


def new_id(prefix: str) -> str:
    """Ids are unguessable: a stored response is read by its id alone (within its tenant)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str, encrypted: bool) -> dict:
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}
    if encrypted:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [output_text(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict, encrypted: bool) -> list[dict]:
    """A chat message's output items, all completed (`finish` marks the last one); an empty message
    when the model wrote nothing at all, so every response has an item to read."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed", encrypted))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        items.append(function_call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name", ""),
                                        fn.get("arguments") or "{}", "completed"))
    return items or [message_item(new_id("msg"), "", "completed")]


def usage(chat_usage: dict | None, reasoning_tokens: int) -> dict:
    u = chat_usage or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
            "total_tokens": prompt + completion}


def reasoning_tokens(items: list[dict], count: Callable[[str], int]) -> int:
    return sum(count(c["text"]) for item in items if item["type"] == "reasoning" for c in item["content"])


def skeleton(resp_id: str, req: ResponsesRequest, model: str, params) -> dict:
    """The response in progress: what the request set, echoed (sampling values as the engines run them)."""
    text = {"format": req.text.format if req.text and req.text.format else {"type": "text"}}
    reasoning = req.reasoning.model_dump(exclude={"generate_summary"}) if req.reasoning else {"effort": None,
                                                                                               "summary": None}
    return {"id": resp_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": reasoning, "store": req.store,
            "temperature": params.temperature, "text": text, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": params.top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "metadata": req.metadata or {}}


def finish(resp: dict, items: list[dict], finish_reason: str | None, u: dict) -> dict:
    """`resp` (a skeleton) with its output, status and usage: the final response."""
    out = {**resp, "output": items, "usage": u}
    if finish_reason == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        if items and items[-1]["type"] != "function_call":
            items[-1]["status"] = "incomplete"
    elif finish_reason == "abort":
        out["status"] = "failed"
        out["error"] = {"code": "server_error", "message": "the generation was aborted"}
    else:
        out["status"] = "completed"
    out["completed_at"] = int(time.time()) if out["status"] == "completed" else None
    return out


def failed(resp: dict, items: list[dict], code: str, message: str) -> dict:
    return {**resp, "status": "failed", "output": items, "error": {"code": code, "message": message}}


def from_chat(resp: dict, chat: dict, encrypted: bool, count: Callable[[str], int]) -> dict:
    """The final response of a whole (not streamed) chat result."""
    choice = chat["choices"][0]
    items = output_items(choice.get("message") or {}, encrypted)
    return finish(resp, items, choice.get("finish_reason"), usage(chat.get("usage"), reasoning_tokens(items, count)))
