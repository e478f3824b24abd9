"""The common gRPC server for real, in-process: health checking, reflection (which resolves our
.proto imports), exception -> status mapping for unary and streaming handlers, graceful stop."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, router_pb2, router_pb2_grpc
from services.rpc.grpc_server import GrpcServer, Overloaded, channel, check_health, grpc_errors

pytestmark = pytest.mark.timeout(60)


class FakeKVStore(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self):
        self.describing = asyncio.Event()  # set once a Describe is in its handler

    @grpc_errors
    async def Lookup(self, request, context):
        raise ValueError("block_hashes[0] has 3 bytes; expected 16")

    @grpc_errors
    async def Reserve(self, request, context):
        raise Overloaded("pool full")

    @grpc_errors
    async def Load(self, request, context):
        raise RuntimeError("a bug")

    @grpc_errors
    async def Describe(self, request, context):
        self.describing.set()
        await asyncio.sleep(0.5)  # in flight while the server stops
        return kvstore_pb2.DescribeResponse(instance_id="slow")


class FakeRouter(router_pb2_grpc.RouterServicer):
    @grpc_errors
    async def Generate(self, request, context):
        for t in (1, 2):
            yield router_pb2.GenerateResponse(request_id=request.request_id,
                                              delta=common_pb2.TokenDelta(token_ids=[t]))
        raise ValueError("stop strings must be non-empty")


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


def test_health_reflection_errors_and_graceful_stop():
    async def main():
        server, kvstore = GrpcServer(0, "127.0.0.1"), FakeKVStore()
        server.add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, kvstore, "pdserve.v1.KVStore")
        server.add_service(router_pb2_grpc.add_RouterServicer_to_server, FakeRouter(), "pdserve.v1.Router")
        port = await server.start()
        address = f"127.0.0.1:{port}"
        assert not await check_health(address)  # not ready yet
        await server.set_serving(True)
        assert await check_health(address) and await check_health(address, "pdserve.v1.KVStore")

        async with channel(address) as ch:
            kv = kvstore_pb2_grpc.KVStoreStub(ch)
            assert await _code(kv.Lookup(kvstore_pb2.LookupRequest())) == (
                grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[0] has 3 bytes; expected 16")
            assert await _code(kv.Reserve(kvstore_pb2.ReserveRequest())) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, "pool full")
            assert (await _code(kv.Load(kvstore_pb2.LoadRequest())))[0] == grpc.StatusCode.INTERNAL

            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for r in router_pb2_grpc.RouterStub(ch).Generate(common_pb2.GenerateRequest(request_id="q")):
                    got.extend(r.delta.token_ids)
            assert got == [1, 2] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = [r async for r in refl.ServerReflectionInfo(iter([
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.KVStore")]))]
            services = {s.name for s in replies[0].list_services_response.service}
            assert {"pdserve.v1.KVStore", "pdserve.v1.Router", "grpc.health.v1.Health"} <= services
            files = replies[1].file_descriptor_response.file_descriptor_proto
            assert len(files) >= 1  # kvstore.proto (+ its import pdserve/v1/common.proto) resolved

            slow = asyncio.ensure_future(kv.Describe(kvstore_pb2.DescribeRequest()))
            await asyncio.wait_for(kvstore.describing.wait(), 60)  # in its handler: the stop finds it in flight
            health = health_pb2_grpc.HealthStub(ch)
            stopping = asyncio.ensure_future(server.stop(grace=3.0))
            await asyncio.sleep(0.05)
            assert (await slow).instance_id == "slow"  # in-flight RPC finished within the grace period
            await stopping
            assert (await _code(health.Check(health_pb2.HealthCheckRequest(), timeout=1)))[0] in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    asyncio.run(main())


def test_port_in_use_is_an_error():
    async def main():
        first = GrpcServer(0, "127.0.0.1")
        port = await first.start()
        second = GrpcServer(port, "127.0.0.1")
        with pytest.raises(OSError, match="in use"):
            second.bind()
        await second.stop(0)
        await first.stop(0)

    asyncio.run(main())
