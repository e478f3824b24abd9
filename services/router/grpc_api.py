"""The router's gRPC face: Router.Generate, a server stream of token deltas with text and usage.

The same checks as the HTTP API (requests.py), the same API keys (`authorization: Bearer <key>`
metadata) and the same in-flight bound (RESOURCE_EXHAUSTED with `retry-after-ms`)."""

from __future__ import annotations

from proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.flow import Flow, RequestStats, new_request_id
from services.router.guard import ApiKeys, tenant_cache_salt
from services.router.requests import BadRequest, Limits, prepare_generate
from services.rpc.admission import Admission
from services.rpc.grpc_server import grpc_errors
from services.transfer.wire import delta_to_proto

SERVICE_NAME = "pdserve.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, flow: Flow, limits: Limits, model_name: str, keys: ApiKeys | None = None,
                 admission: Admission | None = None):
        self.flow, self.limits, self.model_name = flow, limits, model_name
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission("router", 1024)

    def _tenant(self, context) -> str | None:
        metadata = dict(context.invocation_metadata() or ())
        return self.keys.tenant(metadata.get("authorization"))

    @grpc_errors
    async def Generate(self, request, context):
        tenant = self._tenant(context)
        if request.model and request.model != self.model_name:
            raise BadRequest(f"model {request.model!r} does not exist; this server serves {self.model_name!r}")
        ids, params = prepare_generate(request, self.flow.tokenizer, self.limits)
        # engines see a fresh id: a client's id can never collide with (or name) another client's request
        stats = RequestStats(new_request_id("grpc"), len(ids))
        reply_id = request.request_id or stats.req_id
        salt = tenant_cache_salt(tenant, request.cache_salt or None)
        with self.admission.inflight():
            async for c in self.flow.generate(ids, params, stats, salt):
                reply = router_pb2.GenerateResponse(request_id=reply_id, text=c.text,
                                                    delta=delta_to_proto(c.token_ids, c.logprobs, c.finish_reason,
                                                                         c.stop_reason))
                if c.finish_reason is not None:
                    reply.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(ids),
                                                          completion_tokens=stats.completion_tokens,
                                                          cached_tokens=stats.cached_tokens))
                yield reply
