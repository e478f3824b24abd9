"""The KVStore gRPC service: a NIXL-registered host pool of KV blocks, indexed in Redis.

The pool's tensors are a CPU `PagedKVCache` (pinned when CUDA exists) with the engines' exact
block-major layout, so a block moves between an engine and the pool as one descriptor per tensor.
Clients move the bytes themselves (NIXL WRITE into reserved blocks, READ from loaded ones); this
process only hands out block ids, tracks their state (pool.py), and mirrors the stored hashes into
the Redis block index (a background task, in order, so a slow or absent Redis never stalls an RPC).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

from redis.exceptions import RedisError

from engine.kv.cache import KVCacheSpec, PagedKVCache
from proto.pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.cluster.redis_state import RedisState
from services.kvstore import convert
from services.kvstore.pool import BlockPool, PoolChanges
from services.rpc.convert import block_hashes_from_proto, ttl_s
from services.rpc.grpc_server import Overloaded, Unavailable, grpc_errors
from services.rpc.metrics import ServiceMetrics
from services.transfer.convert import kv_layout_to_proto, nixl_peer_to_proto
from services.transfer.nixl_agent import NixlAgent

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.KVStore"
MAX_INDEX_BACKLOG = 4096  # index updates queued while Redis is slow or down; beyond: one full re-publish


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, instance_id: str, spec: KVCacheSpec, num_blocks: int, *, state: RedisState,
                 metrics: ServiceMetrics, reservation_ttl_s: float, lease_ttl_s: float, max_ttl_s: float,
                 grace_s: float, block_ttl_s: float, max_open_transfers: int = 256):
        self.instance_id, self.spec = instance_id, spec
        self.state, self.metrics = state, metrics
        self.reservation_ttl_s, self.lease_ttl_s, self.max_ttl_s = reservation_ttl_s, lease_ttl_s, max_ttl_s
        self.block_ttl_s = block_ttl_s
        self.max_open_transfers = max_open_transfers
        self.draining = False
        self.pool = BlockPool(num_blocks, grace_s=grace_s)
        self.cache = PagedKVCache(spec, num_blocks, "cpu", pin_memory=True)
        self.agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}")  # unique per process
        self.tensors = self.agent.register({"mla": self.cache.mla, "index": self.cache.index})
        self._index_queue: asyncio.Queue[tuple[str, list[bytes]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        metrics.kvstore_num_blocks.set(num_blocks)

    # ---- RPCs ----------------------------------------------------------------------------------
    @grpc_errors
    async def Describe(self, request, context):
        return kvstore_pb2.DescribeResponse(
            instance_id=self.instance_id, peer=nixl_peer_to_proto(self.agent.name, self.agent.metadata(), self.tensors),
            layout=kv_layout_to_proto(self.spec), num_blocks=self.pool.num_blocks, num_free_blocks=self.pool.num_free)

    @grpc_errors
    async def Lookup(self, request, context):
        return kvstore_pb2.LookupResponse(num_blocks=self.pool.lookup(block_hashes_from_proto(request.block_hashes)))

    @grpc_errors
    async def Reserve(self, request, context):
        hashes = block_hashes_from_proto(request.block_hashes)
        ttl = ttl_s(request.ttl_ms, self.reservation_ttl_s, self.max_ttl_s)
        self._check_open()
        res, num_present, changes = self.pool.reserve(hashes, ttl, time.monotonic())
        self._publish(changes)
        self.agent.busy()  # the caller WRITEs into the reserved blocks next: poll NIXL at the busy rate
        return convert.reserve_response(res, num_present, self.agent.name)

    @grpc_errors
    async def Commit(self, request, context):
        changes = self.pool.commit(request.reservation_id, time.monotonic())
        self._publish(changes)
        return kvstore_pb2.CommitResponse(num_committed=len(changes.stored))

    @grpc_errors
    async def Load(self, request, context):
        hashes = block_hashes_from_proto(request.block_hashes)
        self._check_open()
        lease = self.pool.load(hashes, ttl_s(request.ttl_ms, self.lease_ttl_s, self.max_ttl_s), time.monotonic())
        self.metrics.prefix_cache_queries.inc(len(hashes) * self.spec.block_size)
        self.metrics.prefix_cache_hits.inc(len(lease.block_ids) * self.spec.block_size if lease else 0)
        if lease:
            self.agent.busy()  # the caller READs the leased blocks next
        return convert.load_response(lease, self.agent.name)

    @grpc_errors
    async def Release(self, request, context):
        return kvstore_pb2.ReleaseResponse(released=self.pool.release(convert.release_id(request), time.monotonic()))

    def _check_open(self) -> None:
        """Bound the transfers in flight (each pins blocks until commit/release/expiry); none new while
        draining (SIGTERM: a prefill then computes the prefix itself, or stores nothing)."""
        if self.draining:
            raise Unavailable("this kvstore is draining (shutting down)")
        self.pool.expire(time.monotonic())
        if self.pool.num_open >= self.max_open_transfers:
            raise Overloaded(f"kvstore has {self.pool.num_open} transfers open (limit {self.max_open_transfers})")

    # ---- background work -----------------------------------------------------------------------
    def start(self, sweep_s: float = 0.1) -> None:
        self._tasks = [asyncio.create_task(self._index_loop(), name="kvstore-index"),
                       asyncio.create_task(self._sweep_loop(sweep_s), name="kvstore-sweep")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.agent.close()

    def _publish(self, changes: PoolChanges) -> None:
        if changes.removed:
            self.metrics.kvstore_evictions.inc(len(changes.removed))
            self._queue_index("removed", changes.removed)
        if changes.stored:
            self._queue_index("stored", changes.stored)
        self._update_gauges()

    def _queue_index(self, kind: str, hashes: list[bytes]) -> None:
        """Bounded: a long Redis outage replaces the backlog by one re-publish of what the pool holds
        (hashes evicted meanwhile stay indexed until their TTL; a prefill asking for them recomputes)."""
        if self._index_queue.qsize() >= MAX_INDEX_BACKLOG:
            while not self._index_queue.empty():
                self._index_queue.get_nowait()
            self._index_queue.put_nowait(("resync", []))
            return
        self._index_queue.put_nowait((kind, hashes))

    async def _index_loop(self) -> None:
        while True:
            kind, hashes = await self._index_queue.get()
            if kind == "resync":
                kind, hashes = "stored", self.pool.stored_hashes()
            while True:  # in order; retry until Redis takes it (the presence re-publishes after a restart)
                try:
                    if kind == "stored":
                        await self.state.add_blocks(self.instance_id, hashes, self.block_ttl_s)
                    else:
                        await self.state.remove_blocks(self.instance_id, hashes)
                    break
                except (RedisError, OSError) as exc:
                    log.warning("block index update failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)

    async def _sweep_loop(self, sweep_s: float) -> None:
        expired = 0
        while True:
            await asyncio.sleep(sweep_s)
            self.pool.expire(time.monotonic())
            if self.pool.num_expired > expired:
                self.metrics.kv_lease_expired.inc(self.pool.num_expired - expired)
                expired = self.pool.num_expired
            self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.kv_cache_usage_perc.set(self.pool.usage)
        self.metrics.kvstore_num_stored_blocks.set(self.pool.num_stored)

    def load_figures(self) -> dict[str, float]:
        return {"num_free_blocks": self.pool.num_free, "num_stored_blocks": self.pool.num_stored,
                "kv_cache_usage_perc": self.pool.usage}
