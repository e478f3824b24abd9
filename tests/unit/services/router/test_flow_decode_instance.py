"""The router names the decode instance it chose in Decode.Generate: the DP ranks of a decode group share one
address, and the id says which rank takes the request (for an independent replica it is just its own id)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proto.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from services.cluster.redis_state import InstanceInfo
from services.router import flow as flow_mod
from services.router.flow import Flow, RequestStats
from services.rpc.metrics import ServiceMetrics


class _Call:
    def __init__(self):
        self.cancelled = False

    async def read(self):
        return decode_pb2.DecodeResponse(delta=common_pb2.TokenDelta(token_ids=[5]))

    def done(self):
        return False

    def cancel(self):
        self.cancelled = True


def test_decode_generate_carries_the_chosen_instance_id(monkeypatch):
    sent = []

    class _Stub:
        def __init__(self, channel):
            pass

        def Generate(self, request, timeout=None):
            sent.append(request)
            return _Call()

    monkeypatch.setattr(flow_mod.decode_pb2_grpc, "DecodeStub", _Stub)
    routing = SimpleNamespace(started=lambda i: None, finished=lambda i: None, mark_unhealthy=lambda i: None)
    flow = Flow(routing, tokenizer=None, metrics=ServiceMetrics("router"))
    flow._channel = lambda address: None
    inst = InstanceInfo("decode", "decode-0-dp1", "127.0.0.1:1", extra={"dp_rank": 1})
    first = prefill_pb2.PrefillResponse(first=common_pb2.TokenDelta(token_ids=[3]))
    g = common_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2])
    _, _, reply = asyncio.run(flow._open_decode(inst, g, first, RequestStats("r", 2)))
    assert list(reply.delta.token_ids) == [5]
    (req,) = sent
    assert req.instance_id == "decode-0-dp1" and list(req.request.prompt_token_ids) == [1, 2]


def test_a_cancelled_stream_read_stays_cancelled_when_a_message_arrives_at_once():
    """A client that goes away cancels its stream while the decode's next message is arriving: the read must
    end in CancelledError (a nested asyncio.wait_for returns the message instead under Python 3.11, and the
    abandoned stream would run on)."""
    async def go():
        arriving, reading = asyncio.get_running_loop().create_future(), asyncio.Event()

        class _Slow(_Call):
            async def read(self):
                reading.set()
                return await arriving

        routing = SimpleNamespace(started=lambda i: None, finished=lambda i: None, mark_unhealthy=lambda i: None)
        flow = Flow(routing, tokenizer=None, metrics=ServiceMetrics("router"))
        inst = InstanceInfo("decode", "decode-0", "127.0.0.1:1")
        reader = asyncio.create_task(flow._next(_Slow(), inst, RequestStats("r", 2)))
        await reading.wait()  # the read is waiting for its message
        arriving.set_result("message")  # queued before the cancellation
        reader.cancel()
        done, _ = await asyncio.wait([reader], timeout=2.0)
        assert reader in done and reader.cancelled()
    asyncio.run(go())
