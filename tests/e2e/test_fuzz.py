"""Fuzzing the running system (deployment: `hardened`):

- the HTTP API from its own OpenAPI description (schemathesis; a bounded number of examples per
  operation): every answer is < 500, and the services stay up;
- every POST endpoint with bodies built at the edges on purpose (tests/helpers/fuzz_bodies.py:
  integer-width edges and one past them, NaN / Infinity as JSON literals, 1 MiB strings, wrong types,
  duplicate keys, deep nesting): every answer is < 500, with a count of requests per endpoint and status;
- every gRPC method with corrupt bytes, out-of-range fields, huge numbers, empty ids and invalid KV
  handles: each answers OK or a declared error code with a reason (INVALID_ARGUMENT, NOT_FOUND, ...),
  never UNKNOWN / INTERNAL / a crash; afterwards no engine holds a block and the kvstore pool adds up.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from types import SimpleNamespace

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from engine import SamplingParams
from proto.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
)
from services.rpc.convert import sampling_to_proto
from services.rpc.grpc_server import check_health
from tests.helpers import hardened as h
from tests.helpers import system
from tests.helpers.fuzz_bodies import ENDPOINTS, any_body, endpoint_for, inside_body, numeric_body, raw_bodies
from tests.helpers.hardened import HARDENED_LIMITS

pytestmark = pytest.mark.xdist_group("hardened")

MAX_FUZZ_TOKENS = 8  # generation length is not what is fuzzed; it only costs CI time
EXAMPLES_PER_OPERATION = 40
DECLARED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE}


def _bounded(case) -> None:
    """Cap generation lengths that the schema allows (the prompt and every other field stay fuzzed); on an
    endpoint that serves every size (ENDPOINTS[...].cap), any size."""
    if isinstance(case.body, dict):
        capped = ENDPOINTS[case.path].cap if case.path in ENDPOINTS else {}
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(key)
            top = math.inf if key in capped else 4096
            if isinstance(value, (int, float)) and not isinstance(value, bool) and MAX_FUZZ_TOKENS < value <= top:
                case.body[key] = MAX_FUZZ_TOKENS
        # no max_tokens means "the rest of the context" for chat, and so does an explicit null for completions:
        # thousands of tokens on a CPU engine, past the client's timeout
        unset = all(case.body.get(k) is None for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"))
        if unset and "input" in case.body:  # /v1/responses: no max_output_tokens means the rest of the context
            case.body["max_output_tokens"] = MAX_FUZZ_TOKENS
        elif unset and ("messages" in case.body or "max_tokens" in case.body):
            case.body["max_tokens"] = MAX_FUZZ_TOKENS


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_http_api_never_answers_5xx(hardened, mode):
    """Every operation of /openapi.json, with bodies that match the schema (positive) and that
    violate it (negative): no 5xx, and every error is the OpenAI error shape with a reason."""
    schema = schemathesis.openapi.from_url(hardened.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    calls: list[tuple[str, int]] = []
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            _bounded(case)
            response = case.call(headers=h.auth("beta"), timeout=60)
            calls.append((op.path, response.status_code))
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            if response.status_code >= 400:
                assert response.json()["error"]["message"], response.text[:500]
        try:
            fuzz()
        except Unsatisfiable:  # negative mode: an operation without inputs (GET /health) has nothing to violate
            assert mode == GenerationMode.NEGATIVE and op.method.upper() == "GET", op
    print(mode.value, sorted(Counter(calls).items()))
    assert len(calls) >= len(operations)
    if mode == GenerationMode.NEGATIVE:  # schema violations are refused, not served
        assert any(status == 400 for _, status in calls), calls


BOUNDARY_EXAMPLES = 120  # per endpoint with numeric fields (a quarter for others); 400s take milliseconds,
# the served ones (<= 2 tokens) ~0.2 s on two cores
ISSUE_CASES = [("seed", 2 ** 63), ("seed", -1180591620717411303424), ("seed", 18446744073709551621),
               ("top_k", 1099511627776), ("top_k", 2147483648), ("temperature", "Infinity"), ("min_tokens", 2 ** 63)]


def _post(client: httpx.Client, path: str, text: str) -> tuple[int, dict]:
    r = client.post(path, content=text.encode("utf-8", "surrogatepass"),
                    headers={"content-type": "application/json", **h.auth("beta")})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"raw": r.text[:200]}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@pytest.mark.parametrize("field,value", ISSUE_CASES)
def test_out_of_range_numbers_of_the_issue_get_400(hardened, path, field, value):
    with httpx.Client(base_url=hardened.url, timeout=60) as client:
        body = json.dumps(ENDPOINTS[path].base)[:-1] + f', "{field}": {value}}}'
        status, out = _post(client, path, body)
        assert status == 400 and _names(out, field), out
        base = {**ENDPOINTS[path].base, "min_tokens": 50, "max_tokens": 2}
        status, out = _post(client, path, json.dumps(base))
        assert status == 400 and _names(out, "min_tokens"), out


def _names(out: dict, field: str) -> bool:
    """The error names the field: OpenAI's body in `param` (and its message), others in the message."""
    err = out["error"]
    return err.get("param", field) == field and field in err["message"]


