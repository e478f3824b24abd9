"""The gRPC side of the request bounds: Router.Generate and the engine services (Prefill, Decode) answer
INVALID_ARGUMENT naming the field for out-of-range values, before an engine sees the request (no block
reserved, no lease granted); every value they accept converts and samples without an exception."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import ClassVar

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.runner.sampler import RowParams, filtered_probs
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2_grpc
from services.decode.server import DecodeServicer
from services.prefill.server import PrefillServicer
from services.router.grpc_api import RouterServicer
from services.rpc.bounds import BOUNDS, FLOAT32_MAX, InvalidArgument, ModelLimits, check_sampling_proto, wire_range
from services.rpc.convert import sampling_from_proto
from services.rpc.grpc_server import GrpcServer
from services.rpc.metrics import ServiceMetrics
from tests.helpers.router_harness import MODEL, make_client

LIMITS = ModelLimits(max_model_len=4096, vocab_size=4096)


def test_wire_ranges_come_from_the_proto_field_types():
    assert wire_range("top_k") == (-2 ** 31, 2 ** 31 - 1)
    assert wire_range("seed") == (-2 ** 63, 2 ** 63 - 1)
    assert wire_range("max_tokens") == (0, 2 ** 32 - 1)
    assert wire_range("temperature") == (-FLOAT32_MAX, FLOAT32_MAX)
    assert BOUNDS["top_k"].range(LIMITS) == (1, 4096)  # product range inside the wire's
    assert BOUNDS["seed"].range(LIMITS) == (-2 ** 63, 2 ** 63 - 1)
    assert BOUNDS["temperature"].range(LIMITS) == (0.0, FLOAT32_MAX)


def _sp(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, **kw})


@pytest.mark.parametrize("kw,param", [
    ({"top_k": 2 ** 31 - 1}, "top_k"), ({"top_k": -2}, "top_k"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": -math.inf}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"), ({"max_tokens": 4097}, "max_tokens"),
    ({"min_tokens": 5}, "min_tokens"), ({"logprobs": 21}, "logprobs"), ({"stop_token_ids": [4096]}, "stop_token_ids"),
])
def test_sampling_proto_out_of_range_names_the_field(kw, param):
    with pytest.raises(InvalidArgument) as e:
        check_sampling_proto(_sp(**kw), LIMITS)
    assert e.value.param == f"sampling_params.{param}", e.value
    assert param in str(e.value)


def test_unset_max_tokens_takes_the_engine_default_in_the_min_tokens_rule():
    check_sampling_proto(common_pb2.SamplingParams(min_tokens=16), LIMITS)
    with pytest.raises(InvalidArgument):
        check_sampling_proto(common_pb2.SamplingParams(min_tokens=17), LIMITS)


_f32 = st.floats(width=32)
_PROTO_VALUES = {"temperature": _f32, "top_p": _f32, "min_p": _f32, "presence_penalty": _f32,
                 "frequency_penalty": _f32, "repetition_penalty": _f32,
                 "top_k": st.integers(-2 ** 31, 2 ** 31 - 1), "seed": st.integers(-2 ** 63, 2 ** 63 - 1),
                 "max_tokens": st.integers(0, 2 ** 32 - 1), "min_tokens": st.integers(0, 2 ** 32 - 1),
                 "logprobs": st.integers(0, 2 ** 32 - 1)}
_EDGY = {k: st.one_of(v, st.sampled_from([0, 1, 2, 16, 4096])) if k not in ("temperature",) else
         st.one_of(v, st.sampled_from([0.0, -0.0, 1e-40, 0.5, 1.0])) for k, v in _PROTO_VALUES.items()}


@given(values=st.fixed_dictionaries({}, optional=_EDGY))
@settings(max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_accepted_sampling_params_convert_and_sample_without_an_exception(values):
    """Every wire value: refused with InvalidArgument, or converted and sampled from (no NaN token)."""
    m = common_pb2.SamplingParams(**values)
    try:
        check_sampling_proto(m, LIMITS)
    except InvalidArgument:
        return
    params = sampling_from_proto(m)
    logits = torch.randn(LIMITS.vocab_size, generator=torch.Generator().manual_seed(0)) * 20
    if params.greedy:  # an argmax: nothing to filter
        return
    probs = filtered_probs(logits[None], RowParams.of([params], logits.device))[0]
    assert not probs.isnan().any() and probs.sum() == pytest.approx(1.0, abs=1e-3), params
    if params.seed is not None:
        torch.Generator().manual_seed(params.seed)


# ---- the services, in-process --------------------------------------------------------------------
class _Engine:
    """Fails the test if a request reaches it."""

    config = SimpleNamespace(cache=SimpleNamespace(block_size=64), parallel=SimpleNamespace(
        decode_context_parallel_size=1, world_size=1), scheduler=SimpleNamespace(max_model_len=4096),
        model=SimpleNamespace(vocab_size=4096))
    reached: ClassVar[list] = []

    def stats(self):
        return SimpleNamespace(num_waiting=0, spec_drafts=0, spec_accepted=0, spec_steps=0, spec_emitted=0)

    def __getattr__(self, name):
        _Engine.reached.append(name)
        raise AssertionError(f"the engine was reached ({name}) by a request that should have been refused")


def _bad_generates() -> list[tuple[common_pb2.GenerateRequest, str]]:
    def g(ids=(5, 6, 7), **kw):
        return common_pb2.GenerateRequest(request_id="bad", prompt_token_ids=list(ids), sampling_params=_sp(**kw))
    return [(g(top_k=2 ** 31 - 1), "top_k"), (g(temperature=math.inf), "temperature"),
            (g(seed=-1, top_p=math.nan), "top_p"), (g(min_tokens=2 ** 32 - 1), "min_tokens"),
            (g(max_tokens=2 ** 32 - 1), "max_tokens"), (g(ids=[2 ** 32 - 1]), "prompt_token_ids"),
            (g(ids=[1] * 4096), "prompt_token_ids"), (g(ids=[]), "prompt_token_ids")]


async def _serve(add, servicer, name):
    server = GrpcServer(0)
    server.add_service(add, servicer, name)
    port = await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_prefill_and_decode_refuse_out_of_range_requests_before_the_engine():
    async def run():
        engine = _Engine()
        prefill = PrefillServicer("p0", engine, exporter=None, metrics=ServiceMetrics("prefill"), kvstore=None,
                                  lease_s=5, max_lease_s=10)
        decode = DecodeServicer(engine, SimpleNamespace(spec=None), ServiceMetrics("decode"), admit_timeout_s=1)
        p_server, p_ch = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill, "pdserve.v1.Prefill")
        d_server, d_ch = await _serve(decode_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode")
        try:
            for g, field in _bad_generates():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await prefill_pb2_grpc.PrefillStub(p_ch).Prefill(prefill_pb2.PrefillRequest(request=g),
                                                                     timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
                call = decode_pb2_grpc.DecodeStub(d_ch).Generate(decode_pb2.DecodeRequest(
                    request=g, first=common_pb2.TokenDelta(token_ids=[1]), kv=prefill_pb2.KVHandle(num_tokens=3)))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
            assert not prefill.leases.leases
        finally:
            for s, ch in ((p_server, p_ch), (d_server, d_ch)):
                await ch.close()
                await s.stop(0)
    asyncio.run(run())
    assert not _Engine.reached


def test_router_grpc_generate_refuses_out_of_range_requests():
    _, flow, limits = make_client()

    async def run():
        server, ch = await _serve(router_pb2_grpc.add_RouterServicer_to_server,
                                  RouterServicer(flow, limits, MODEL), "pdserve.v1.Router")
        try:
            for g, field in _bad_generates():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await router_pb2_grpc.RouterStub(ch).Generate(g).read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
            ok = common_pb2.GenerateRequest(prompt="hi", sampling_params=_sp(seed=2 ** 63 - 1, top_k=4096))
            replies = [r async for r in router_pb2_grpc.RouterStub(ch).Generate(ok)]
            assert replies[-1].delta.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            await ch.close()
            await server.stop(0)
    asyncio.run(run())
    assert not [g for g in flow.sent if g.sampling_params.top_k > 4096]
