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

from services.router.tool_parsers.base import ToolCall, ToolCallDelta, collect, new_tool_call_id, tool_schemas
from services.router.tool_parsers.glm45 import Glm45ToolParser
from services.router.tool_parsers.glm47 import Glm47ToolParser

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallDelta", "collect", "new_tool_call_id", "tool_parser", "tool_schemas"]

TOOL_PARSERS = {"glm47": Glm47ToolParser, "glm45": Glm45ToolParser}


def tool_parser(name: str | None):
    """The parser class named by `--tool-call-parser` (None: no parsing)."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
