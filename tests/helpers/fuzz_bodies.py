"""Request bodies for fuzzing the HTTP API on purpose at its edges, as raw JSON text.

One `Endpoint` entry per POST route: a valid body, its bounded numeric fields (services.router.validation
.FIELDS, the table the router checks with) and its other fields. The strategies put into those fields
integer-width edges and one past them (int32 / uint32 / int64 / uint64), negative zero, the JSON-invalid
literals `NaN`, `Infinity`, `-Infinity` and an overflowing `1e400`, empty and 1 MiB strings, values of the
wrong type, deeply nested arrays and objects, and duplicate keys. Used by tests/unit/services/router (in-process
router) and tests/e2e/test_fuzz.py (the running system).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from hypothesis import strategies as st

from services.router.anthropic.models import CountTokensRequest, MessagesRequest
from services.router.extra_api import DetokenizeRequest, TokenizeRequest
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.responses_api.models import ResponsesRequest
from services.router.validation import FIELDS
from services.rpc.bounds import BOUNDS, InvalidArgument, check_value

_EDGES = [2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64]
INT_EDGES = sorted({v + d for e in _EDGES for v in (e, -e) for d in (-1, 0, 1)} | {
    0, 1, -1, 2, 1099511627776, 18446744073709551621, -1180591620717411303424, 10 ** 30})
FLOAT_LITERALS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "-0.0", "0.0", "-0", "1e-45", "5e-324",
                  "1e-40", "3.4028235e38", "3.5e38", "1.7976931348623157e308", "0.5", "1.0", "2.0", "2.0000001",
                  "-2.0000001", "1.5", "100"]
WRONG_TYPES = ['"7"', '"NaN"', '"Infinity"', '""', "true", "false", "null", "[]", "{}", "[1, 2]", '{"a": 1}']
MIB = 1 << 20
STRINGS = ['""', json.dumps("x" * MIB), json.dumps("\u0000\ud7ff\ufffd"), json.dumps("é" * 1000)]


def nested(depth: int, kind: str = "[") -> str:
    return ("[" * depth + "]" * depth) if kind == "[" else ('{"a":' * depth + "1" + "}" * depth)


@dataclass(frozen=True)
class Endpoint:
    path: str
    base: dict  # a valid body that generates at most a few tokens
    numeric: dict[str, str]  # bounded numeric fields (-> services.rpc.bounds.BOUNDS)
    other: tuple[str, ...] = ()  # fields fuzzed with any value
    extra_numeric: tuple[str, ...] = field(default=("best_of",))  # numeric fields outside the table
    inside: dict[str, list] = field(default_factory=dict)  # field -> served values, where the API is narrower
    # field -> the largest number sent, for fields whose every size is served rather than refused (Anthropic
    # lowers max_tokens to the context window): a bigger one would only be a long generation
    cap: dict[str, int] = field(default_factory=dict)


_USER = [{"role": "user", "content": "hi"}]
_MESSAGES_NUMERIC = {k: k for k in ("max_tokens", "temperature", "top_p", "top_k")}


def _others(model, numeric) -> tuple[str, ...]:
    """A request model's fields that are not in the numeric table (fuzzed with any value)."""
    return tuple(sorted(set(model.model_fields) - set(numeric) - {"best_of"}))


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/completions": Endpoint("/v1/completions", {"prompt": "hello", "max_tokens": 2}, FIELDS["completions"],
                                _others(CompletionRequest, FIELDS["completions"])),
    "/v1/chat/completions": Endpoint("/v1/chat/completions", {"messages": _USER, "max_tokens": 2}, FIELDS["chat"],
                                     _others(ChatCompletionRequest, FIELDS["chat"])),
    # Anthropic's ranges are narrower (temperature <= 1, top_k >= 0): the served values say so
    "/v1/messages": Endpoint("/v1/messages", {"model": "tiny-code", "max_tokens": 2, "messages": _USER},
                             _MESSAGES_NUMERIC, _others(MessagesRequest, _MESSAGES_NUMERIC), (),
                             {"temperature": [0.0, 1e-30, 0.5, 1.0], "top_k": [0, 1, 4095, 4096]},
                             {"max_tokens": 8}),
    "/v1/messages/count_tokens": Endpoint("/v1/messages/count_tokens", {"model": "tiny-code", "messages": _USER},
                                          {}, _others(CountTokensRequest, {}), ()),
    # store: false, so fuzzing leaves no records behind in Redis
    "/v1/responses": Endpoint("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False},
                              FIELDS["responses"], _others(ResponsesRequest, FIELDS["responses"])),
    "/tokenize": Endpoint("/tokenize", {"prompt": "hello"}, {}, _others(TokenizeRequest, {}), ()),
    "/detokenize": Endpoint("/detokenize", {"tokens": [1, 2, 3]}, {}, _others(DetokenizeRequest, {}), ()),
}


