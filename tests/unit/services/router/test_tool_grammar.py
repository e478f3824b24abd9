"""The forced-tool-call grammar accepts exactly the GLM calls of the allowed tools that fit their schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.router.tool_grammar import ToolGrammarError, _rename, tool_call_grammar, tool_choice_spec
from services.router.tool_parsers import collect, tool_parser

xgr_testing = pytest.importorskip("xgrammar.testing")

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
        "units": {"enum": ["c", "f"]}, "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                "required": ["x"]}}, "required": ["city"]},
    "noop": {"type": "object", "properties": {}},
}
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>São <b> Paulo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"x\": true}</arg_value>"
        "</tool_call>")
NOOP = "<tool_call>noop</tool_call>"


def _accepts(ebnf: str, text: str) -> bool:
    import xgrammar as xgr

    return xgr_testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


@pytest.mark.parametrize("text,ok", [
    (CALL, True), (NOOP, False),  # named: only get_weather
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>", True),
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>", False),  # city missing
    (("<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value><arg_key>days</arg_key>"
     "<arg_value>0</arg_value></tool_call>"), False),  # below minimum
    (("<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value><arg_key>units</arg_key>"
     "<arg_value>k</arg_value></tool_call>"), False),  # not in the enum
    (("<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value><arg_key>zip</arg_key>"
     "<arg_value>1</arg_value></tool_call>"), False),  # no such parameter
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</b</arg_value></tool_call>", False),
    (CALL + CALL, False),  # one call only
    ("Sure! " + CALL, False),
])
def test_named_function_grammar(text, ok):
    assert _accepts(tool_call_grammar(TOOLS, ["get_weather"], parallel=False), text) is ok


def test_required_parallel_and_glm45_layout():
    ebnf = tool_call_grammar(TOOLS, list(TOOLS), parallel=True)
    assert _accepts(ebnf, CALL + NOOP + CALL) and _accepts(ebnf, NOOP) and not _accepts(ebnf, "")
    layout = tool_call_grammar(TOOLS, ["noop", "get_weather"], parallel=True, sep="\n")
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
            "\n<tool_call>noop\n</tool_call>")
    assert _accepts(layout, text) and not _accepts(layout, text.replace("\n", ""))


def test_accepted_calls_parse_to_arguments_that_validate():
    for text in (CALL, ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>12</arg_value>"
                       "<arg_key>units</arg_key><arg_value>f</arg_value></tool_call>")):
        assert _accepts(tool_call_grammar(TOOLS, ["get_weather"], False), text)
        p = tool_parser("glm47")(TOOLS)
        content, (call,) = collect(p.feed(text) + p.finish())
        assert content == ""
        jsonschema.validate(json.loads(call.arguments), TOOLS["get_weather"])


def test_spec_and_errors():
    spec = tool_choice_spec(TOOLS, ["noop"], False, "", "</think>")
    assert spec.kind == "grammar" and spec.reasoning_end == "</think>"
    with pytest.raises(ToolGrammarError):
        tool_choice_spec({"f": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}},
                         ["f"], False, "", "")
    assert _rename('root ::= a "root a" [a]\na ::= "x"\n', "p_") == 'p_root ::= p_a "root a" [a]\np_a ::= "x"\n'
