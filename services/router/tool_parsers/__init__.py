"""Tool-call parsers: a model's tool-call syntax turned into OpenAI `tool_calls`, whole or streamed.

A parser is made per response from the request's tools (`{name: parameters JSON schema}`); its
`feed(text)` takes each new piece of output text (the answer, after any reasoning) and returns events
in output order:

    str               plain content
    ToolCallDelta     index, id, name (the first delta of a call: id and name set, arguments "")
                      then argument fragments (id and name None); a call's fragments concatenate to
                      its arguments as a JSON object text

`finish()` returns what was held back. Feeding the text whole or one character at a time gives the
same events once joined (`collect`), so a streamed response assembles to the non-streamed one. Text
the parser cannot read as a call (an unknown function name, broken markup) is content, never an error.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI-style tools (`{"type": "function", "function": {...}}`)."""
    out = {}
    for t in tools or []:
        f = t.get("function", t)
        out[f["name"]] = f.get("parameters") or {"type": "object", "properties": {}}
    return out


def collect(events) -> tuple[str, list[ToolCall]]:
    """Joined events: (content, complete tool calls in order)."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.name is not None:
            calls[e.index] = ToolCall(e.id, e.name, e.arguments)
        else:
            calls[e.index].arguments += e.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]


def tool_parser(name: str | None):
    """The parser class named by `--tool-call-parser` (None: no parsing)."""
    from services.router.tool_parsers.glm45 import Glm45ToolParser
    from services.router.tool_parsers.glm47 import Glm47ToolParser

    parsers = {"glm47": Glm47ToolParser, "glm45": Glm45ToolParser}
    if name is None:
        return None
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(parsers)}")
    return parsers[name]