def test_http_boundary_values_never_answer_5xx(hardened):
    """Every POST endpoint of /openapi.json, none answering a body built at the edges with a 5xx. One
    without an entry in tests/helpers/fuzz_bodies.ENDPOINTS is fuzzed from its schema alone (no valid
    base body, so mostly 400s: give it an entry)."""
    spec = json.loads(httpx.get(hardened.url + "/openapi.json", timeout=30).text)
    posts = {path for path, ops in spec["paths"].items() if "post" in ops}
    print("boundary fuzz: endpoints without a table entry (schema only):", sorted(posts - set(ENDPOINTS)))
    model = httpx.get(hardened.url + "/v1/models", headers=h.auth(), timeout=30).json()["data"][0]
    limits = SimpleNamespace(max_model_len=model["max_model_len"], vocab_size=model["vocab_size"],
                             max_n=HARDENED_LIMITS["max_n"])
    counts: Counter = Counter()
    t0 = time.monotonic()
    with httpx.Client(base_url=hardened.url, timeout=60) as client:
        for path in sorted(posts):
            ep = endpoint_for(spec, path)
            bodies = [numeric_body(ep), any_body(ep)] + ([inside_body(ep, limits)] if ep.numeric else [])

            @given(text=st.one_of(*bodies))
            @settings(max_examples=BOUNDARY_EXAMPLES if ep.numeric else BOUNDARY_EXAMPLES // 4, deadline=None,
                      derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(text):
                status, out = _post(client, path, text)
                counts[(path, status)] += 1
                assert status < 500, (text[:300], status, out)
                if status >= 400:
                    assert out["error"]["message"], out
            fuzz()
            for text in raw_bodies():
                status, out = _post(client, path, text)
                counts[(path, status)] += 1
                assert 400 <= status < 500, (text[:40], status, out)
    for path in sorted(posts):
        per = {s: n for (p, s), n in counts.items() if p == path}
        print(f"boundary fuzz {path}: {sum(per.values())} requests, by status {dict(sorted(per.items()))}")
        assert sum(per.values()) >= BOUNDARY_EXAMPLES // 4 and 400 in per, per
        assert 200 in per or not endpoint_for(spec, path).numeric, (path, per)
    print(f"boundary fuzz: {sum(counts.values())} requests in {time.monotonic() - t0:.1f}s")
    _assert_nothing_leaked(hardened)


def test_services_up_after_http_fuzzing(hardened):
    insts = h.instances(hardened)
    status, body, _ = h.request(hardened.url, "/v1/completions", {"prompt": "ok", "max_tokens": 2}, h.auth())
    assert status == 200, body
    assert h.engines_idle(insts), "HTTP fuzzing left blocks in use"


# ---- gRPC --------------------------------------------------------------------------------------------
UNARY = ["/pdserve.v1.Prefill/Prefill", "/pdserve.v1.Prefill/ReleaseKV", "/pdserve.v1.Prefill/RenewLease",
         "/pdserve.v1.Prefill/Abort", "/pdserve.v1.Decode/Abort", "/pdserve.v1.KVStore/Describe",
         "/pdserve.v1.KVStore/Lookup", "/pdserve.v1.KVStore/Reserve", "/pdserve.v1.KVStore/Commit",
         "/pdserve.v1.KVStore/Load", "/pdserve.v1.KVStore/Release"]
STREAM = ["/pdserve.v1.Decode/Generate", "/pdserve.v1.Router/Generate"]
KEY = (("authorization", "Bearer " + h.HARDENED_KEYS["alpha"][0]),)


def _addresses(dep) -> dict[str, str]:
    insts = h.instances(dep)
    return {"Prefill": insts["prefill"].grpc_address, "Decode": insts["decode"].grpc_address,
            "KVStore": insts["kvstore"].grpc_address, "Router": dep.endpoints()["router_grpc"][0]}


async def _call(address: str, method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """One call with `raw` as the serialized request; a stream is read to its first reply, then cancelled."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            if method in STREAM:
                call = ch.unary_stream(method)(raw, metadata=KEY, timeout=60)
                await call.read()
                call.cancel()
            else:
                await ch.unary_unary(method)(raw, metadata=KEY, timeout=60)
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""


def _check(results: list[tuple[str, object, grpc.StatusCode, str]]) -> None:
    bad = [r for r in results if r[2] not in DECLARED or (r[2] != grpc.StatusCode.OK and not r[3])]
    assert not bad, "undeclared codes or errors without a reason:\n" + "\n".join(map(repr, bad[:10]))


def _sampling(**kw) -> common_pb2.SamplingParams:
    s = sampling_to_proto(SamplingParams(max_tokens=4))
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(s, k)[:] = v
        else:
            setattr(s, k, v)
    return s


def _structured(prompt: list[int]) -> list[tuple[str, object, set]]:
    """Out-of-range and nonsense fields, each with the codes it may get."""
    inv = {grpc.StatusCode.INVALID_ARGUMENT}

    def gen(**kw):
        return common_pb2.GenerateRequest(request_id=kw.pop("rid", "fz"), prompt_token_ids=kw.pop("ids", prompt),
                                          sampling_params=_sampling(**kw))
    return [
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(ids=[4096 + 5])), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(ids=[5] * 5000)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(max_tokens=0)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(logprobs=10 ** 6)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(temperature=float("nan"))), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(top_p=-3.0)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(min_tokens=2 ** 31)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(top_k=2 ** 31 - 1)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(temperature=float("inf"))), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(repetition_penalty=1e-30)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(request=gen(max_tokens=2 ** 32 - 1)), inv),
        ("/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest(
            request=gen(rid="fz-hint", max_tokens=1), kvstore=prefill_pb2.KVStoreHint(
                grpc_address="127.0.0.1:1", num_blocks=2 ** 32 - 1)), {grpc.StatusCode.OK}),
        ("/pdserve.v1.Prefill/ReleaseKV", prefill_pb2.ReleaseKVRequest(lease_id=""), {grpc.StatusCode.OK}),
        ("/pdserve.v1.Prefill/RenewLease", prefill_pb2.RenewLeaseRequest(lease_id="x" * 10000, extend_ms=2 ** 32 - 1),
         {grpc.StatusCode.NOT_FOUND}),
        ("/pdserve.v1.Decode/Generate", decode_pb2.DecodeRequest(), inv),
        ("/pdserve.v1.Decode/Generate", decode_pb2.DecodeRequest(request=gen()), inv),
        ("/pdserve.v1.Decode/Generate", decode_pb2.DecodeRequest(
            request=gen(), first=common_pb2.TokenDelta(token_ids=[1]), kv=prefill_pb2.KVHandle(num_tokens=3)), inv),
        ("/pdserve.v1.Decode/Generate", decode_pb2.DecodeRequest(
            request=gen(top_k=2 ** 31 - 1), first=common_pb2.TokenDelta(token_ids=[1]),
            kv=prefill_pb2.KVHandle(num_tokens=len(prompt))), inv),
        ("/pdserve.v1.Decode/Generate", decode_pb2.DecodeRequest(
            request=gen(), first=common_pb2.TokenDelta(token_ids=[2 ** 32 - 1]),
            kv=prefill_pb2.KVHandle(num_tokens=len(prompt))), inv),
        ("/pdserve.v1.KVStore/Lookup", kvstore_pb2.LookupRequest(block_hashes=[b"abc"]), inv),
        ("/pdserve.v1.KVStore/Reserve", kvstore_pb2.ReserveRequest(block_hashes=[b"\0" * 16], ttl_ms=2 ** 32 - 1), inv),
        ("/pdserve.v1.KVStore/Reserve", kvstore_pb2.ReserveRequest(block_hashes=[b"x" * 17]), inv),
        ("/pdserve.v1.KVStore/Commit", kvstore_pb2.CommitRequest(reservation_id=""), {grpc.StatusCode.NOT_FOUND}),
        ("/pdserve.v1.KVStore/Load", kvstore_pb2.LoadRequest(block_hashes=[b"\1" * 16] * 50_000),
         {grpc.StatusCode.OK}),
        ("/pdserve.v1.KVStore/Release", kvstore_pb2.ReleaseRequest(id=""), inv),
        ("/pdserve.v1.Router/Generate", common_pb2.GenerateRequest(prompt="a", prompt_token_ids=[1]), inv),
        ("/pdserve.v1.Router/Generate", common_pb2.GenerateRequest(prompt_token_ids=[2 ** 32 - 1]), inv),
        ("/pdserve.v1.Router/Generate", gen(max_tokens=2 ** 32 - 1), inv),
        ("/pdserve.v1.Router/Generate", gen(stop=["s"] * 100), inv),
        ("/pdserve.v1.Router/Generate", gen(top_k=2 ** 31 - 1), inv),
        ("/pdserve.v1.Router/Generate", gen(temperature=float("-inf")), inv),
        ("/pdserve.v1.Router/Generate", gen(min_tokens=5, max_tokens=4), inv),
        ("/pdserve.v1.Router/Generate", common_pb2.GenerateRequest(prompt="x", model="nope"), inv),
    ]


def test_grpc_methods_answer_declared_codes_to_malformed_messages(hardened):
    addresses = _addresses(hardened)
    rng = random.Random(1234)
    prompt = [rng.randrange(10, 4000) for _ in range(150)]

    async def run():
        results = []
        for method, msg, allowed in _structured(prompt):
            code, details = await _call(addresses[method.split("/")[1].split(".")[-1]], method,
                                        msg.SerializeToString())
            results.append((method, str(msg)[:80], code, details))
            assert code in allowed, (method, str(msg)[:200], code, details)
        for method in UNARY + STREAM:
            for _ in range(12):
                raw = rng.randbytes(rng.randrange(1, 300))
                code, details = await _call(addresses[method.split("/")[1].split(".")[-1]], method, raw)
                results.append((method, raw[:16], code, details))
        return results

    results = asyncio.run(run())
    print("gRPC", sorted(Counter((m.rsplit("/", 1)[1], c.name) for m, _, c, _ in results).items()))
    _check(results)
    _assert_nothing_leaked(hardened)


def test_decode_with_forged_kv_handles_recomputes_or_refuses_and_frees_everything(hardened):
    """A real handle with its block ids, peer or token count changed: decode never reads outside the
    prefill's pool (it computes the prompt itself, or refuses), and every block comes back."""
    addresses = _addresses(hardened)
    ids = list(range(300, 300 + 200))
    g = common_pb2.GenerateRequest(request_id="fz-forge", prompt_token_ids=ids,
                                   sampling_params=_sampling(max_tokens=4, temperature=0.0))

    async def run():
        async with grpc.aio.insecure_channel(addresses["Prefill"]) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            real = await stub.Prefill(prefill_pb2.PrefillRequest(request=g), timeout=60)
            forged = []
            for change in ("huge_block_ids", "no_block_ids", "bad_peer", "no_ranks"):
                kv = prefill_pb2.KVHandle()
                kv.CopyFrom(real.kv)
                if change == "huge_block_ids":
                    kv.ranks[0].block_ids[:] = [2 ** 32 - 1 - i for i in range(len(kv.ranks[0].block_ids))]
                elif change == "no_block_ids":
                    del kv.ranks[0].block_ids[:]
                elif change == "bad_peer":
                    kv.ranks[0].peer.agent_metadata = random.Random(5).randbytes(64)
                    kv.ranks[0].peer.agent_name = "nobody"
                else:
                    del kv.ranks[:]
                req = decode_pb2.DecodeRequest(request=common_pb2.GenerateRequest(
                    request_id=f"fz-forge-{change}", prompt_token_ids=ids, sampling_params=g.sampling_params),
                    kv=kv, first=real.first)
                code, details = await _call(addresses["Decode"], "/pdserve.v1.Decode/Generate",
                                            req.SerializeToString())
                forged.append((change, req.kv.lease_id, code, details))
            await stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=real.kv.lease_id))
            return forged

    forged = asyncio.run(run())
    _check(forged)
    _assert_nothing_leaked(hardened)


def _assert_nothing_leaked(dep) -> None:
    insts = h.instances(dep)
    addresses = _addresses(dep)
    for name, address in addresses.items():
        assert asyncio.run(check_health(address, timeout=30)), f"{name} stopped answering"
    assert h.engines_idle(insts), "an engine kept blocks after the fuzzing"

    async def pool_adds_up() -> bool:  # reserved-but-never-committed blocks come back after their TTL
        async with grpc.aio.insecure_channel(addresses["KVStore"]) as ch:
            d = await kvstore_pb2_grpc.KVStoreStub(ch).Describe(kvstore_pb2.DescribeRequest())
        stored = system.metric(insts["kvstore"].metrics_address, "pdserve:kvstore_num_stored_blocks")
        return d.num_free_blocks + stored == d.num_blocks
    assert system.wait_for(lambda: asyncio.run(pool_adds_up())), "kvstore blocks leaked"
    assert router_pb2  # the Router messages are exercised through raw bytes above
