"""A chat request made ready for the template and the engines: messages, tools, tool choice, thinking.

    messages   content parts joined to text (non-text parts: 400); assistant tool_calls' `arguments`
               JSON text turned into objects (templates iterate them); tool_call_id, name and
               reasoning_content kept for the template
    tools      OpenAI function tools; names unique and well formed, `parameters` a valid JSON schema
    tool_choice  none | auto (needs --enable-auto-tool-choice and a tool parser) | required | a named
               function: the last two are enforced with a grammar (services/router/tool_grammar.py)
    thinking   chat_template_kwargs.enable_thinking false: the template closes <think>, nothing is
               parsed as reasoning; else, with a reasoning parser, a prompt left inside <think>
               starts the output in the reasoning

`ChatSettings` is the server's side (template, parsers, flags); `render_chat` (the render step of
services/router/prepare.py) returns the prompt text, the output options of every choice, and the
forced-call spec (or None).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from jsonschema import SchemaError, validators  # imported at start: a router without it must not start

from services.router.chat_output import OutputOptions
from services.router.chat_template import ChatTemplate, ChatTemplateError
from services.router.requests import BadRequest
from services.router.tool_parsers import tool_schemas

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ChatSettings:
    template: ChatTemplate | None
    tool_parser: type | None = None  # from --tool-call-parser
    reasoning_parser: type | None = None  # from --reasoning-parser
    enable_auto_tool_choice: bool = False


@dataclass
class ChatPlan:
    prompt: str
    output: OutputOptions
    forced: object | None = None  # StructuredOutputSpec of a required / named tool choice
    tools: dict[str, dict] = field(default_factory=dict)


def _text_of(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}.content[{j}]: content of type {kind!r} is not supported (text only)",
                             f"{where}.content")
        parts.append(part["text"])
    return "".join(parts)


def _tool_calls(calls, where: str) -> list[dict]:
    out = []
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (json.JSONDecodeError, RecursionError) as e:
                raise BadRequest(f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}",
                                 f"{where}.tool_calls") from e
        if not isinstance(args, dict):
            raise BadRequest(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                             f"{where}.tool_calls")
        out.append({**call, "type": call.get("type", "function"), "function": {**f, "arguments": args}})
    return out


def template_messages(messages) -> list[dict]:
    """Messages as the template reads them (pydantic models or dicts in)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        where = f"messages[{i}]"
        d["content"] = _text_of(d.get("content"), where)
        if d.get("tool_calls"):
            d["tool_calls"] = _tool_calls(d["tool_calls"], where)
        out.append(d)
    return out


def check_tools(tools) -> dict[str, dict]:
    """{name: parameters schema}; BadRequest naming the first bad tool."""
    if tools is None:
        return {}
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must match {TOOL_NAME.pattern}", "tools")
        if name in names:
            raise BadRequest(f"tools[{i}]: two tools are named {name!r}", "tools")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        try:
            validators.validator_for(params).check_schema(params)
        except SchemaError as e:
            raise BadRequest(f"tools[{i}].function.parameters is not a valid JSON schema: {e.message}",
                             "tools") from e
    return tool_schemas(tools)


def _forced_names(choice, tools: dict[str, dict], settings: ChatSettings) -> tuple[bool, list[str] | None]:
    """(parse the output for calls, the names a call is forced to; None when not forced)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return False, None
    if not tools:
        raise BadRequest("tool_choice needs tools", "tool_choice")
    if settings.tool_parser is None:
        raise BadRequest(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs a server "
                         "started with --tool-call-parser", "tool_choice")
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise BadRequest('tool_choice "auto" needs a server started with --enable-auto-tool-choice',
                             "tool_choice")
        return True, None
    if choice == "required":
        return True, list(tools)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in tools:
        raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return True, [name]


def render_chat(body, settings: ChatSettings) -> ChatPlan:
    """Tools and tool_choice checked, the messages rendered with the chat template; BadRequest naming the field."""
    if settings.template is None:
        raise BadRequest("this model has no chat template: use /v1/completions, or start the server with "
                         "--chat-template FILE", "messages", code="no_chat_template")
    kwargs = dict(body.chat_template_kwargs or {})
    tools = check_tools(body.tools)
    parse_tools, forced = _forced_names(body.tool_choice, tools, settings)
    try:
        prompt = settings.template.render(template_messages(body.messages), tools=body.tools or None,
                                          documents=body.documents, add_generation_prompt=body.add_generation_prompt,
                                          template_kwargs=kwargs)
    except ChatTemplateError as e:
        raise BadRequest(str(e), "messages") from e
    reasoning = settings.reasoning_parser if kwargs.get("enable_thinking", True) is not False else None
    in_reasoning = bool(reasoning and reasoning.starts_in_reasoning(prompt))
    out = OutputOptions(reasoning, in_reasoning, body.include_reasoning,
                        settings.tool_parser if parse_tools else None, tools, body.parallel_tool_calls is not False)
    spec = None
    if forced:
        parallel = body.tool_choice == "required" and body.parallel_tool_calls is not False
        spec = _forced_call_spec(tools, forced, parallel, settings.tool_parser.part_separator,
                                 reasoning.end if in_reasoning else "")
    return ChatPlan(prompt, out, spec, tools)


def _forced_call_spec(tools: dict[str, dict], allowed: list[str], parallel: bool, sep: str, reasoning_end: str):
    """The grammar of a forced call (services/router/tool_grammar.py); BadRequest when it cannot be built."""
    # tool_grammar builds the grammar with xgrammar, which imports torch: loaded by the first forced call
    from services.router.tool_grammar import ToolGrammarError, tool_choice_spec

    try:
        return tool_choice_spec(tools, allowed, parallel, sep, reasoning_end)
    except ToolGrammarError as e:
        raise BadRequest(str(e), "tools") from e
