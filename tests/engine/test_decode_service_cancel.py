"""The decode service when its client leaves while the KV pull runs: the blocks stay reserved until
the READ has ended (it may still be writing them), then are freed; nothing is left behind."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from proto.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.decode.server import DecodeServicer
from services.rpc.convert import sampling_to_proto
from services.rpc.metrics import ServiceMetrics
from services.transfer.convert import kv_layout_to_proto
from tests.helpers.pace import until


class _SlowPuller:
    """Stands in for the NIXL pull: holds until released, like a READ still in flight."""

    def __init__(self, spec):
        self.spec = spec
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def pull(self, kv, block_ids, num_cached) -> int:
        self.started.set()
        await self.release.wait()
        return 0


async def _freed(free, free0: int, engine) -> bool:
    return await free() == free0 and "leaves" not in engine._streams


@pytest.mark.timeout(120)
def test_client_leaving_mid_pull_frees_blocks_only_after_the_read(tiny_code):
    async def run():
        engine = AsyncEngine(EngineArgs(model=str(tiny_code), kv_cache_dtype="fp8_ds_mla", num_blocks=32,
                                        device="cpu"))
        engine.start()
        try:
            free = lambda: engine.call(lambda core: core.stats().num_free_blocks)
            free0 = await free()
            puller = _SlowPuller(engine.core.runner.spec)
            servicer = DecodeServicer(engine, puller, ServiceMetrics("decode"), admit_timeout_s=5)
            ids = list(range(10, 300))
            req = decode_pb2.DecodeRequest(
                request=common_pb2.GenerateRequest(request_id="leaves", prompt_token_ids=ids,
                                                   sampling_params=sampling_to_proto(SamplingParams(max_tokens=5))),
                kv=prefill_pb2.KVHandle(num_tokens=len(ids), layout=kv_layout_to_proto(puller.spec)),
                first=common_pb2.TokenDelta(token_ids=[7]))
            call = asyncio.ensure_future(servicer.Generate(req, None).__anext__())
            await puller.started.wait()
            held = free0 - await free()
            call.cancel()  # the client went away
            await asyncio.gather(call, return_exceptions=True)
            await asyncio.sleep(0.1)
            still_held = free0 - await free()
            puller.release.set()  # the READ ends: its blocks and its stream go (the event waited for)
            await until(lambda: _freed(free, free0, engine), "the blocks after the READ ended", period=0.05)
            return held, still_held, free0 - await free(), "leaves" in engine._streams, servicer.admission
        finally:
            await engine.shutdown()

    held, still_held, after, stream_left, admission = asyncio.run(run())
    assert held >= 5 and still_held == held, "blocks freed while the READ could still write them"
    assert after == 0 and not stream_left, "the request leaked blocks or its stream"
    assert admission.num_inflight == 0 and admission.num_queued == 0
