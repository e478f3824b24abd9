"""A prefill's client of one kvstore: store blocks into it and load blocks from it over NIXL (the failure
policy around these calls is services/transfer/kvstore_link.py; the server is services/kvstore/).

    client = KVStoreClient("10.0.0.5:50060", agent, local_descs, spec)
    await client.connect()                                   # Describe, layout check, NIXL peer
    n = await client.store(hashes, local_block_ids)          # Reserve -> WRITE -> Commit
    n = await client.load(hashes, local_block_ids)           # Load -> READ -> Release

`local_block_ids[i]` is the engine block holding the block whose hash is `hashes[i]`. Both calls
are bounded by `timeout_s` and by the server's expiry, and always give back what they took.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.kv.cache import KVCacheSpec
from proto.pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.rpc.convert import monotonic_from_unix_ms
from services.rpc.grpc_server import channel
from services.transfer.convert import check_kv_layout, nixl_peer_from_proto
from services.transfer.nixl_agent import BlockDescList, NixlAgent


class KVStoreClient:
    def __init__(self, address: str, agent: NixlAgent, local: BlockDescList, spec: KVCacheSpec, *,
                 timeout_s: float = 10.0):
        self.address, self.agent, self.local, self.spec = address, agent, local, spec
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self.remote: BlockDescList | None = None
        self.instance_id = ""

    async def connect(self) -> None:
        d = await self.stub.Describe(kvstore_pb2.DescribeRequest(), timeout=self.timeout_s)
        check_kv_layout(d.layout, self.spec, f"kvstore {d.instance_id}")
        name, metadata, tensors = nixl_peer_from_proto(d.peer)
        self.instance_id = d.instance_id
        self.remote = self.agent.prep_remote(self.agent.add_peer(metadata), tensors)

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        reply = await self.stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=self.timeout_s)
        return reply.num_blocks

    async def store(self, hashes: Sequence[bytes], local_block_ids: Sequence[int]) -> int:
        """Copy the blocks the kvstore lacks into it; returns how many were stored by this call."""
        _check_aligned(hashes, local_block_ids)
        res = await self.stub.Reserve(kvstore_pb2.ReserveRequest(block_hashes=hashes), timeout=self.timeout_s)
        if not res.reservation_id:
            return 0
        local_of = dict(zip(hashes, local_block_ids))
        try:
            xfer = self.agent.write(self.local, [local_of[h] for h in res.block_hashes], self._remote(),
                                    list(res.block_ids))
            await self.agent.wait(xfer, self._deadline(res.expires_unix_ms))
        except BaseException:
            await self.stub.Release(kvstore_pb2.ReleaseRequest(id=res.reservation_id), timeout=self.timeout_s)
            raise
        reply = await self.stub.Commit(kvstore_pb2.CommitRequest(reservation_id=res.reservation_id),
                                       timeout=self.timeout_s)
        return reply.num_committed

    async def load(self, hashes: Sequence[bytes], local_block_ids: Sequence[int]) -> int:
        """Copy the leading stored blocks into `local_block_ids`; returns how many were copied."""
        _check_aligned(hashes, local_block_ids)
        lease = await self.stub.Load(kvstore_pb2.LoadRequest(block_hashes=hashes), timeout=self.timeout_s)
        if not lease.lease_id:
            return 0
        n = len(lease.block_ids)
        try:
            xfer = self.agent.read(self.local, list(local_block_ids[:n]), self._remote(), list(lease.block_ids))
            await self.agent.wait(xfer, self._deadline(lease.expires_unix_ms))
        finally:
            await self.stub.Release(kvstore_pb2.ReleaseRequest(id=lease.lease_id), timeout=self.timeout_s)
        return n

    async def close(self) -> None:
        if self.remote is not None:
            self.agent.release_descs(self.remote)
            self.remote = None
        await self._channel.close()

    def _remote(self) -> BlockDescList:
        if self.remote is None:
            raise RuntimeError("KVStoreClient.connect() first")
        return self.remote

    def _deadline(self, expires_unix_ms: int) -> float:
        return min(time.monotonic() + self.timeout_s, monotonic_from_unix_ms(expires_unix_ms))


def _check_aligned(hashes: Sequence[bytes], local_block_ids: Sequence[int]) -> None:
    if len(hashes) != len(local_block_ids):
        raise ValueError(f"{len(hashes)} hashes vs {len(local_block_ids)} local blocks: one block per hash")
