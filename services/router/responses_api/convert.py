"""A Responses API request as the router's chat request.

Input items are first checked and written in one canonical form (`input_items`: the form stored for
`previous_response_id` and returned as output), then turned into chat messages in order:

    input as a string                         -> a user message
    message {role user|system|developer}      -> that role's message, input_text parts joined
    message {role assistant}                  -> an assistant message, output_text / refusal parts joined
    reasoning {content | encrypted_content | summary}
                                              -> reasoning_content of the assistant turn it precedes
    function_call {call_id, name, arguments}  -> tool_calls[] of the assistant turn: calls that follow an
                                                 assistant message or each other are one turn
    function_call_output {call_id, output}    -> a tool message {tool_call_id, content}

and the rest of the request:

    instructions           -> a system message before everything (not carried over by
                              previous_response_id, as in OpenAI's API)
    tools[{type: function, name, description, parameters, strict}]
                           -> tools[{type: function, function: {...}}]
    tool_choice auto | none | required | {type: function, name}
                           -> the same in chat form ("auto" / "none" without tools: dropped, meaningless)
    text.format text | json_object | json_schema{name, schema, strict, description}
                           -> response_format
    reasoning.effort none  -> chat_template_kwargs.enable_thinking false (other efforts: the template's
                              default, thinking on)
    max_output_tokens, temperature, top_p, parallel_tool_calls, user -> the chat fields
Refused with 400, the message starting with the item's path: content parts other than text (images,
files, audio: the models served read text only), item types other than those above (item_reference
included), built-in and custom tools (web_search, file_search, mcp, ...), tool_choice of hosted tools or
allowed_tools, `include` values not listed in models.py, metadata past OpenAI's limits.

Reasoning travels back to the client whole (`reasoning_text` content); with `include:
["reasoning.encrypted_content"]` it is also in `encrypted_content`, marked ENCODED_REASONING and base64
encoded, not encrypted: this server keeps no secret. A client that sends reasoning items back (store
false, as Codex does) gets them rendered into the prompt again; another server's encrypted blobs are
opaque and skipped.
"""

from __future__ import annotations

import base64
import binascii
import json

from services.router.requests import BadRequest
from services.router.responses_api.models import (
    INCLUDE_ENCRYPTED_REASONING,
    INCLUDE_HARMLESS,
    ResponsesRequest,
)

