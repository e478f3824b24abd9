"""A Messages request as the router's chat request, and a chat result as a Messages response.

Request, block by block:
    system (string or text blocks)        -> one system message (billing header line dropped, below)
    user text                             -> user message
    user tool_result{tool_use_id, ...}    -> tool message {tool_call_id, content}, placed before the
                                             user's own text, as the chat format wants results right
                                             after the assistant turn that called the tools
    assistant thinking / text / tool_use  -> assistant {reasoning_content, content, tool_calls[]}
    tools{name, description, input_schema}-> tools[{type: function, function{name, description, parameters}}]
    tool_choice auto / any / tool / none  -> "auto" / "required" / {type: function, ...} / "none"
    thinking enabled / disabled / absent  -> chat_template_kwargs.enable_thinking true / false / false
    output_config.format json_schema      -> response_format json_schema (strict)
Refused with 400: image and document blocks (this server serves text-only models), any other block
type, server tools, a code-execution `container`, and a final assistant message (prefill of the answer).

Billing headers: Claude Code starts the system prompt with a line
`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;` whose `cch` changes on
every request. Left in, it would differ at token ~10 of every prompt and no prefix block would ever
be reused, so such a line at the start of the system prompt (or of one of its blocks) is dropped.
"""

from __future__ import annotations

import json
import re
import uuid

from services.router.anthropic.errors import InvalidRequest
from services.router.anthropic.models import MessagesRequest, _Prompt

BILLING_HEADER = re.compile(r"\A[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|\Z)", re.IGNORECASE)
_UNSUPPORTED_MEDIA = {"image", "document", "search_result", "container_upload"}
_IGNORED_ASSISTANT = {"redacted_thinking"}  # opaque to us: carries nothing a template can render


def strip_billing_header(text: str) -> str:
    return BILLING_HEADER.sub("", text, count=1)


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("a text block needs a string `text`", where)
    return text


def _refuse(block: dict, where: str):
    kind = block.get("type")
    if kind in _UNSUPPORTED_MEDIA:
        raise InvalidRequest(f"{kind} blocks are not supported: this server's model reads text only", where)
    raise InvalidRequest(f"unknown or unsupported content block type {kind!r}", where)


def system_text(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return strip_billing_header(system)
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest("system blocks must be text blocks", f"system.{i}")
        text = strip_billing_header(_text_of(block, f"system.{i}"))
        if text:
            parts.append(text)
    return "\n".join(parts)


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest("a tool_result block needs `tool_use_id`", where)
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                _refuse(part if isinstance(part, dict) else {}, f"{where}.content.{j}")
            texts.append(_text_of(part, f"{where}.content.{j}"))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise InvalidRequest("tool_result content must be a string or a list of text blocks", f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _user(content: list[dict], where: str) -> list[dict]:
    results, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            _refuse(block, at)
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tool_call(block: dict, where: str) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise InvalidRequest("a tool_use block needs string `id` and `name` and an object `input`", where)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _assistant(content: list[dict], where: str) -> dict:
    msg: dict = {"role": "assistant"}
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        at, kind = f"{where}.content.{j}", block.get("type")
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise InvalidRequest("a thinking block needs a string `thinking`", at)
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind not in _IGNORED_ASSISTANT:
            _refuse(block, at)
    msg["content"] = "".join(texts)
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(req: _Prompt) -> list[dict]:
    out = []
    system = system_text(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        for j, block in enumerate(m.content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise InvalidRequest("a content block must be an object with a `type`", f"messages.{i}.content.{j}")
        out += _user(m.content, f"messages.{i}") if m.role == "user" else [_assistant(m.content, f"messages.{i}")]
    if req.messages[-1].role == "assistant":
        raise InvalidRequest("a final assistant message (prefilling the answer) is not supported",
                             f"messages.{len(req.messages) - 1}")
    return out


def _tools(req: _Prompt) -> dict:
    out: dict = {}
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise InvalidRequest(f"server tool {t.type!r} is not supported; give client tools with "
                                     "`input_schema`", f"tools.{i}")
        out["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                          **({"description": t.description} if t.description else {})}}
                        for t in req.tools]
    tc = req.tool_choice
    if tc is None or (tc.type == "none" and not req.tools):
        return out
    if not req.tools:
        raise InvalidRequest("tool_choice needs `tools`", "tool_choice")
    if tc.type == "tool":
        if not tc.name:
            raise InvalidRequest("tool_choice of type `tool` needs `name`", "tool_choice.name")
        if tc.name not in {t.name for t in req.tools}:
            raise InvalidRequest(f"tool {tc.name!r} is not in `tools`", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    if tc.disable_parallel_tool_use and req.tools:
        out["parallel_tool_calls"] = False
    return out


def chat_request(req: _Prompt) -> dict:
    """The chat-completions body (a dict) that renders the same prompt as `req`; sampling fields are
    added by the caller for /v1/messages."""
    if req.container is not None:
        raise InvalidRequest("code execution containers are not supported", "container")
    body: dict = {"model": req.model, "messages": chat_messages(req), **_tools(req)}
    # as in Anthropic's API, no `thinking` means no thinking (a GLM template would think by default)
    body["chat_template_kwargs"] = {"enable_thinking": req.thinking is not None and req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_, "strict": True}}
    return body


def chat_completion_request(req: MessagesRequest) -> dict:
    body = chat_request(req)
    body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    return body


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]
