"""The numeric bounds of every request field, declared once and checked by every API.

A request value is checked before anything converts it (a protobuf setter, `float()`, an engine), so a
bad one is the client's error (HTTP 400 / gRPC INVALID_ARGUMENT naming the field), never a 500. Each
field's range is the intersection of

- its wire range, read from the type of the `pdserve.v1.SamplingParams` field that carries it
  (int32 / uint32 / int64 / uint64; a float field holds a finite float32), and
- its product range in `BOUNDS`: a number, or the name of a deployment limit (`vocab_size`,
  `max_model_len`, `max_n`) read from the `limits` object handed to the checks.

`seed` is a signed 64-bit integer, [-2^63, 2^63 - 1] (vLLM's range, torch's `long`); the n samples of
one seeded request use seed, seed + 1, ... wrapped around within that range (`seed_for_sample`).
`top_k` is -1 or 0 (off) up to the vocabulary size. Token counts are at most `max_model_len`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from proto.pdserve.v1 import common_pb2

FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 1e-6
_T = FieldDescriptor
_INT_RANGES = {_T.TYPE_INT32: (-2 ** 31, 2 ** 31 - 1), _T.TYPE_SINT32: (-2 ** 31, 2 ** 31 - 1),
               _T.TYPE_SFIXED32: (-2 ** 31, 2 ** 31 - 1), _T.TYPE_UINT32: (0, 2 ** 32 - 1),
               _T.TYPE_FIXED32: (0, 2 ** 32 - 1), _T.TYPE_INT64: (-2 ** 63, 2 ** 63 - 1),
               _T.TYPE_SINT64: (-2 ** 63, 2 ** 63 - 1), _T.TYPE_SFIXED64: (-2 ** 63, 2 ** 63 - 1),
               _T.TYPE_UINT64: (0, 2 ** 64 - 1), _T.TYPE_FIXED64: (0, 2 ** 64 - 1)}
_FLOAT_TYPES = {_T.TYPE_FLOAT: FLOAT32_MAX, _T.TYPE_DOUBLE: float("inf")}


class InvalidArgument(ValueError):
    """A request field is out of range or inconsistent: HTTP 400 with `param`, gRPC INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class ModelLimits:
    """The deployment limits an engine service checks requests against (the router's `Limits` has more)."""

    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, engine_config) -> ModelLimits:
        return cls(engine_config.scheduler.max_model_len, engine_config.model.vocab_size)


def wire_range(field: str, message=common_pb2.SamplingParams) -> tuple[float, float]:
    """[lo, hi] that the proto field `field` of `message` can hold (floats: ± the largest finite value)."""
    f = message.DESCRIPTOR.fields_by_name[field]
    if f.type in _INT_RANGES:
        return _INT_RANGES[f.type]
    if f.type in _FLOAT_TYPES:
        return -_FLOAT_TYPES[f.type], _FLOAT_TYPES[f.type]
    raise TypeError(f"{message.DESCRIPTOR.name}.{field} is not a numeric field")


@dataclass(frozen=True)
class Bound:
    """One field's product range; `wire` names the SamplingParams field whose type bounds it further."""

    kind: type  # int or float
    lo: float | str | None = None  # None: the wire's bound; str: the name of a limit
    hi: float | str | None = None
    wire: str | None = None
    lo_open: bool = False  # lo itself excluded (top_p > 0)
    hi_open: bool = False  # hi itself excluded (token ids < vocab_size)
    off: tuple = ()  # values outside [lo, hi] that mean "disabled"
    hi_code: str = "invalid_request"  # the OpenAI error code of a value above hi
    note: str = ""

    def range(self, limits: Any) -> tuple[float, float]:
        w_lo, w_hi = wire_range(self.wire) if self.wire else (-math.inf, math.inf)
        lo = getattr(limits, self.lo) if isinstance(self.lo, str) else self.lo
        hi = getattr(limits, self.hi) if isinstance(self.hi, str) else self.hi
        lo, hi = (w_lo if lo is None else max(lo, w_lo)), (w_hi if hi is None else min(hi, w_hi))
        return (_f32(lo), _f32(hi)) if self.float32 else (lo, hi)

    @property
    def float32(self) -> bool:
        """Carried in a proto `float`: compared as the float32 the wire will hold, so the router and the
        engines (which see only that float32) accept exactly the same values."""
        return self.kind is float and self.wire is not None and wire_range(self.wire)[1] == FLOAT32_MAX

    def describe(self, lo: float, hi: float) -> str:
        text = f"{'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}{')' if self.hi_open else ']'}"
        return text + (f" ({self.note})" if self.note else "")


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(float, 0.0, wire="temperature", note="0 = greedy"),
    "top_p": Bound(float, 0.0, 1.0, wire="top_p", lo_open=True),
    "top_k": Bound(int, 1, "vocab_size", wire="top_k", off=(-1, 0), note="-1 or 0 = off"),
    "min_p": Bound(float, 0.0, 1.0, wire="min_p"),
    "seed": Bound(int, wire="seed", note="a signed 64-bit integer"),
    "max_tokens": Bound(int, 1, "max_model_len", wire="max_tokens", hi_code="context_length_exceeded"),
    "min_tokens": Bound(int, 0, "max_model_len", wire="min_tokens"),
    "logprobs": Bound(int, 0, MAX_LOGPROBS, wire="logprobs"),
    "presence_penalty": Bound(float, -2.0, 2.0, wire="presence_penalty"),
    "frequency_penalty": Bound(float, -2.0, 2.0, wire="frequency_penalty"),
    # below 1e-6 the penalised float32 logits overflow to inf (NaN probabilities)
    "repetition_penalty": Bound(float, MIN_REPETITION_PENALTY, wire="repetition_penalty"),
    "token_id": Bound(int, 0, "vocab_size", wire="stop_token_ids", hi_open=True),
    "n": Bound(int, 1, "max_n"),
}