ENCODED_REASONING = "pdserve-reasoning-b64:"
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "text": "text"}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def encode_reasoning(text: str) -> str:
    return ENCODED_REASONING + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str) -> str | None:
    """The text of a blob `encode_reasoning` made, else None (another server's encrypted reasoning)."""
    if not blob.startswith(ENCODED_REASONING):
        return None
    try:
        return base64.b64decode(blob[len(ENCODED_REASONING):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


# ---- input items -> canonical items ---------------------------------------------------------------------
def _text(parts, where: str) -> str:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise BadRequest(f"{where}: content must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
        if kind in _MEDIA_PARTS:
            raise BadRequest(f"{at}: {kind} parts are not supported: this server's model reads text only", at)
        key = _TEXT_PARTS.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise BadRequest(f"{at}: a content part must be input_text or output_text with a string text; "
                             f"got type {kind!r}", at)
        texts.append(part[key])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{key}: a {item.get('type')} item needs a non-empty string", f"{where}.{key}")
    return value


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequest(f"{where}.role: must be one of {', '.join(_ROLES)}; got {role!r}", f"{where}.role")
    text = _text(item.get("content"), f"{where}.content")
    part = {"type": "output_text", "text": text, "annotations": []} if role == "assistant" else \
        {"type": "input_text", "text": text}
    return {"type": "message", "role": role, "content": [part]}


def _function_call(item: dict, where: str) -> dict:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    args = item.get("arguments")
    try:
        ok = isinstance(args, str) and isinstance(json.loads(args), dict)
    except (json.JSONDecodeError, RecursionError):
        ok = False
    if not ok:
        raise BadRequest(f"{where}.arguments: must be a JSON object, as text", f"{where}.arguments")
    out = {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}
    return {**out, "id": item["id"]} if isinstance(item.get("id"), str) else out


def _parts(value, kind: str, where: str) -> list[str]:
    """The texts of a reasoning item's `content` (reasoning_text parts) or `summary` (summary_text parts)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                              and isinstance(p.get("text"), str) for p in value):
        raise BadRequest(f"{where}: must be a list of {kind} parts with a string text", where)
    return [p["text"] for p in value]


def _reasoning(item: dict, where: str) -> dict:
    """Its text: the content parts, else our encoded `encrypted_content`, else the summary standing in."""
    texts = _parts(item.get("content"), "reasoning_text", f"{where}.content")
    if not texts and isinstance(item.get("encrypted_content"), str):
        texts = [t for t in (decode_reasoning(item["encrypted_content"]),) if t]
    if not texts:
        texts = _parts(item.get("summary"), "summary_text", f"{where}.summary")
    out = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t} for t in texts]}
    return {**out, "id": item["id"]} if isinstance(item.get("id"), str) else out


def input_items(value: str | list) -> list[dict]:
    """The request's `input` as canonical items; BadRequest naming the first bad one."""
    if isinstance(value, str):
        return [_message({"role": "user", "content": value}, "input")]
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            out.append(_function_call(item, where))
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "call_id": _string(item, "call_id", where),
                        "output": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            out.append(_reasoning(item, where))
        elif kind == "item_reference":
            raise BadRequest(f"{where}.type: item references are not supported; send the items themselves or "
                             "continue with previous_response_id", f"{where}.type")
        else:
            raise BadRequest(f"{where}.type: input items of type {kind!r} are not supported (message, "
                             "function_call, function_call_output, reasoning)", f"{where}.type")
    return out


def check_call_outputs(history: list[dict], items: list[dict]) -> None:
    """Every function_call_output answers a function_call made before it (in the stored conversation or
    earlier in this input): an output for a call nobody made is a client error, not something to render."""
    calls = {it["call_id"] for it in history if it.get("type") == "function_call"}
    for i, it in enumerate(items):
        if it["type"] == "function_call":
            calls.add(it["call_id"])
        elif it["type"] == "function_call_output" and it["call_id"] not in calls:
            raise BadRequest(f"input[{i}].call_id: no function_call with call_id {it['call_id'][:64]!r} precedes "
                             "this output (continue the response that made the call with previous_response_id, "
                             "or send the function_call item too)", f"input[{i}].call_id")


# ---- canonical items -> chat messages ----------------------------------------------------------------------
def _joined(item: dict) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in item["content"])


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Canonical items as chat messages. An assistant turn is what one response wrote: [reasoning]
    [message] [function_call...]; reasoning met while a turn is open starts the next turn (the template
    has one reasoning per turn), and any other item closes the turn."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: list[str] = []  # reasoning waiting for the assistant turn it belongs to
    turn: dict | None = None  # the open assistant turn, which function calls join

    def assistant(content: str) -> dict:
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += [c["text"] for c in item["content"]]
        elif kind == "function_call":
            turn = turn if turn is not None and not reasoning else assistant("")
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "message" and item["role"] == "assistant":
            turn = assistant(_joined(item))
        else:
            if reasoning:
                assistant("")
            turn = None
            if kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            else:
                out.append({"role": item["role"], "content": _joined(item)})
    if reasoning:
        assistant("")
    return out


# ---- tools, tool_choice, text.format, the rest ---------------------------------------------------------------
def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.get("type") != "function":
            raise BadRequest(f"{where}.type: tools of type {t.get('type')!r} are not supported; give function "
                             "tools (built-in tools such as web_search run on OpenAI's servers)", f"{where}.type")
        extra = sorted(k for k in t if k not in _TOOL_KEYS and t[k] is not None)
        if extra:
            raise BadRequest(f"{where}.{extra[0]}: not supported on function tools", f"{where}.{extra[0]}")
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        fn.update({k: t[k] for k in ("description", "strict") if t.get(k) is not None})
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice, has_tools: bool):
    if choice is None or (choice in ("auto", "none") and not has_tools):
        return None
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise BadRequest('tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...}; '
                         f"tool_choice of type {choice.get('type')!r} is not supported", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise BadRequest(f"text.format.type: must be text, json_object or json_schema; got {fmt.get('type')!r}",
                         "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise BadRequest("text.format.schema: a json_schema format needs a `schema` object", "text.format.schema")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if fmt.get(k) is not None}}


def check_include(include: list[str] | None) -> bool:
    """Whether reasoning goes out as `encrypted_content` too; BadRequest for a value not implemented."""
    for i, value in enumerate(include or ()):
        if value != INCLUDE_ENCRYPTED_REASONING and value not in INCLUDE_HARMLESS:
            raise BadRequest(f"include[{i}]: {value!r} is not supported", f"include[{i}]")
    return INCLUDE_ENCRYPTED_REASONING in (include or ())


def check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequest(f"metadata: at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise BadRequest(f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most "
                             f"{MAX_METADATA_VALUE}", "metadata")


def chat_request(req: ResponsesRequest, items: list[dict]) -> dict:
    """The chat-completions body (a dict) for `items` (the stored conversation, then this request's input)."""
    body: dict = {"messages": chat_messages(items, req.instructions)}
    if req.model is not None:
        body["model"] = req.model
    tools = chat_tools(req.tools)
    if tools:
        body["tools"] = tools
    choice = chat_tool_choice(req.tool_choice, bool(tools))
    if choice is not None:
        body["tool_choice"] = choice
    fmt = response_format(req.text.format if req.text else None)
    if fmt is not None:
        body["response_format"] = fmt
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    fields = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
              "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    body.update({k: v for k, v in fields.items() if v is not None})
    if req.stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    return body
