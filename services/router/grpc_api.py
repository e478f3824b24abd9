"""The router's gRPC face: Router.Generate, a server stream of token deltas with text and usage.

The same checks as the HTTP API (prepare.py), the same API keys (`authorization: Bearer <key>`
metadata) and the same in-flight bound (RESOURCE_EXHAUSTED with `retry-after-ms`).

A request may carry a `chat` (messages, tools, tool_choice, chat_template_kwargs as JSON text) instead
of a prompt: it is rendered with the model's chat template and checked as /v1/chat/completions checks
it; a required or named tool_choice is enforced with a grammar; with the server's parsers each reply
also carries the text split into `reasoning`, `content` and `tool_calls`, and the last one a
`finish_reason` ("tool_calls" when a call was made)."""

from __future__ import annotations

from proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.chat_output import ChoiceParser
from services.router.chat_request import ChatSettings
from services.router.flow import Flow, RequestStats, new_request_id
from services.router.guard import ApiKeys
from services.router.prepare import ServedModel, prepare_generate
from services.router.requests import Limits
from services.router.tool_parsers import ToolCallDelta
from services.rpc.admission import Admission
from services.rpc.convert import delta_to_proto
from services.rpc.grpc_server import grpc_errors

SERVICE_NAME = "pdserve.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, flow: Flow, limits: Limits, model_name: str | list[str], keys: ApiKeys | None = None,
                 admission: Admission | None = None, chat: ChatSettings | None = None):
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.served = ServedModel(names, flow.tokenizer, limits, chat or ChatSettings(None))
        self.flow = flow
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission("router", 1024)

    def _tenant(self, context) -> str | None:
        metadata = dict(context.invocation_metadata() or ())
        return self.keys.tenant(metadata.get("authorization"))

    @grpc_errors
    async def Generate(self, request, context):
        prep = prepare_generate(request, self.served, self._tenant(context))
        ids, params = prep.prompts[0], prep.params
        parser = ChoiceParser(prep.output) if prep.output is not None and not prep.output.plain else None
        # engines see a fresh id: a client's id can never collide with (or name) another client's request
        stats = RequestStats(new_request_id("grpc"), len(ids))
        reply_id = request.request_id or stats.req_id
        with self.admission.inflight():
            async for c in self.flow.generate(ids, params, stats, prep.cache_salt):
                reply = router_pb2.GenerateResponse(request_id=reply_id, text=c.text,
                                                    delta=delta_to_proto(c.token_ids, c.logprobs, c.finish_reason,
                                                                         c.stop_reason))
                if parser is not None:
                    _split(reply, parser, c)
                elif c.finish_reason is not None:
                    reply.finish_reason = c.finish_reason
                if c.finish_reason is not None:
                    reply.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(ids),
                                                          completion_tokens=stats.completion_tokens,
                                                          cached_tokens=stats.cached_tokens))
                yield reply


def _split(reply, parser: ChoiceParser, chunk) -> None:
    events = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason else [])
    for e in events:
        if isinstance(e, ToolCallDelta):
            reply.tool_calls.append(router_pb2.ToolCallDelta(index=e.index, id=e.id or "", name=e.name or "",
                                                            arguments=e.arguments))
        elif e[0] == "reasoning":
            reply.reasoning += e[1]
        else:
            reply.content += e[1]
    if chunk.finish_reason is not None:
        reply.finish_reason = parser.finish_reason(chunk.finish_reason)
