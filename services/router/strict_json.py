"""Request bodies parsed as strict JSON (RFC 8259), so a body no standard parser would accept is a 400.

Python's `json` accepts `NaN`, `Infinity` and `-Infinity`, turns `1e400` into an infinite float, keeps
the last of duplicate keys, and recurses as deep as the body nests. Here each of those is refused with a
message (and `param`, where a key is to blame): non-finite numbers, duplicate keys, invalid UTF-8, and
nesting deeper than MAX_DEPTH. `StrictJSONRoute` is the FastAPI route class that parses every body this
way before the endpoint's model sees it; its 400 is an OpenAI error body, or what the converter set for
the path's prefix in `app.state.error_forms` ({prefix: OpenAI JSONResponse -> Response}) makes of it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from services.router.openai_models import error_body

MAX_DEPTH = 64  # objects and arrays inside each other; OpenAI bodies nest about 6 deep (JSON schemas more)


class InvalidJSON(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# the key whose value is a refused number (found again in the text: the parser's hooks see no keys)
_KEYED_NUMBER = re.compile(r'"((?:[^"\\]|\\.){1,100})"\s*:\s*\[?\s*(NaN|-?Infinity|-?[0-9.]+[eE][-+]?[0-9]+)')


def _key_of(text: str, literal: str) -> str | None:
    for m in _KEYED_NUMBER.finditer(text):
        if m.group(2) == literal:
            return m.group(1)
    return None


class _NonFinite(InvalidJSON):
    def __init__(self, message: str, literal: str):
        super().__init__(message)
        self.literal = literal


def _no_constant(name: str) -> Any:
    raise _NonFinite(f"invalid JSON: {name} is not a JSON number (numbers must be finite)", name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"invalid JSON: the number {text[:40]} is out of the range of a double", text)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidJSON(f"invalid JSON: the key {dup[:100]!r} appears more than once in an object", dup[:100])
    return out


def _depth_ok(value: Any, max_depth: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > max_depth:
            return False
        items = list(v.values()) if isinstance(v, dict) else v
        if _CONTAINERS.isdisjoint(set(map(type, items))):  # a long prompt of token ids: one C-speed pass
            continue
        stack.extend((c, d + 1) for c in items if isinstance(c, (dict, list)))
    return True


_CONTAINERS = frozenset((dict, list))


def loads(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a request body; InvalidJSON says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSON(f"the body is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                           object_pairs_hook=_unique_keys)
    except _NonFinite as exc:
        key = _key_of(text, exc.literal)
        raise InvalidJSON(str(exc).replace("invalid JSON: ", f"invalid JSON: {key}: " if key else "", 1), key) from None
    except json.JSONDecodeError as exc:
        raise InvalidJSON(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InvalidJSON(f"invalid JSON: nested deeper than {max_depth} levels") from None
    except InvalidJSON:
        raise
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InvalidJSON(f"invalid JSON: {exc}") from None
    if isinstance(value, (dict, list)) and not _depth_ok(value, max_depth):
        raise InvalidJSON(f"invalid JSON: nested deeper than {max_depth} levels")
    return value


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = loads(await self.body())
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """Parses a POST body strictly before FastAPI validates it; a refused body answers 400."""

    def get_route_handler(self) -> Callable:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            request = _StrictRequest(request.scope, request.receive)
            if request.method == "POST" and await request.body():
                try:
                    await request.json()
                except InvalidJSON as exc:
                    return _error_form(request, JSONResponse(error_body(str(exc), code=400, param=exc.param),
                                                             status_code=400))
            return await inner(request)
        return handler


def _error_form(request: Request, response: JSONResponse) -> Response:
    forms = getattr(request.app.state, "error_forms", None) or {}
    for prefix, convert in forms.items():
        if request.url.path.startswith(prefix):
            return convert(response)
    return response
