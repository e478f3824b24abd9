"""Engine services answer a structured output they cannot compile with INVALID_ARGUMENT, before any
work: the prefill computes nothing, the decode pulls no KV; a good one runs through prefill."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from engine import SamplingParams
from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from engine.structured import StructuredOutputSpec as Spec
from proto.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.decode.server import DecodeServicer
from services.prefill.server import PrefillServicer
from services.rpc.convert import sampling_to_proto
from services.rpc.metrics import ServiceMetrics
from services.transfer.convert import kv_layout_to_proto


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.code = self.details = None

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted

    def set_trailing_metadata(self, md):
        pass


class _NoPull:
    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    async def pull(self, kv, block_ids, num_cached) -> int:
        self.calls += 1
        return 0


def _params(kind: str, text: str, max_tokens: int = 5) -> common_pb2.SamplingParams:
    m = sampling_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0.0))
    m.structured_outputs.CopyFrom(common_pb2.StructuredOutput(kind=kind, spec=text))
    return m


BAD = [("regex", "(a", "invalid regex"), ("json", '{"type": "frob"}', "invalid JSON schema"),
       ("grammar", "root ::= nope", "invalid grammar"), ("xml", "<a/>", "kind must be one of")]


@pytest.mark.timeout(120)
def test_bad_specs_are_invalid_argument_at_both_services(tiny_code):
    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), num_blocks=32, device="cpu"))
        engine.start()
        try:
            free0 = await engine.call(lambda core: core.stats().num_free_blocks)
            puller = _NoPull(engine.core.runner.spec)
            dec = DecodeServicer(engine, puller, ServiceMetrics("decode"), admit_timeout_s=5)
            pre = PrefillServicer("p0", engine, None, ServiceMetrics("prefill"), None, 30.0, 60.0)
            seen = []
            for kind, text, msg in BAD:
                ids = list(range(10, 80))
                g = common_pb2.GenerateRequest(request_id=f"bad-{kind}", prompt_token_ids=ids,
                                               sampling_params=_params(kind, text))
                ctx = _Context()
                with pytest.raises(_Aborted):
                    await pre.Prefill(prefill_pb2.PrefillRequest(request=g), ctx)
                seen.append((ctx.code, ctx.details, msg))
                req = decode_pb2.DecodeRequest(request=g, first=common_pb2.TokenDelta(token_ids=[7]),
                                               kv=prefill_pb2.KVHandle(num_tokens=len(ids),
                                                                       layout=kv_layout_to_proto(puller.spec)))
                ctx = _Context()
                with pytest.raises(_Aborted):
                    await dec.Generate(req, ctx).__anext__()
                seen.append((ctx.code, ctx.details, msg))
            free1 = await engine.call(lambda core: core.stats().num_free_blocks)
            return seen, puller.calls, free0, free1
        finally:
            await engine.shutdown()

    seen, pulls, free0, free1 = asyncio.run(run())
    for code, details, msg in seen:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg in details, details
    assert pulls == 0 and free1 == free0


@pytest.mark.timeout(120)
def test_prefill_samples_the_first_token_under_the_grammar(tiny_code):
    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), num_blocks=32, device="cpu"))
        engine.start()
        try:
            pre = PrefillServicer("p0", engine, None, ServiceMetrics("prefill"), None, 30.0, 60.0)
            spec = Spec.regex("zq[0-9]")
            m = sampling_to_proto(SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=spec))
            g = common_pb2.GenerateRequest(request_id="ok", prompt_token_ids=list(range(10, 80)), sampling_params=m)
            reply = await pre.Prefill(prefill_pb2.PrefillRequest(request=g), _Context())
            return engine.tokenizer.decode(list(reply.first.token_ids))
        finally:
            await engine.shutdown()

    text = asyncio.run(run())
    assert re.fullmatch("z|zq|zq[0-9]", text), text
