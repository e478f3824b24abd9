"""The structured-output spec: construction checks and the wire round trip through SamplingParams."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.structured import StructuredOutputSpec as Spec
from services.rpc.convert import sampling_from_proto, sampling_to_proto


@pytest.mark.parametrize("spec", [
    Spec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    Spec.json_object(reasoning_end="</think>"),
    Spec.regex(r"[a-z]+\d"),
    Spec.choice(["yes", "no"]),
    Spec.grammar('root ::= "a" | "b"', reasoning_end="</think>"),
])
def test_round_trip_over_the_wire(spec):
    p = SamplingParams(max_tokens=7, structured_outputs=spec)
    back = sampling_from_proto(sampling_to_proto(p))
    assert back.structured_outputs == spec and back == p


def test_unset_stays_unset():
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured_outputs is None


def test_hashable_and_equal_by_value():
    a, b = Spec.json_schema({"b": 1, "a": 2}), Spec.json_schema('{"b":1,"a":2}')
    assert a == b and len({a, b}) == 1  # one cache entry for one schema
    assert Spec.json_schema({"a": 1, "b": 2}) != a  # property order orders the output: kept


@pytest.mark.parametrize("kind, text, msg", [
    ("xml", "x", "kind must be one of"),
    ("regex", "", "non-empty spec"),
    ("json_object", "{}", "takes no spec"),
    ("json", "{not json", "not valid JSON"),
    ("json", "[1]", "must be an object"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 3]', "non-empty list"),
])
def test_bad_specs_raise(kind, text, msg):
    with pytest.raises(ValueError, match=msg):
        Spec(kind, text)


def test_sampling_params_checks_the_type():
    with pytest.raises(ValueError, match="StructuredOutputSpec"):
        SamplingParams(structured_outputs={"kind": "regex"})
    assert Spec.choice(["x", "y"]).choices == ["x", "y"]
