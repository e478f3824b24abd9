"""The Decode gRPC service: admit a request, pull its prompt KV from prefill over NIXL, stream tokens.

    Generate(request + KVHandle + first token)
      -> reserve blocks (waits while the pool is full; RESOURCE_EXHAUSTED after --admit-timeout-s)
      -> NIXL READ from the prefill rank(s) [retry once; then compute the prompt locally instead]
      -> ReleaseKV(page generations) to the prefill: frees its pages and confirms they still held this
         request's KV during the READ; if not (lease expired, pages reused), compute locally instead
      -> the engine continues from the first token (HiSparse + MTP), deltas streamed back
A client that goes away aborts the request; its blocks are freed (after any transfer into them ended).
Draining (SIGTERM): new requests are refused UNAVAILABLE, streams in flight run to their end (or, past the
shutdown timeout, end UNAVAILABLE and the router moves them: services/router/flow.py, "Migration").

A DP group (engine/parallel/dp.py) is served as D instances at one address, one per DP rank, each with
its own Redis entry, load figures, admission bounds and puller: `instance_id` of the request names the
rank that takes it (its KV lands in that rank's pages: services/transfer/rank_pull.py); empty, the
least-loaded rank; an id this group does not serve is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from engine.core.request import Request
from engine.frontend.async_engine import AsyncEngine
from proto.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.rpc.admission import Admission
from services.rpc.bounds import ModelLimits, check_generate_proto, check_token_ids
from services.rpc.convert import delta_to_proto, sampling_from_proto
from services.rpc.grpc_server import Overloaded, Unavailable, channel, grpc_errors
from services.rpc.metrics import ServiceMetrics
from services.transfer.convert import check_kv_layout
from services.transfer.nixl_agent import TransferError, TransferTimeout
from services.transfer.pull import KVPuller

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Decode"


@dataclass
class DecodeRank:
    """One decode instance served here: a DP rank of the engine (of a one-rank engine: the engine)."""

    instance_id: str
    puller: KVPuller  # or a services.transfer.rank_pull.RankPuller: the READs into this rank's pages
    admission: Admission


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, puller: KVPuller | None, metrics: ServiceMetrics, *,
                 admit_timeout_s: float, pull_retries: int = 1, release_timeout_s: float = 2.0,
                 admission: Admission | None = None, ranks: list[DecodeRank] | None = None):
        """One instance (`puller`, `admission`), or the `ranks` of a DP group (then `puller` is None)."""
        self.engine, self.metrics = engine, metrics
        self.ranks = ranks or [DecodeRank("", puller, admission or Admission("decode", 1024, 256))]
        self.puller, self.admission = self.ranks[0].puller, self.ranks[0].admission
        self.admit_timeout_s = admit_timeout_s
        self.pull_retries = pull_retries
        self.release_timeout_s = release_timeout_s
        self.limits = ModelLimits.of(engine.config)
        self.num_pull_failures = 0
        self.num_local_recomputes = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._last_spec = (0, 0, 0, 0)
        self._last_dp: dict[str, int] = {}
        self.draining = False  # SIGTERM (services/rpc/drain.py): new requests go elsewhere, streams finish
        self.num_streams = 0  # Generate calls in flight, admission to the last token

    @grpc_errors
    async def Generate(self, request, context):
        if self.draining:
            raise Unavailable("this decode instance is draining (shutting down): choose another")
        req = self._request(request)
        rank = self._rank(request.instance_id)
        self.num_streams += 1
        try:
            async for reply in self._generate(req, request, rank):
                yield reply
        finally:
            self.num_streams -= 1

    async def _generate(self, req: Request, request, rank: int):
        with self.ranks[rank].admission.inflight():
            # Admission and pull run shielded: a caller that goes away meanwhile must not strand the
            # reserved blocks, nor free them while a READ may still write them (see _give_up).
            prepared = asyncio.ensure_future(self._admit_and_pull(req, request.kv, rank))
            try:
                stream, ok = await asyncio.shield(prepared)
            except asyncio.CancelledError:
                prepared.add_done_callback(lambda t: self._give_up(req.req_id, t))
                raise
            async for reply in self._stream(req, stream, ok):
                yield reply

    async def _stream(self, req: Request, stream, ok: bool):
        self.engine.import_done(req.req_id, ok)
        t_first = None
        n_seen = 0
        async for out in stream:
            if out.delta_token_ids and t_first is None:
                t_first = time.monotonic()
            if not out.logprobs:
                lps = None
            elif self.engine.cumulative:
                lps = out.logprobs[n_seen: n_seen + len(out.delta_token_ids)]
            else:  # the engine streams deltas: these are the new tokens' own
                lps = out.logprobs
            n_seen += len(out.delta_token_ids)
            yield decode_pb2.DecodeResponse(delta=delta_to_proto(out.delta_token_ids, lps, out.finish_reason,
                                                                 out.stop_reason))
            if out.step_time is not None:  # resumed once gRPC sent the message
                self.metrics.token_delta_delay_seconds.observe(time.monotonic() - out.step_time)
        if t_first is not None and n_seen > 1:
            self.metrics.time_per_output_token_seconds.observe((time.monotonic() - t_first) / (n_seen - 1))
        self._spec_metrics()

    @grpc_errors
    async def Abort(self, request, context):
        self.engine.abort(request.request_id)
        return decode_pb2.DecodeAbortResponse(aborted=True)

    # ---- steps ---------------------------------------------------------------------------------
    def _rank(self, instance_id: str) -> int:
        """The DP rank that serves an instance id (one instance: any id is this one)."""
        if len(self.ranks) == 1:
            return 0
        if not instance_id:
            loads = self.engine.stats().dp_ranks
            return min(range(len(self.ranks)), key=lambda r: (loads[r].num_running + loads[r].num_waiting,
                                                              -loads[r].num_free_blocks, r))
        for r, served in enumerate(self.ranks):
            if served.instance_id == instance_id:
                return r
        raise ValueError(f"decode instance {instance_id[:200]!r} is not served here (this group serves "
                         f"{', '.join(s.instance_id for s in self.ranks)})")

    async def _admit_and_pull(self, req: Request, kv, rank: int = 0):
        with self.ranks[rank].admission.queued():  # bounded: requests waiting for KV room
            stream, block_ids, n_cached = await self._admit(req, kv.num_tokens, rank)
        self.metrics.dp_rank_requests.labels(dp_rank=str(rank)).inc()
        try:
            return stream, await self._pull(kv, block_ids, n_cached, self.ranks[rank].puller)
        except BaseException:
            self._drop(req.req_id, stream)
            raise

    def _give_up(self, req_id: str, prepared: asyncio.Future) -> None:
        """The caller left during admission/pull; now that no transfer writes our blocks, free them."""
        if not prepared.cancelled() and prepared.exception() is None:
            self._drop(req_id, prepared.result()[0])

    def _drop(self, req_id: str, stream) -> None:
        self.engine.abort(req_id)  # the engine defers the free of an importing request to import_done
        self.engine.import_done(req_id, False)
        asyncio.ensure_future(_drain(stream))  # its end unregisters the stream

    def _request(self, request) -> Request:
        g, kv = request.request, request.kv
        check_generate_proto(g, self.limits)  # before any block is reserved
        ids, prior = list(g.prompt_token_ids), list(g.output_token_ids)  # prior: a migrated request's outputs
        if not request.first.token_ids:
            raise ValueError("the first token(s) from prefill are missing")
        check_token_ids(request.first.token_ids, self.limits, "first.token_ids")
        if kv.num_tokens != len(ids) + len(prior):
            raise ValueError(f"KV handle covers {kv.num_tokens} tokens but the prompt has {len(ids)}"
                             + (f" and the outputs so far {len(prior)}" if prior else ""))
        check_kv_layout(kv.layout, self.puller.spec, f"prefill {kv.prefill_instance_id}")
        req = Request(g.request_id or uuid.uuid4().hex, ids, sampling_from_proto(g.sampling_params),
                      cache_salt=g.cache_salt or None)
        req.append_output(prior + list(request.first.token_ids))
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            raise ValueError("the request already has max_tokens tokens: nothing left to decode")
        return req

    async def _admit(self, req: Request, num_tokens: int, rank: int):
        deadline = time.monotonic() + self.admit_timeout_s
        delay = 0.01
        where = {"rank": rank} if len(self.ranks) > 1 else {}  # a DP group: that rank's blocks
        while True:
            admitted = await self.engine.add_import_request(req, num_tokens, **where)
            if admitted is not None:
                return admitted
            if time.monotonic() >= deadline:
                raise Overloaded(f"no KV room for {num_tokens} tokens within {self.admit_timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _pull(self, kv, block_ids: list[int], n_cached: int, puller) -> bool:
        """True when the prompt KV is in our blocks; False: the engine computes the prompt itself."""
        timed_out = False
        for attempt in range(self.pull_retries + 1):
            try:
                await puller.pull(kv, block_ids, n_cached)
                break
            except (TransferError, ValueError) as exc:
                timed_out |= isinstance(exc, TransferTimeout)
                self.num_pull_failures += 1
                self.metrics.kv_pull_failures.inc()
                log.warning("KV pull from %s failed (attempt %d): %s", kv.prefill_instance_id, attempt + 1, exc)
        else:
            # A cancelled (timed-out) READ may still land: keep the source pages until the lease expires
            # rather than let them be reused under it; a failed one is over, so free them now.
            if not timed_out:
                await self._release(kv, ())
            return self._recompute("the pulls failed")
        if not await self._release(kv, kv.block_generations):
            self.metrics.kv_pull_not_intact.inc()
            return self._recompute("the prefill could not confirm its pages were intact during the READ")
        return True

    def _recompute(self, why: str) -> bool:
        self.num_local_recomputes += 1
        self.metrics.kv_pull_recomputes.inc()
        log.warning("computing the prompt locally instead: %s", why)
        return False

    async def _release(self, kv, generations) -> bool:
        """ReleaseKV at the prefill; with `generations`, True only if it confirms the copy is intact."""
        address = kv.prefill_grpc_address
        if not address:
            return False
        ch = self._channels.get(address) or self._channels.setdefault(address, channel(address))
        try:
            reply = await prefill_pb2_grpc.PrefillStub(ch).ReleaseKV(
                prefill_pb2.ReleaseKVRequest(lease_id=kv.lease_id, block_generations=list(generations)),
                timeout=self.release_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("ReleaseKV at %s failed: %s", address, exc.code().name)
            return False
        return reply.intact

    def _spec_metrics(self) -> None:
        st = self.engine.stats()
        d, a, r, e = st.spec_drafts, st.spec_accepted, st.spec_steps, st.spec_emitted
        self.metrics.spec_decode_num_draft_tokens.inc(max(d - self._last_spec[0], 0))
        self.metrics.spec_decode_num_accepted_tokens.inc(max(a - self._last_spec[1], 0))
        self.metrics.spec_decode_num_full_rounds.inc(max(r - self._last_spec[2], 0))
        self.metrics.spec_decode_num_full_round_tokens.inc(max(e - self._last_spec[3], 0))
        self._last_spec = (d, a, r, e)
        for kind, n in getattr(st, "dp_steps", {}).items():  # a DP x EP group only
            self.metrics.dp_steps.labels(kind=kind).inc(max(n - self._last_dp.get(kind, 0), 0))
        self._last_dp = dict(getattr(st, "dp_steps", {}))


async def _drain(stream) -> None:
    async for _ in stream:
        pass
