"""`--tool-call-parser glm47` (GLM-4.7, GLM-5): calls written as

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

one block per call, any number of blocks after (or instead of) the content. A value is raw text when
the tool's schema types that parameter as a string, else JSON (kept as text when it does not parse).
Whitespace between the parts, and around the blocks, is layout and is dropped.

States while streaming (`_mode`):  text --<tool_call>--> name --NAME known--> args --</tool_call>--> text
                                                           \\--unknown NAME, broken markup--> bad
A call is held until its </tool_call> arrives and then goes out whole: its header delta (index, id,
name), one fragment per argument, the closing `}`. A block that is not a readable call (an unknown
name, broken markup, or no </tool_call> before the output ends, as when max_tokens cuts it off) is
content, exactly as written: released at its </tool_call>, or by `finish()`. So no delta is ever sent
for a call that does not complete, and a stream assembles to the whole-text result.
"""

from __future__ import annotations

import json

from services.router.reasoning import _held_prefix
from services.router.tool_parsers.base import ToolCallDelta, new_tool_call_id

TC_START, TC_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VAL_START, VAL_END = "<arg_value>", "</arg_value>"
MAX_NAME_CHARS = 256  # a name (or key) longer than this without its closing marker is not markup


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_value(schema: dict, key: str, raw: str):
    """A value as the tool's schema types it: raw for string parameters, else JSON when it parses."""
    prop = (schema.get("properties") or {}).get(key)
    kind = prop.get("type") if isinstance(prop, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except ValueError:
        return raw


class Glm47ToolParser:
    name = "glm47"
    part_separator = ""  # what a generated call puts between its parts (grammars use it)

    def __init__(self, tools: dict[str, dict], new_id=new_tool_call_id):
        self.tools, self._new_id = tools, new_id
        self._buf, self._mode, self._raw = "", "text", ""  # _raw: the current block as written so far
        self._index, self._after_call = -1, False
        self._current, self._pending = "", []  # the call being read: its name and argument fragments

    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while getattr(self, f"_step_{self._mode}")(out):
            pass
        return out

    def finish(self) -> list:
        """What was held back: an unfinished block (a call without its </tool_call>) is content."""
        out: list = []
        self._text(out, (self._raw if self._mode != "text" else "") + self._buf)
        self._buf, self._raw, self._mode = "", "", "text"
        return out

    # ---- states: each returns True when it consumed something and the next step may run ----------
    def _step_text(self, out: list) -> bool:
        at = self._buf.find(TC_START)
        if at >= 0:
            before = self._buf[:at]
            shown = before.rstrip()
            self._text(out, shown)
            # the layout whitespace goes back with the block if it turns out not to be a call
            self._buf, self._raw, self._mode = self._buf[at + len(TC_START):], before[len(shown):] + TC_START, "name"
            return True
        keep = _held_prefix(self._buf, TC_START)
        body = self._buf[:len(self._buf) - keep]
        shown = body.rstrip()  # trailing whitespace waits: it is layout if a call follows
        self._text(out, shown)
        self._buf = self._buf[len(shown):]
        return False

    def _step_name(self, out: list) -> bool:
        end = self._buf.find("<")  # the name ends where the markup resumes
        if end < 0:
            if len(self._buf) > MAX_NAME_CHARS:
                self._mode = "bad"
                return True
            return False
        name = self._buf[:end].strip()
        if name not in self.tools:
            self._mode = "bad"
            return True
        self._current, self._pending = name, []
        self._consume(end)
        self._mode = "args"
        return True

    def _step_bad(self, out: list) -> bool:
        at = self._buf.find(TC_END)
        if at < 0:
            return False
        self._text(out, self._raw + self._buf[:at + len(TC_END)])
        self._buf, self._raw, self._mode, self._after_call = self._buf[at + len(TC_END):], "", "text", True
        return True

    def _step_args(self, out: list) -> bool:
        s = self._buf.lstrip()
        if s.startswith(TC_END):
            self._buf = s[len(TC_END):]
            self._emit_call(out)
            return True
        if s.startswith(KEY_START):
            return self._argument(s)
        if not s or KEY_START.startswith(s) or TC_END.startswith(s):
            return False  # may still become a marker
        self._mode = "bad"  # broken markup: the block is content
        return True

    def _argument(self, s: str) -> bool:
        k_end = s.find(KEY_END)
        if k_end < 0:
            if len(s) > MAX_NAME_CHARS:
                self._mode = "bad"
                return True
            return False
        key = s[len(KEY_START):k_end].strip()
        rest = s[k_end + len(KEY_END):].lstrip()
        if not rest.startswith(VAL_START):
            if VAL_START.startswith(rest):
                return False
            self._mode = "bad"
            return True
        v_end = rest.find(VAL_END)
        if v_end < 0:
            return False
        value = decode_value(self.tools[self._current], key, rest[len(VAL_START):v_end])
        self._pending.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))
        self._consume(len(self._buf) - (len(rest) - v_end - len(VAL_END)))
        return True

    # ---- helpers ----------------------------------------------------------------------------------
    def _consume(self, n: int) -> None:
        self._raw, self._buf = self._raw + self._buf[:n], self._buf[n:]

    def _emit_call(self, out: list) -> None:
        """The call read whole: its header, one fragment per argument, the closing brace."""
        self._index += 1
        out.append(ToolCallDelta(self._index, "", self._new_id(), self._current))
        out += [ToolCallDelta(self._index, ("{" if i == 0 else ", ") + f) for i, f in enumerate(self._pending)]
        out.append(ToolCallDelta(self._index, "}" if self._pending else "{}"))
        self._mode, self._raw, self._pending, self._after_call = "text", "", [], True

    def _text(self, out: list, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if text:
            out.append(text)
