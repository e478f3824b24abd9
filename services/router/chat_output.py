"""One choice's output text split into reasoning, content and tool calls, and its OpenAI form.

`ChoiceParser(options)` runs the reasoning parser first (its content part goes on) and then the tool
parser. `feed(text)` / `finish()` return events in output order:

    ("reasoning", text)   ("content", text)   ToolCallDelta (services/router/tool_parsers)

Both HTTP APIs (OpenAI chat here; Anthropic messages) and gRPC Router.Generate build their replies
from these events. `openai_delta(events)` is a streaming chunk's `delta`; `openai_message(events)`
the whole response's `message`; `finish_reason(...)` turns "stop" into "tool_calls" when a call was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.tool_parsers import ToolCallDelta, collect


@dataclass
class OutputOptions:
    reasoning_parser: type | None = None
    in_reasoning: bool = False  # the prompt left a <think> open
    include_reasoning: bool = True  # False: reasoning is parsed out and dropped (vLLM's include_reasoning)
    tool_parser: type | None = None  # None: tool calls are not parsed (tool_choice none, or no tools)
    tools: dict[str, dict] = field(default_factory=dict)
    parallel_tool_calls: bool = True  # False: only the first call the model writes is returned

    @property
    def plain(self) -> bool:
        return self.reasoning_parser is None and self.tool_parser is None


class ChoiceParser:
    def __init__(self, options: OutputOptions):
        self.options = options
        self._reasoning = options.reasoning_parser(options.in_reasoning) if options.reasoning_parser else None
        self._tools = options.tool_parser(options.tools) if options.tool_parser else None
        self.num_tool_calls = 0

    def feed(self, text: str) -> list:
        if self._reasoning is None:
            return self._content(text, final=False)
        r, c = self._reasoning.feed(text)
        return self._reasoned(r) + self._content(c, final=False)

    def finish(self) -> list:
        events = []
        if self._reasoning is not None:
            r, c = self._reasoning.finish()
            events = self._reasoned(r) + self._content(c, final=False)
        return events + self._content("", final=True)

    def _reasoned(self, text: str) -> list:
        return [("reasoning", text)] if text and self.options.include_reasoning else []

    def _content(self, text: str, final: bool) -> list:
        if self._tools is None:
            return [("content", text)] if text else []
        raw = self._tools.feed(text) if text else []
        if final:
            raw += self._tools.finish()
        events = []
        for e in raw:
            if isinstance(e, str):
                events.append(("content", e))
            elif self.options.parallel_tool_calls or e.index == 0:  # later calls dropped when not parallel
                self.num_tool_calls += e.name is not None
                events.append(e)
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_tool_calls else reason


def _tool_delta(e: ToolCallDelta) -> dict:
    if e.name is not None:
        return {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
    return {"index": e.index, "function": {"arguments": e.arguments}}


def openai_delta(events: list) -> dict:
    """A chunk's delta: reasoning_content / content text and tool_calls entries (fragments of one call
    that follow each other are merged; a call's first entry carries id, type and name, on its own)."""
    delta: dict = {}
    calls: list[dict] = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if calls and e.name is None and calls[-1]["index"] == e.index and "id" not in calls[-1]:
                calls[-1]["function"]["arguments"] += e.arguments
            else:
                calls.append(_tool_delta(e))
        else:
            key = "reasoning_content" if e[0] == "reasoning" else "content"
            delta[key] = delta.get(key, "") + e[1]
    if calls:
        delta["tool_calls"] = calls
    return delta


def openai_message(events: list) -> dict:
    """The whole response's message: content (None when a call was made and nothing else said),
    reasoning_content (None when there was none) and tool_calls (only when there were any)."""
    content, calls = collect(e[1] if isinstance(e, tuple) and e[0] == "content" else e
                             for e in events if not (isinstance(e, tuple) and e[0] == "reasoning"))
    reasoning = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "reasoning")
    message = {"role": "assistant", "content": content or (None if calls else ""),
               "reasoning_content": reasoning or None}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message
