"""The GLM tool-call parser and the <think> reasoning parser, on whole texts and at every split point."""

from __future__ import annotations

import itertools
import json

import pytest

from services.router.reasoning import ThinkReasoningParser, reasoning_parser
from services.router.tool_parsers import ToolCallDelta, collect, tool_parser, tool_schemas

TOOLS = tool_schemas([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}, "tag": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "noop"}}])


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _run(pieces, name="glm47"):
    p = tool_parser(name)(TOOLS, new_id=_ids())
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    return events, collect(events)


# (output text, expected content, expected [(name, arguments dict)])
CASES = [
    ("plain answer, no call\n", "plain answer, no call\n", []),
    (("Let me check.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich \"x\"</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
     "Let me check.", [("get_weather", {"city": 'Zürich "x"', "days": 3})]),
    (("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>opts</arg_key>\n"
     "<arg_value>{\"a\": [1, 2]}</arg_value>\n</tool_call>\n<tool_call>noop</tool_call>\n"),
     "", [("get_weather", {"city": "42", "opts": {"a": [1, 2]}}), ("noop", {})]),
    (("<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value><arg_key>tag</arg_key>"
     "<arg_value>7</arg_value><arg_key>extra</arg_key><arg_value>[1]</arg_value></tool_call> done"),
     "done", [("get_weather", {"days": "three", "tag": "7", "extra": [1]})]),
    # an unknown tool: the block is plain content
    ("a <tool_call>rm_rf<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>b",
     "a <tool_call>rm_rf<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>b", []),
    # broken markup inside a call: the block is content, exactly as written; a later call still counts
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>oops</tool_call>",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>oops</tool_call>", []),
    ("<tool_call>get_weather<arg_key>city</arg_key>junk</tool_call>\n<tool_call>noop</tool_call>",
     "<tool_call>get_weather<arg_key>city</arg_key>junk</tool_call>", [("noop", {})]),
    # cut off by max_tokens in the middle of an argument, or before </tool_call>: content, no call
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro", []),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_", []),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>", []),
    ("Hi.\n<tool_call>noop</tool_call>\n<tool_call>get_weather<arg_key>days</arg_key><arg_val",
     "Hi.<tool_call>get_weather<arg_key>days</arg_key><arg_val", [("noop", {})]),  # layout dropped
    ("x < y and <tool_ca", "x < y and <tool_ca", []),
    ("<tool_call>never closed", "<tool_call>never closed", []),
]


@pytest.mark.parametrize("name", ["glm47", "glm45"])
@pytest.mark.parametrize("text,content,calls", CASES)
def test_tool_parser_whole_and_every_split(name, text, content, calls):
    _, (got_content, got_calls) = _run([text], name)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
    whole = (got_content, [c.to_openai() for c in got_calls])
    events, (c1, k1) = _run(list(text), name)  # one character at a time
    assert (c1, [c.to_openai() for c in k1]) == whole
    for cut in range(1, len(text)):
        _, (c2, k2) = _run([text[:cut], text[cut:]], name)
        assert (c2, [c.to_openai() for c in k2]) == whole, cut
    # a call's first delta names it; then only argument fragments; never a partial marker in content
    seen = set()
    for e in events:
        if isinstance(e, ToolCallDelta):
            assert (e.name is not None) == (e.index not in seen) and (e.id is None) == (e.name is None)
            seen.add(e.index)
    if calls:
        assert not any(isinstance(e, str) and e.endswith("<tool_c") for e in events)


def test_tool_call_goes_out_whole_at_its_end_marker():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
    p = tool_parser("glm47")(TOOLS, new_id=_ids())
    end = text.index("</tool_call>")
    assert [e for c in text[:end + len("</tool_call")] for e in p.feed(c)] == []  # nothing until the call is whole
    assert p.feed(">") == [ToolCallDelta(0, "", "call_0", "get_weather"), ToolCallDelta(0, '{"city": "Oslo"'),
                           ToolCallDelta(0, ', "days": 2'), ToolCallDelta(0, "}")]
    assert p.finish() == []


def test_cut_off_call_is_content_and_sends_no_delta():
    text = "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>da"
    p = tool_parser("glm47")(TOOLS, new_id=_ids())
    streamed = [e for c in text for e in p.feed(c)]
    assert "".join(streamed) == "Sure." and all(isinstance(e, str) for e in streamed)  # the block waits
    assert p.finish() == [text[len("Sure."):]]


REASONING_CASES = [
    # (output, starts inside <think>, reasoning, content)
    ("<think>plan it</think>The answer.", False, "plan it", "The answer."),
    ("plan it</think>\nThe answer.", True, "plan it", "\nThe answer."),
    ("no thinking at all", False, None, "no thinking at all"),
    ("still thinking when cut off </thi", True, "still thinking when cut off </thi", ""),
    ("<thinking is a word", False, None, "<thinking is a word"),
    ("<thi", False, None, "<thi"),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("x", True, "x", ""),
    ("<think>x</think>y", True, "x", "y"),  # the prompt opened it and the model wrote it again
    ("<thi", True, "<thi", ""),
    ("", True, "", ""),
]


@pytest.mark.parametrize("text,inside,reasoning,content", REASONING_CASES)
def test_reasoning_parser_whole_and_every_split(text, inside, reasoning, content):
    cls = reasoning_parser("glm45")
    assert cls.split(cls(inside), text) == (reasoning, content)
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]:
        p = cls(inside)
        parts = [p.feed(piece) for piece in pieces] + [p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning or "", content)
        assert p.saw_reasoning == (reasoning is not None)


def test_prompt_that_opens_think():
    assert ThinkReasoningParser.starts_in_reasoning("<|user|>hi<|assistant|><think>")
    assert not ThinkReasoningParser.starts_in_reasoning("<|user|>hi<|assistant|></think>")
    assert not ThinkReasoningParser.starts_in_reasoning("<|assistant|><think>a</think>b<|user|>c<|assistant|>")
    with pytest.raises(ValueError):
        reasoning_parser("nope")
    with pytest.raises(ValueError):
        tool_parser("nope")
