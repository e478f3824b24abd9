"""The numeric checks of the router's HTTP bodies: which field of which endpoint has which bound
(services/rpc/bounds.py declares the bounds), and the rules between fields.

Run on the parsed body before anything converts a value (SamplingParams, a protobuf message), so an
out-of-range number is a 400 whose `param` names the field. A new endpoint or field is one entry in
`FIELDS` (body field -> BOUNDS key); the fuzz tests read the same table.
"""

from __future__ import annotations

from typing import Any

from services.rpc.bounds import InvalidArgument, check_value, check_values

_SAMPLING = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                     "frequency_penalty", "repetition_penalty", "min_tokens", "max_tokens", "n")}

FIELDS: dict[str, dict[str, str]] = {
    "completions": {**_SAMPLING, "logprobs": "logprobs"},
    "chat": {**_SAMPLING, "max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"},
    "responses": {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens"},
}


def _values(body: Any) -> dict[str, Any]:
    """The body's fields, declared and extra (a pydantic model or a plain dict)."""
    if isinstance(body, dict):
        return body
    return {**(getattr(body, "model_extra", None) or {}), **dict(body)}


def check_body(body: Any, endpoint: str, limits: Any) -> None:
    """Every bounded field of `body` in range, then the rules between fields; InvalidArgument names the field."""
    values = _values(body)
    check_values(values, FIELDS[endpoint], limits)
    _check_best_of(values, limits)
    if endpoint == "chat" and values.get("top_logprobs") is not None and not values.get("logprobs"):
        raise InvalidArgument("top_logprobs needs logprobs: true", "top_logprobs")


def _check_best_of(values: dict[str, Any], limits: Any) -> None:
    """best_of (vLLM: sample best_of, return the n best) is not implemented: only best_of = n is accepted."""
    best_of = values.get("best_of")
    if best_of is None:
        return
    check_value("n", best_of, limits, "best_of")
    n = values.get("n") or 1
    if best_of != n:
        raise InvalidArgument(f"best_of other than n is not supported (best_of {best_of}, n {n})", "best_of")