def _f32(x: float) -> float:
    """x as the nearest float32 (|x| <= FLOAT32_MAX: the range check comes first)."""
    return struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) else x


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_value(name: str, value: Any, limits: Any, param: str | None = None) -> None:
    """Raise InvalidArgument naming `param` (default: `name`) unless `value` lies in BOUNDS[name]."""
    b, param, given = BOUNDS[name], param or name, value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (b.kind is int and isinstance(value, float)):
        kind = "an integer" if b.kind is int else "a number"
        raise InvalidArgument(f"{param} must be {kind}, got {_short(value)}", param)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{param} must be a finite number, got {value}", param)
    if value in b.off:
        return
    lo, hi = b.range(limits)
    if b.float32 and -FLOAT32_MAX <= value <= FLOAT32_MAX:
        value = _f32(value)  # what the wire will carry
    below = value < lo or (b.lo_open and value == lo)
    above = value > hi or (b.hi_open and value == hi)
    if below or above:
        raise InvalidArgument(f"{param} must be in {b.describe(lo, hi)}, got {_short(given)}", param,
                              b.hi_code if above else "invalid_request")


def check_values(values: Mapping[str, Any], names: Mapping[str, str], limits: Any) -> None:
    """Check every field of `values` that `names` maps to a bound (field -> BOUNDS key); None = unset."""
    for field, bound in names.items():
        value = values.get(field)
        if value is not None:
            check_value(bound, value, limits, field)


def check_token_ids(ids: Any, limits: Any, param: str) -> None:
    """Every token id an integer in [0, vocab_size) (the fast check first: prompts can be long)."""
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < limits.vocab_size)):
        return
    bad = [t for t in ids if not (type(t) is int and 0 <= t < limits.vocab_size)]
    raise InvalidArgument(f"{param}: token ids must be integers in [0, {limits.vocab_size}); got "
                          f"{', '.join(_short(t) for t in bad[:5])}", param)


def check_min_max_tokens(min_tokens: int, max_tokens: int, min_param: str = "min_tokens") -> None:
    if min_tokens > max_tokens:
        raise InvalidArgument(f"{min_param} ({min_tokens}) must not exceed max_tokens ({max_tokens})", min_param)


def seed_for_sample(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request with n samples: seed + index, wrapped into int64."""
    return (seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63


# ---- gRPC: the same bounds on a received message ---------------------------------------------------
_SCALAR_FIELDS = {b.wire: name for name, b in BOUNDS.items() if b.wire and name != "token_id"}
DEFAULT_MAX_TOKENS = SamplingParams.__dataclass_fields__["max_tokens"].default


def check_sampling_proto(m: common_pb2.SamplingParams, limits: Any, prefix: str = "sampling_params") -> None:
    """Every bounded field of a wire SamplingParams (an unset optional one takes the engine's default)."""
    fields = m.DESCRIPTOR.fields_by_name
    for field, name in _SCALAR_FIELDS.items():
        if not fields[field].has_presence or m.HasField(field):
            check_value(name, getattr(m, field), limits, f"{prefix}.{field}")
    check_token_ids(m.stop_token_ids, limits, f"{prefix}.stop_token_ids")
    max_tokens = m.max_tokens if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    check_min_max_tokens(m.min_tokens, max_tokens, f"{prefix}.min_tokens")


def check_generate_proto(g: common_pb2.GenerateRequest, limits: Any, prefix: str = "request") -> None:
    """What an engine service checks of the GenerateRequest inside a Prefill or Decode request: its
    prompt as token ids (the router tokenizes) and its sampling parameters."""
    ids = g.prompt_token_ids
    if not ids:
        raise InvalidArgument(f"{prefix}.prompt_token_ids is empty: the router tokenizes; give at least one token",
                              f"{prefix}.prompt_token_ids")
    check_token_ids(ids, limits, f"{prefix}.prompt_token_ids")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(f"{prefix}.prompt_token_ids has {len(ids)} tokens; the maximum context length is "
                              f"{limits.max_model_len}", f"{prefix}.prompt_token_ids", "context_length_exceeded")
    check_sampling_proto(g.sampling_params, limits, f"{prefix}.sampling_params")
    outs = g.output_token_ids
    if outs:  # a migrated request: its tokens so far, all outputs
        check_token_ids(outs, limits, f"{prefix}.output_token_ids")
        if len(ids) + len(outs) >= limits.max_model_len:
            raise InvalidArgument(f"{prefix} has {len(ids)} prompt and {len(outs)} output tokens; the maximum "
                                  f"context length is {limits.max_model_len}", f"{prefix}.output_token_ids",
                                  "context_length_exceeded")
        if g.sampling_params.HasField("max_tokens") and len(outs) >= g.sampling_params.max_tokens:
            raise InvalidArgument(f"{prefix}.output_token_ids holds {len(outs)} tokens, max_tokens is "
                                  f"{g.sampling_params.max_tokens}: nothing is left to generate",
                                  f"{prefix}.output_token_ids")
