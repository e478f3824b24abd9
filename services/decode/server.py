"""The Decode gRPC service: admit a request, pull its prompt KV from prefill over NIXL, stream tokens.

    Generate(request + KVHandle + first token)
      -> reserve blocks (waits while the pool is full; RESOURCE_EXHAUSTED after --admit-timeout-s)
      -> NIXL READ from the prefill rank(s) [retry once; then compute the prompt locally instead]
      -> the engine continues from the first token (HiSparse + MTP), deltas streamed back
A client that goes away aborts the request; its blocks are freed (after any transfer into them ended).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from engine.async_engine import AsyncEngine
from engine.request import Request
from proto.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from services.common.convert import check_kv_layout, delta_to_proto, sampling_from_proto
from services.common.admission import Admission
from services.common.grpc_server import Overloaded, grpc_errors
from services.common.metrics import ServiceMetrics
from services.common.nixl_agent import TransferError
from services.decode.puller import KVPuller

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Decode"


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, puller: KVPuller, metrics: ServiceMetrics, *, admit_timeout_s: float,
                 pull_retries: int = 1, admission: Admission | None = None):
        self.engine, self.puller, self.metrics = engine, puller, metrics
        self.admission = admission or Admission("decode", 1024, 256)
        self.admit_timeout_s = admit_timeout_s
        self.pull_retries = pull_retries
        self.num_pull_failures = 0
        self.num_local_recomputes = 0
        self._last_spec = (0, 0)

    @grpc_errors
    async def Generate(self, request, context):
        req = self._request(request)
        with self.admission.inflight():
            async for reply in self._generate(req, request):
                yield reply

    async def _generate(self, req: Request, request):
        with self.admission.queued():  # bounded: requests waiting for KV room
            stream, block_ids, n_cached = await self._admit(req, request.kv.num_tokens)
        ok = await self._pull_or_cancel(req.req_id, request.kv, block_ids, n_cached)
        self.engine.import_done(req.req_id, ok)
        t_first = None
        n_seen = 0
        async for out in stream:
            if out.delta_token_ids and t_first is None:
                t_first = time.monotonic()
            lps = out.logprobs[n_seen: n_seen + len(out.delta_token_ids)] if out.logprobs else None
            n_seen += len(out.delta_token_ids)
            yield decode_pb2.DecodeResponse(delta=delta_to_proto(out.delta_token_ids, lps, out.finish_reason,
                                                                 out.stop_reason))
        if t_first is not None and n_seen > 1:
            self.metrics.time_per_output_token_seconds.observe((time.monotonic() - t_first) / (n_seen - 1))
        self._spec_metrics()

    @grpc_errors
    async def Abort(self, request, context):
        self.engine.abort(request.request_id)
        return prefill_pb2.AbortResponse(aborted=True)

    # ---- steps ---------------------------------------------------------------------------------
    def _request(self, request) -> Request:
        g, kv = request.request, request.kv
        ids = list(g.prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        if not request.first.token_ids:
            raise ValueError("the first token(s) from prefill are missing")
        if kv.num_tokens != len(ids):
            raise ValueError(f"KV handle covers {kv.num_tokens} tokens but the prompt has {len(ids)}")
        check_kv_layout(kv.layout, self.puller.spec, f"prefill {kv.prefill_instance_id}")
        req = Request(g.request_id or uuid.uuid4().hex, ids, sampling_from_proto(g.sampling_params),
                      cache_salt=g.cache_salt or None)
        req.append_output(list(request.first.token_ids))
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            raise ValueError("the request already has max_tokens tokens: nothing left to decode")
        return req

    async def _admit(self, req: Request, num_tokens: int):
        deadline = time.monotonic() + self.admit_timeout_s
        delay = 0.01
        while True:
            admitted = await self.engine.add_import_request(req, num_tokens)
            if admitted is not None:
                return admitted
            if time.monotonic() >= deadline:
                raise Overloaded(f"no KV room for {num_tokens} tokens within {self.admit_timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _pull_or_cancel(self, req_id: str, kv, block_ids: list[int], n_cached: int) -> bool:
        """The pull, run to its end even when the client leaves meanwhile: a READ may still be writing
        our blocks, so a request given up mid-pull is freed only once the pull ended (never leaked)."""
        pull = asyncio.ensure_future(self._pull(kv, block_ids, n_cached))
        try:
            return await asyncio.shield(pull)
        except BaseException:
            self.engine.cancel(req_id)  # the scheduler defers freeing until import_done
            pull.add_done_callback(lambda _: self.engine.import_done(req_id, False))
            raise

    async def _pull(self, kv, block_ids: list[int], n_cached: int) -> bool:
        for attempt in range(self.pull_retries + 1):
            try:
                await self.puller.pull(kv, block_ids, n_cached)
                return True
            except (TransferError, ValueError) as exc:
                self.num_pull_failures += 1
                log.warning("KV pull from %s failed (attempt %d): %s", kv.prefill_instance_id, attempt + 1, exc)
        self.num_local_recomputes += 1
        log.warning("computing the prompt locally instead")
        return False

    def _spec_metrics(self) -> None:
        st = self.engine.stats()
        d, a = st.spec_drafts, st.spec_accepted
        self.metrics.spec_decode_num_draft_tokens.inc(max(d - self._last_spec[0], 0))
        self.metrics.spec_decode_num_accepted_tokens.inc(max(a - self._last_spec[1], 0))
        self._last_spec = (d, a)
