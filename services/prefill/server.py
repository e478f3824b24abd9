"""The Prefill gRPC service: compute a prompt's KV and first token, then export the KV under a lease.

    Prefill(request)  -> [load a cached prefix from a kvstore over NIXL] -> engine computes the rest
                      -> first token; the KV stays pinned under a lease (KVHandle: NIXL peers, block ids)
                      -> [offload the prompt's full blocks to a kvstore over NIXL, in the background]
    (the KV's export, the kvstore's load / offload and any CP staging: services/transfer/)
    ReleaseKV (decode confirms its copy against the page generations) / lease expiry
                      -> blocks freed (after the offload read them)
An engine that died (a worker rank is gone) fails every call with UNAVAILABLE (services/prefill/main.py
then takes the instance out of service). Draining (SIGTERM): new calls are refused UNAVAILABLE (the router
tries another prefill), calls in flight finish and their KV stays exported until its decode pulled it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from engine.core.request import Request
from engine.frontend.async_engine import AsyncEngine, EngineDeadError
from engine.kv.hashing import block_hashes
from proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.prefill.leases import LeaseTable
from services.rpc.admission import Admission
from services.rpc.bounds import ModelLimits, check_generate_proto
from services.rpc.convert import delta_to_proto, sampling_from_proto, unix_ms
from services.rpc.grpc_server import FailedPrecondition, NotFound, Unavailable, grpc_errors
from services.rpc.metrics import ServiceMetrics
from services.transfer.export import KVExporter
from services.transfer.prefix import PrefixTransfer

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Prefill"


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, instance_id: str, engine: AsyncEngine, exporter: KVExporter, metrics: ServiceMetrics,
                 kvstore: PrefixTransfer | None, lease_s: float, max_lease_s: float, admission: Admission | None = None,
                 grpc_address: str = ""):
        self.instance_id, self.engine, self.exporter, self.metrics = instance_id, engine, exporter, metrics
        self.admission = admission or Admission("prefill", 1024, 256)
        self.grpc_address = grpc_address
        self.kvstore = kvstore
        self.block_size = engine.config.cache.block_size
        self.limits = ModelLimits.of(engine.config)
        self.leases = LeaseTable(self._release, lease_s, max_lease_s,
                                 on_expired=lambda: metrics.kv_lease_expired.inc())
        self.draining = False  # SIGTERM (services/rpc/drain.py): new prefills go elsewhere, leases run out
        self.num_calls = 0  # Prefill calls in flight

    @property
    def idle(self) -> bool:
        """Nothing in flight: no Prefill call, and no exported KV still waiting for its decode (or offload)."""
        return self.num_calls == 0 and not self.leases.leases

    def start(self) -> None:
        self.leases.start()

    async def stop(self) -> None:
        await self.leases.stop()

    # ---- RPCs ----------------------------------------------------------------------------------
    @grpc_errors
    async def Prefill(self, request, context):
        if self.draining:
            raise Unavailable(f"prefill {self.instance_id} is draining (shutting down): choose another")
        self.admission.check_waiting(self.engine.stats().num_waiting)
        self.num_calls += 1
        with self.admission.inflight():
            try:
                return await self._prefill(request)
            except EngineDeadError as exc:
                raise Unavailable(f"prefill {self.instance_id} is out of service: {exc}") from exc
            finally:
                self.num_calls -= 1

    async def _prefill(self, request) -> prefill_pb2.PrefillResponse:
        t0 = time.monotonic()
        g = request.request
        check_generate_proto(g, self.limits)  # a caller other than the router is checked just as well
        ids, prior = list(g.prompt_token_ids), list(g.output_token_ids)  # prior: a migrated request's outputs
        params = sampling_from_proto(g.sampling_params)
        req_id = g.request_id or uuid.uuid4().hex
        n = len(prior) + 1  # the outputs once this prefill's one new token is out
        wants_kv = params.max_tokens > n
        first_params = dataclasses.replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n))
        req = Request(req_id, ids, first_params, cache_salt=g.cache_salt or None, hold_kv_on_finish=wants_kv)
        req.append_output(prior)
        hashes = block_hashes(req.all_token_ids, self.block_size, req.cache_salt)
        stream = await self._admit(req, hashes, request.kvstore)
        last = None
        async for out in stream:
            last = out
        finish = last.finish_reason
        if finish == "length" and wants_kv:
            finish = None  # only the prefill's own max_tokens=1 ended it: decode continues
        if finish == "abort":
            raise FailedPrecondition(f"request {req_id} was aborted during prefill")
        self.metrics.time_to_first_token_seconds.observe(time.monotonic() - t0)
        usage = common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(prior) + len(last.token_ids),
                                 cached_tokens=last.num_cached_tokens)
        first = delta_to_proto(last.token_ids, last.logprobs, finish, last.stop_reason)
        reply = prefill_pb2.PrefillResponse(request_id=req_id, first=first, usage=usage)
        if wants_kv and finish is not None:
            await self._release(req_id)
        elif wants_kv:
            try:
                reply.kv.CopyFrom(await self._export(req_id, req.all_token_ids[: len(ids) + len(prior)], hashes,
                                                     request.lease_ms, last.num_cached_tokens, last.kv_exports))
            except BaseException:  # no lease was granted (the client left, or the export failed): free the KV
                await asyncio.shield(self._release(req_id))
                raise
        return reply

    @grpc_errors
    async def ReleaseKV(self, request, context):
        # answered once the lease table has decided: the engine frees the blocks at its next step boundary, which
        # the decode (its KV handoff waits for this answer) need not wait for
        if request.block_generations:
            intact = await self.leases.confirm(request.lease_id, request.block_generations, wait=False)
            return prefill_pb2.ReleaseKVResponse(released=intact, intact=intact)
        return prefill_pb2.ReleaseKVResponse(released=await self.leases.pulled(request.lease_id, wait=False))

    @grpc_errors
    async def RenewLease(self, request, context):
        lease = self.leases.renew(request.lease_id, request.extend_ms / 1000.0)
        if lease is None:
            raise NotFound(f"lease {request.lease_id!r} is unknown or expired")
        return prefill_pb2.RenewLeaseResponse(lease_expires_unix_ms=unix_ms(lease.expires))

    @grpc_errors
    async def Abort(self, request, context):
        lease = self.leases.by_request(request.request_id)
        if lease is not None:
            await self.leases.pulled(lease.lease_id)
            return prefill_pb2.AbortResponse(aborted=True)
        self.engine.abort(request.request_id)
        return prefill_pb2.AbortResponse(aborted=True)

    # ---- steps ---------------------------------------------------------------------------------
    async def _admit(self, req: Request, hashes: list[bytes], hint):
        """Add the request; first load the prefix a kvstore holds beyond our own cache, if any."""
        n_hint = min(hint.num_blocks if hint.grpc_address else 0, len(hashes),
                     (len(req.all_token_ids) - 1) // self.block_size)
        if self.kvstore is None or n_hint == 0 or not self.kvstore.ready:
            return self._add(req)
        admitted = await self.engine.add_import_request(req, n_hint * self.block_size)
        if admitted is None:  # no room to stage the prefix: compute everything instead
            return self._add(req)
        stream, block_ids, n_cached = admitted
        first = n_cached // self.block_size
        load = asyncio.ensure_future(self.kvstore.load(hint.grpc_address, hashes, list(block_ids), first, n_hint))
        try:
            loaded = await asyncio.shield(load)  # a READ may be writing our blocks until it ends
        except BaseException:  # the client left: free the request once the READ ended, never before
            self.engine.cancel(req.req_id)
            load.add_done_callback(lambda _: self.engine.import_done(req.req_id, ok=False))
            raise
        self.engine.import_done(req.req_id, ok=loaded > 0, num_tokens=(first + loaded) * self.block_size)
        return stream

    def _add(self, req: Request):
        return self.engine.add_request(req.prompt_token_ids, req.sampling_params, req.req_id,
                                       output_token_ids=req.output_token_ids, cache_salt=req.cache_salt,
                                       hold_kv_on_finish=req.hold_kv_on_finish)

    async def _export(self, req_id: str, ids: list[int], hashes: list[bytes], lease_ms: int,
                      num_cached: int, known: list | None = None) -> prefill_pb2.KVHandle:
        pages = await self.exporter.rank_pages(req_id, known)
        lease = self.leases.grant(req_id, lease_ms / 1000.0 if lease_ms else None, pages[0].block_ids)
        if self.kvstore is not None and hashes and self.kvstore.ready:
            offload = self.kvstore.offload(hashes, list(pages[0].block_ids))
            self.leases.add_reader(lease, asyncio.get_running_loop().create_task(offload))
        handle = self.exporter.kv_handle(lease, len(ids), pages, hashes, num_cached)
        handle.prefill_grpc_address = self.grpc_address
        return handle

    async def _release(self, req_id: str) -> None:
        await self.engine.call(lambda core: core.release_held(req_id))
