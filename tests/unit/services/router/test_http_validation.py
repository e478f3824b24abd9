"""The router's HTTP API refuses bad numbers and bad JSON with a 400 naming the field, never a 5xx
(in-process: tests/helpers/router_harness.py; the running system: tests/e2e/test_fuzz.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from fastapi.responses import JSONResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.fuzz_bodies import (
    ENDPOINTS,
    any_body,
    inside_body,
    nested,
    numeric_body,
    numeric_properties,
    raw_bodies,
)
from tests.helpers.router_harness import make_client

CLIENT, FLOW, LIMITS = make_client()
CHAT = [{"role": "user", "content": "hi"}]


def post(path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = CLIENT.post(path, content=data, headers={"content-type": "application/json"})
    return r.status_code, (r.json() if r.content else {})


def completion(**kw):
    return post("/v1/completions", {"prompt": "hello", "max_tokens": 2, **kw})


# ---- the cases of the issue -----------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("seed", 2 ** 63), ("seed", -1180591620717411303424), ("seed", 18446744073709551621), ("seed", -2 ** 63 - 1),
    ("top_k", 1099511627776), ("top_k", 2147483648), ("top_k", 4097), ("top_k", -2),
    ("min_tokens", 2 ** 63), ("temperature", 1e300), ("top_p", 0.0), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("min_p", -0.1), ("n", 2 ** 64), ("max_tokens", 2 ** 32),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_numbers_get_400_naming_the_field(path, field, value):
    base = {"prompt": "hello"} if path == "/v1/completions" else {"messages": CHAT}
    status, body = post(path, {**base, "max_tokens": 2, field: value})
    assert status == 400, body
    assert body["error"]["param"] == field, body
    assert field in body["error"]["message"], body


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e400", "-1e400"])
def test_non_finite_json_numbers_get_400(literal):
    status, body = post("/v1/completions", f'{{"prompt": "hello", "max_tokens": 2, "temperature": {literal}}}')
    assert status == 400, body
    assert "JSON" in body["error"]["message"] and body["error"]["param"] == "temperature", body


@pytest.mark.parametrize("text", ['"Infinity"', '"NaN"', '"inf"'])
def test_non_finite_numbers_spelled_as_strings_get_400(text):
    status, body = post("/v1/completions", f'{{"prompt": "hello", "max_tokens": 2, "temperature": {text}}}')
    assert status == 400 and body["error"]["param"] == "temperature", body


def test_min_tokens_above_max_tokens_gets_400():
    status, body = completion(min_tokens=50, max_tokens=2)
    assert status == 400 and body["error"]["param"] == "min_tokens", body
    status, body = post("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "min_tokens": 4})
    assert status == 400 and body["error"]["param"] == "min_tokens", body
    assert completion(min_tokens=2, max_tokens=2)[0] == 200


def test_cross_field_rules():
    status, body = post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    status, body = post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                 "top_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    for best_of, n in ((3, 2), (1, 2), (0, 1), ("2", 2), (2 ** 64, 1)):
        status, body = completion(best_of=best_of, n=n)
        assert status == 400 and body["error"]["param"] == "best_of", body
    assert completion(best_of=1)[0] == 200


def test_edges_inside_the_ranges_are_served_and_reach_the_wire_intact():
    for kw in ({"seed": 2 ** 63 - 1, "n": 2}, {"seed": -2 ** 63}, {"top_k": 4096}, {"top_k": 0}, {"top_k": -1},
               {"temperature": 0}, {"temperature": -0.0}, {"temperature": 1e-40}, {"top_p": 1.0},
               {"repetition_penalty": 3e38}, {"presence_penalty": -2}, {"max_tokens": 4096 - 2}):
        FLOW.sent.clear()
        status, body = completion(**kw)
        assert status == 200, (kw, body)
        sent = FLOW.sent[-1].sampling_params
        for k, v in kw.items():
            if k == "seed":
                seeds = sorted(g.sampling_params.seed for g in FLOW.sent)
                assert v in seeds and all(-2 ** 63 <= s < 2 ** 63 for s in seeds), seeds
            elif k == "top_k":
                assert sent.top_k == (-1 if v == 0 else v)
            elif k != "n" and k != "temperature":
                assert getattr(sent, k) == pytest.approx(v, rel=1e-6), (k, getattr(sent, k))
    FLOW.sent.clear()
    assert completion(temperature=1e-40)[0] == 200 and FLOW.sent[-1].sampling_params.temperature == pytest.approx(1e-2)


# ---- strict JSON ------------------------------------------------------------------------------------
def test_duplicate_keys_deep_nesting_and_bad_bytes_get_400():
    status, body = post("/v1/completions", '{"prompt": "a", "max_tokens": 2, "max_tokens": 3}')
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    for raw in (nested(100_000), nested(65), '{"prompt": ' + nested(70, "{") + "}", b"\xff\xfe{}",
                b'{"prompt": "\xc3"}', '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"):
        status, body = post("/v1/completions", raw)
        assert status == 400 and body["error"]["message"], (str(raw)[:40], body)
    status, _ = post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": "a", "x": [[[1]]]}]}],
                                              "max_tokens": 2})
    assert status == 200


def test_a_path_can_have_its_own_error_form():
    app = CLIENT.app
    app.state.error_forms = {"/v1/chat": lambda r: JSONResponse({"type": "error", "message": json.loads(r.body)},
                                                                status_code=r.status_code)}
    try:
        r = CLIENT.post("/v1/chat/completions", content='{"messages": [], "temperature": NaN}')
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert post("/v1/completions", '{"prompt": "x", "top_p": NaN}')[1]["error"]["param"] == "top_p"
    finally:
        app.state.error_forms = {}


def test_empty_and_1mib_strings():
    assert completion(prompt="")[0] == 400
    status, body = completion(prompt="ab " * (1 << 18))  # 768 KiB of text: over max_model_len tokens
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    for field in ("user", "cache_salt", "model", "stop"):
        status, body = completion(**{field: "x" * (1 << 20)})
        assert status < 500, (field, body)


# ---- properties over every numeric field ------------------------------------------------------------
def test_every_numeric_field_of_every_body_is_in_the_tables():
    """A numeric field added to a request model needs a bound (services/router/validation.FIELDS), and an
    endpoint an entry in tests/helpers/fuzz_bodies.ENDPOINTS, or the fuzzers would not aim at it."""
    spec = CLIENT.get("/openapi.json").json()
    posts = {path for path, ops in spec["paths"].items() if "post" in ops}
    assert posts >= {"/v1/completions", "/v1/chat/completions"}
    for path in posts & set(ENDPOINTS):
        ep = ENDPOINTS[path]
        unbounded = numeric_properties(spec, path) - set(ep.numeric) - set(ep.extra_numeric)
        assert not unbounded, f"{path}: numeric fields without a bound: {sorted(unbounded)}"
    missing = posts - set(ENDPOINTS)
    assert not missing, f"add these endpoints to tests/helpers/fuzz_bodies.ENDPOINTS: {sorted(missing)}"

SEEN: Counter = Counter()


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_numeric_field_never_gets_a_5xx(path):
    ep = ENDPOINTS[path]
    status, out = post(path, ep.base)
    assert status == 200, ("the table's base body must be served", out)

    @given(body=st.one_of(numeric_body(ep), numeric_body(ep), any_body(ep)))
    @settings(max_examples=200 if ep.numeric else 60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def prop(body):
        status, out = post(path, body)
        SEEN[(path, status)] += 1
        assert status < 500, (body[:300], out)
        if status >= 400:
            assert out["error"]["message"], out
    prop()
    for raw in raw_bodies():
        assert post(path, raw)[0] == 400, raw[:40]
    print(path, sorted((s, n) for (p, s), n in SEEN.items() if p == path))
    assert ({200, 400} if ep.numeric else {400}) <= {s for (p, s) in SEEN if p == path}, SEEN
    assert CLIENT.get("/health").status_code == 200 and completion()[0] == 200


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_in_range_edge_is_served_by_the_router_and_accepted_by_the_engines(path):
    """Values at the inside edges of every range: 200, and the wire request passed the prefill's check
    (the router and the engines agree on every bound, float32 rounding included)."""
    ep = ENDPOINTS[path]
    if not ep.numeric:
        pytest.skip(f"{path} has no numeric fields")

    @given(body=inside_body(ep, LIMITS))
    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def prop(body):
        status, out = post(path, body)
        assert status == 200, (body, out)
    prop()
