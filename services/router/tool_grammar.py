"""The grammar that forces a valid tool call: `tool_choice` "required" or a named function.

From the request's tools and tool choice this builds one EBNF grammar (as xgrammar reads it) whose
sentences are exactly the GLM calls

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

of the allowed tools: every required parameter present, optional ones in the schema's order or left
out, no other keys; a string parameter's value is raw text (without `</`, which would end it early),
an enum of strings one of its members, any other value JSON matching that parameter's schema (xgrammar
builds those rules from the schema; they are embedded here under a per-value prefix). With
`parallel_tool_calls` one or more calls, else exactly one. The router sends it as the request's
structured-output spec, gated on `</think>` when the model reasons first.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from engine.structured.spec import StructuredOutputSpec

_RULE_DEF = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STRING_VALUE_RULE = 'tc_text ::= ([^<] | "<" [^/])*'


class ToolGrammarError(ValueError):
    """A tool's schema cannot be turned into a grammar (the request is refused with 400)."""


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _rename(ebnf: str, prefix: str) -> str:
    """`ebnf` with each of its rule names prefixed (string literals and character classes untouched)."""
    names = set(_RULE_DEF.findall(ebnf))
    out, i = [], 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch in "\"[":
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
            continue
        m = _IDENT.match(ebnf, i)
        if m and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
            word = m.group(0)
            out.append(prefix + word if word in names else word)
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _is_string(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "string" or (kind is None and bool(schema.get("enum"))
                                and all(isinstance(e, str) for e in schema["enum"]))


def _value(schema: dict, prefix: str, rules: list[str]) -> str:
    """The rule text for one parameter's value; any rules it needs are appended to `rules`."""
    if _is_string(schema):
        if schema.get("enum"):
            return "(" + " | ".join(_lit(e) for e in schema["enum"]) + ")"
        return "tc_text"
    try:
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ToolGrammarError(f"a tool parameter's schema cannot be enforced: {e}") from e
    rules.append(_rename(ebnf, prefix))
    return prefix + "root"


def _call(name: str, schema: dict, idx: int, sep: str, rules: list[str]) -> str:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = [_lit("<tool_call>" + name)]
    for k, (key, sub) in enumerate(props.items()):
        value = _value(sub if isinstance(sub, dict) else {}, f"tc{idx}_{k}_", rules)
        arg = " ".join(x for x in (_lit(sep) if sep else "", _lit(f"<arg_key>{key}</arg_key>"),
                                   _lit(sep) if sep else "", _lit("<arg_value>"), value,
                                   _lit("</arg_value>")) if x)
        parts.append(arg if key in required else f"({arg})?")
    parts.append(_lit(sep + "</tool_call>"))
    return " ".join(parts)


def tool_call_grammar(tools: dict[str, dict], allowed: list[str], parallel: bool, sep: str = "") -> str:
    """EBNF of one call (or, `parallel`, one or more) of a tool in `allowed`; `sep`: the parser's layout."""
    rules: list[str] = []
    calls = [_call(name, tools[name], i, sep, rules) for i, name in enumerate(allowed)]
    head = ["root ::= tc_call" + (f" ({_lit(sep)} tc_call)*" if sep and parallel else " tc_call*" if parallel else ""),
            "tc_call ::= " + " | ".join(f"({c})" for c in calls), STRING_VALUE_RULE]
    return "\n".join(head + rules) + "\n"


def tool_choice_spec(tools: dict[str, dict], allowed: list[str], parallel: bool, sep: str,
                     reasoning_end: str) -> StructuredOutputSpec:
    """The structured-output spec that forces the call; ToolGrammarError when a schema cannot be compiled."""
    ebnf = tool_call_grammar(tools, allowed, parallel, sep)
    try:
        xgr.Grammar.from_ebnf(ebnf)
    except (RuntimeError, ValueError) as e:
        raise ToolGrammarError(f"the tools' schemas cannot be enforced as a grammar: {e}") from e
    return StructuredOutputSpec.grammar(ebnf, reasoning_end)
