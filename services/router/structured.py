"""Structured-output request fields -> one `StructuredOutputSpec`, checked before any engine sees it.

Accepted spellings (at most one per request; each error names its `param`):
  response_format      {"type": "text"} | {"type": "json_object"} |
                       {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
  structured_outputs   vLLM: exactly one of {"json", "regex", "choice", "grammar", "json_object"}
  guided_json / guided_regex / guided_choice / guided_grammar   (vLLM's older names)

The grammar is parsed with xgrammar here (a bad schema, regex or grammar is a 400 naming its field,
also for a streamed request); engines compile it for their tokenizer. xgrammar imports torch, so it
is loaded by the first request that carries a grammar, not when the router starts.

With a reasoning parser on, the grammar applies after the reasoning end ("</think>"), unless the spec
itself spells that marker out (it then describes the whole output, reasoning included) or the request
turned thinking off. Completions have no reasoning split: no gate.
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured.spec import StructuredOutputSpec

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs options we accept without effect (the backend is always xgrammar)
_SO_IGNORED = {"backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"}


__all__ = ["SpecError", "check_grammar", "structured_from_request"]


class SpecError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structured_from_request(body: Any, reasoning_end: str = "") -> StructuredOutputSpec | None:
    """The request's structured output, or None; SpecError(message, param) when it is malformed."""
    found = []  # (field, param of its spec, (kind, text))
    rf = _field(body, "response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", *spec))
    so = _field(body, "structured_outputs")
    if so is not None:
        found.append(("structured_outputs", *_structured_outputs(so)))
    for name, kind in GUIDED.items():
        value = _field(body, name)
        if value is not None:
            found.append((name, name, _make(kind, value, name)))
    if not found:
        return None
    if len(found) > 1:
        raise SpecError(f"give one structured output, not {' and '.join(f for f, _, _ in found)}", found[1][0])
    _, param, (kind, text) = found[0]
    gate = reasoning_end if _thinking(body) and reasoning_end not in text else ""
    try:
        spec = StructuredOutputSpec(kind, text, gate)
        check_grammar(spec)
    except ValueError as e:
        raise SpecError(str(e), param) from e
    return spec


def check_grammar(spec: StructuredOutputSpec) -> None:
    """ValueError (naming what is wrong) when xgrammar cannot parse the spec's schema, regex or grammar."""
    if spec.kind == "json_object":
        return  # a fixed grammar: nothing of the client's to parse
    from engine.structured.grammar import check_spec  # xgrammar imports torch: only once a request needs it

    check_spec(spec)


def _thinking(body: Any) -> bool:
    """False when the request turned thinking off (`chat_template_kwargs.enable_thinking: false`)."""
    kwargs = _field(body, "chat_template_kwargs")
    return not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)


def _field(body: Any, name: str):
    if isinstance(body, dict):
        return body.get(name)
    value = getattr(body, name, None)
    if value is None and getattr(body, "model_extra", None):
        value = body.model_extra.get(name)
    return value


def _response_format(rf) -> tuple[str, tuple[str, str]] | None:
    if hasattr(rf, "model_dump"):
        rf = rf.model_dump(exclude_none=True)
    if not isinstance(rf, dict):
        raise SpecError("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", ("json_object", "")
    if kind != "json_schema":
        raise SpecError(f"response_format.type must be text, json_object or json_schema; got {kind!r}",
                        "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise SpecError("response_format json_schema needs a json_schema object", "response_format.json_schema")
    for key, types in (("name", str), ("description", str), ("strict", bool)):
        if key in js and js[key] is not None and not isinstance(js[key], types):
            raise SpecError(f"response_format.json_schema.{key} must be a {types.__name__}",
                            f"response_format.json_schema.{key}")
    schema = js.get("schema", js.get("schema_"))
    if schema is None:
        raise SpecError("response_format.json_schema needs a schema", "response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return param, _make("json", schema, param)


def _structured_outputs(so) -> tuple[str, tuple[str, str]]:
    if hasattr(so, "model_dump"):
        so = so.model_dump(exclude_none=True)
    if not isinstance(so, dict):
        raise SpecError("structured_outputs must be an object", "structured_outputs")
    unknown = [k for k in so if k not in _SO_KEYS and k not in _SO_IGNORED and so[k] not in (None, False)]
    if unknown:
        raise SpecError(f"structured_outputs.{unknown[0]} is not supported (use one of {', '.join(_SO_KEYS)})",
                        f"structured_outputs.{unknown[0]}")
    given = [k for k in _SO_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise SpecError(f"structured_outputs needs exactly one of {', '.join(_SO_KEYS)}", "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return param, ("json_object", "")
    return param, _make(key, so[key], param)


def _make(kind: str, value, param: str) -> tuple[str, str]:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecError(f"the JSON schema is not valid JSON: {e}", param) from e
        if not isinstance(value, (dict, bool)):
            raise SpecError("a JSON schema must be an object", param)
        return "json", json.dumps(value, separators=(",", ":"))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise SpecError("choice must be a non-empty list of non-empty strings", param)
        return "choice", json.dumps(value, separators=(",", ":"))
    if not isinstance(value, str) or not value:
        raise SpecError(f"{param} must be a non-empty string", param)
    return kind, value
