"""What every tool-call parser shares: the events it returns (`ToolCallDelta`), a complete call
(`ToolCall`), call ids, the tools' schemas by name, and `collect`, which joins events into content
and calls (services/router/tool_parsers/__init__.py describes the protocol)."""

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
