"""The decode service when its caller goes away during the KV pull: the reserved blocks are freed, but only
after the pull has ended (a READ may still be writing them), and a failed confirmation means recompute."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from proto.pdserve.v1 import decode_pb2, prefill_pb2
from services.decode.server import DecodeServicer
from services.rpc.metrics import ServiceMetrics
from tests.helpers.pace import until


class _Engine:
    config = SimpleNamespace(scheduler=SimpleNamespace(max_model_len=4096), model=SimpleNamespace(vocab_size=4096))

    def __init__(self):
        self.calls: list[tuple] = []
        self.stream_closed = False

    async def add_import_request(self, req, num_tokens):
        self.calls.append(("reserve", req.req_id))

        async def stream():
            try:
                if False:
                    yield
            finally:
                self.stream_closed = True
        return stream(), [3, 4], 0

    def abort(self, req_id):
        self.calls.append(("abort", req_id))

    def import_done(self, req_id, ok, num_tokens=None):
        self.calls.append(("import_done", req_id, ok))

    def stats(self):
        return SimpleNamespace(spec_drafts=0, spec_accepted=0, spec_steps=0, spec_emitted=0)


class _Puller:
    def __init__(self):
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def pull(self, kv, block_ids, n_cached):
        self.started.set()
        await self.release.wait()  # a READ in progress
        return 0


def _servicer() -> tuple[DecodeServicer, _Engine, _Puller]:
    engine, puller = _Engine(), _Puller()
    s = DecodeServicer(engine, puller, ServiceMetrics("decode"), admit_timeout_s=1.0)
    s._request = lambda r: Request("r1", [1, 2, 3], SamplingParams(max_tokens=8))  # skip layout checks
    return s, engine, puller


def _request() -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(kv=prefill_pb2.KVHandle(lease_id="l1", num_tokens=3, block_generations=[0]))


def test_caller_gone_mid_pull_frees_blocks_only_after_the_pull_ended():
    async def run():
        s, engine, puller = _servicer()
        gen = s.Generate(_request(), context=None)
        call = asyncio.ensure_future(gen.__anext__())
        await puller.started.wait()
        call.cancel()  # the router cancelled the stream
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert engine.calls == [("reserve", "r1")], "blocks must stay reserved while the READ may write them"
        puller.release.set()
        await until(lambda: len(engine.calls) >= 3 and engine.stream_closed, "the cleanup after the pull ended")
        assert engine.calls[1:] == [("abort", "r1"), ("import_done", "r1", False)]
    asyncio.run(run())


def test_unconfirmed_pull_is_recomputed():
    async def run():
        s, engine, puller = _servicer()
        puller.release.set()
        gen = s.Generate(_request(), context=None)
        outs = [o async for o in gen]  # the fake stream ends at once
        assert outs == []
        # no prefill address to confirm with: the copy is not trusted, the prompt is computed locally
        assert engine.calls == [("reserve", "r1"), ("import_done", "r1", False)]
        assert s.num_local_recomputes == 1
    asyncio.run(run())
