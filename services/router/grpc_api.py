"""The router's gRPC face: Router.Generate, a server stream of token deltas with text and usage."""

from __future__ import annotations

from proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.convert import delta_to_proto, sampling_from_proto
from services.common.grpc_server import grpc_errors
from services.router.flow import Flow, RequestStats, new_request_id
from services.router.requests import BadRequest, Limits

SERVICE_NAME = "pdserve.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, flow: Flow, limits: Limits, model_name: str):
        self.flow, self.limits, self.model_name = flow, limits, model_name

    def _prompt(self, g: common_pb2.GenerateRequest) -> list[int]:
        if g.model and g.model != self.model_name:
            raise BadRequest(f"model {g.model!r} does not exist; this server serves {self.model_name!r}")
        if bool(g.prompt) == bool(g.prompt_token_ids):
            raise BadRequest("give exactly one of prompt and prompt_token_ids")
        ids = self.flow.tokenizer.encode(g.prompt) if g.prompt else list(g.prompt_token_ids)
        bad = [t for t in ids if t >= self.limits.vocab_size]
        if not ids or bad:
            raise BadRequest(f"the prompt must have tokens in [0, {self.limits.vocab_size})")
        return ids

    @grpc_errors
    async def Generate(self, request, context):
        ids = self._prompt(request)
        params = sampling_from_proto(request.sampling_params)
        if len(ids) + params.max_tokens > self.limits.max_model_len:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                             f"context length {self.limits.max_model_len}")
        stats = RequestStats(request.request_id or new_request_id("grpc"), len(ids))
        async for c in self.flow.generate(ids, params, stats, request.cache_salt or None):
            reply = router_pb2.GenerateResponse(request_id=stats.req_id,
                                                delta=delta_to_proto(c.token_ids, c.logprobs, c.finish_reason,
                                                                     c.stop_reason), text=c.text)
            if c.finish_reason is not None:
                reply.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=stats.completion_tokens,
                                                      cached_tokens=stats.cached_tokens))
            yield reply