def numeric_properties(openapi: dict, path: str) -> set[str]:
    """Top-level fields of a POST body whose schema allows a number (from the OpenAPI description)."""
    def numeric(s: dict) -> bool:
        return s.get("type") in ("integer", "number") or any(numeric(x) for x in s.get("anyOf", []))
    return {name for name, s in _body_schema(openapi, path).get("properties", {}).items() if numeric(s)}


def _body_schema(openapi: dict, path: str) -> dict:
    body = openapi["paths"][path]["post"].get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = body.get("schema", {})
    if "$ref" in schema:
        schema = openapi["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def endpoint_for(openapi: dict, path: str) -> Endpoint:
    """The table's entry, or one made from the endpoint's schema (no valid base body: mostly 400s)."""
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    props = set(_body_schema(openapi, path).get("properties", {}))
    names = numeric_properties(openapi, path)
    return Endpoint(path, {}, {}, tuple(sorted(props - names)), tuple(sorted(names)))


def _number() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([str(v) for v in INT_EDGES]), st.sampled_from(FLOAT_LITERALS),
                     st.integers(-2 ** 70, 2 ** 70).map(str), st.integers(-3, 20).map(str),
                     st.floats(allow_nan=False, allow_infinity=False).map(repr), st.floats(-3, 3).map(repr))


def _any_value() -> st.SearchStrategy[str]:
    return st.one_of(_number(), st.sampled_from(WRONG_TYPES + STRINGS),
                     st.integers(1, 200).map(nested), st.integers(1, 200).map(lambda d: nested(d, "{")))


def _render(pairs: list[tuple[str, str]], cap: dict[str, int] | None = None) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {_capped(v, (cap or {}).get(k))}" for k, v in pairs) + "}"


def _capped(text: str, cap: int | None) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    return str(cap) if cap is not None and math.isfinite(value) and value > cap else text


@st.composite
def numeric_body(draw, ep: Endpoint) -> str:
    """The valid body with 1-3 of its numeric fields set to an edge value (a number, mostly)."""
    names = sorted(ep.numeric) + list(ep.extra_numeric) or list(ep.other) or ["_"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    values = {k: draw(st.one_of(_number(), _number(), st.sampled_from(WRONG_TYPES))) for k in chosen}
    pairs = [(k, json.dumps(v)) for k, v in ep.base.items() if k not in values] + list(values.items())
    return _render(pairs, ep.cap)


@st.composite
def any_body(draw, ep: Endpoint) -> str:
    """The valid body with any of its fields set to anything above, or a key twice, or deep nesting."""
    names = sorted(ep.numeric) + list(ep.extra_numeric) + list(ep.other) or ["_"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    pairs = [(k, json.dumps(v)) for k, v in ep.base.items() if k not in chosen]
    pairs += [(k, draw(_any_value())) for k in chosen]
    if draw(st.booleans()):  # a key twice
        k = draw(st.sampled_from([p[0] for p in pairs]))
        pairs.append((k, draw(_any_value())))
    return _render(pairs, ep.cap)


SHORT = {"max_tokens": [1, 2], "min_tokens": [0, 1], "n": [1, 2]}  # generation length is not what is fuzzed


def inside_edges(bound: str, limits) -> list:
    """The values at the edges inside a field's range (served, so they also reach the engines)."""
    if bound in SHORT:
        return SHORT[bound]
    b = BOUNDS[bound]
    lo, hi = b.range(limits)
    candidates = ((lo, lo + 1, hi - 1, hi, *b.off) if b.kind is int else
                  (lo, math.nextafter(lo, hi), 1e-38, 1e-30, 1.0, hi / 2, hi, -0.0, 0.0))
    return sorted({v for v in candidates if _accepted(bound, v, limits)})


def _accepted(bound: str, value, limits) -> bool:
    try:
        check_value(bound, value, limits)
    except InvalidArgument:
        return False
    return True


@st.composite
def inside_body(draw, ep: Endpoint, limits) -> str:
    """The valid body with 1-4 numeric fields at an inside edge (every one in range: expect 200)."""
    chosen = draw(st.lists(st.sampled_from(sorted(ep.numeric)), min_size=1, max_size=4, unique=True))
    values = {k: draw(st.sampled_from(ep.inside.get(k) or inside_edges(ep.numeric[k], limits))) for k in chosen}
    if "top_logprobs" in values:
        values["logprobs"] = True
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens", ep.base.get("max_tokens", 2)))
    if "min_tokens" in ep.numeric:
        values["min_tokens"] = min(values.get("min_tokens", 0), max_tokens)
    return _render([(k, json.dumps(v)) for k, v in {**ep.base, **values}.items()], ep.cap)


def raw_bodies() -> list[str]:
    """Bodies that are not a JSON object with fields: invalid, deep, or a bare literal."""
    return ["NaN", "Infinity", "[]", "null", "1e400", '"x"', "{", '{"prompt": "x",}', nested(100_000),
            nested(10_000, "{"), "\ufeff{}", '{"a": 1, "a": 2}']
