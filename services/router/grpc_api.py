"""The router's gRPC face: Router.Generate, a server stream of token deltas with text and usage.

The same checks as the HTTP API (requests.py), the same API keys (`authorization: Bearer <key>`
metadata) and the same in-flight bound (RESOURCE_EXHAUSTED with `retry-after-ms`).

A request may carry a `chat` (messages, tools, tool_choice, chat_template_kwargs as JSON text) instead
of a prompt: it is rendered with the model's chat template and checked as /v1/chat/completions checks
it; a required or named tool_choice is enforced with a grammar; with the server's parsers each reply
also carries the text split into `reasoning`, `content` and `tool_calls`, and the last one a
`finish_reason` ("tool_calls" when a call was made)."""

from __future__ import annotations

import dataclasses
import json

import pydantic

from proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.chat_output import ChoiceParser
from services.router.chat_request import ChatSettings, prepare_chat_request
from services.router.flow import Flow, RequestStats, new_request_id
from services.router.guard import ApiKeys, tenant_cache_salt
from services.router.openai_models import ChatCompletionRequest
from services.router.requests import BadRequest, Limits, prepare_generate
from services.router.tool_parsers import ToolCallDelta
from services.rpc.admission import Admission
from services.rpc.grpc_server import grpc_errors
from services.transfer.wire import delta_to_proto

SERVICE_NAME = "pdserve.v1.Router"


def _json_field(text: str, name: str, default=None):
    if not text:
        return default
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadRequest(f"chat.{name} is not JSON (or nested too deeply): {e}", f"chat.{name}") from e


def chat_body(chat: common_pb2.ChatRequest) -> ChatCompletionRequest:
    """The ChatRequest message as the HTTP API's request model (the same validation)."""
    fields = {"messages": _json_field(chat.messages_json, "messages_json"),
              "tools": _json_field(chat.tools_json, "tools_json"),
              "tool_choice": _json_field(chat.tool_choice_json, "tool_choice_json"),
              "chat_template_kwargs": _json_field(chat.chat_template_kwargs_json, "chat_template_kwargs_json")}
    for name in ("parallel_tool_calls", "add_generation_prompt", "include_reasoning"):
        if chat.HasField(name):
            fields[name] = getattr(chat, name)
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"chat: {where}: {first['msg']}", f"chat.{where}") from e


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, flow: Flow, limits: Limits, model_name: str | list[str], keys: ApiKeys | None = None,
                 admission: Admission | None = None, chat: ChatSettings | None = None):
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.flow, self.limits, self.model_name = flow, limits, self.model_names[0]
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission("router", 1024)
        self.chat = chat or ChatSettings(None)

    def _tenant(self, context) -> str | None:
        metadata = dict(context.invocation_metadata() or ())
        return self.keys.tenant(metadata.get("authorization"))

    def _prepare(self, request):
        """(prompt ids, SamplingParams, ChoiceParser or None)."""
        if not request.HasField("chat"):
            return (*prepare_generate(request, self.flow.tokenizer, self.limits), None)
        if request.prompt or request.prompt_token_ids:
            raise BadRequest("give either chat or a prompt, not both", "chat")
        try:
            plan = prepare_chat_request(chat_body(request.chat), self.chat)
        except RecursionError as e:  # a schema or message nested past what the checks can walk
            raise BadRequest("chat is nested too deeply", "chat") from e
        g = common_pb2.GenerateRequest()
        g.CopyFrom(request)
        g.ClearField("chat")
        g.prompt_token_ids.extend(self.flow.tokenizer.encode(plan.prompt))
        ids, params = prepare_generate(g, self.flow.tokenizer, self.limits)
        if plan.forced is not None:
            if params.structured_outputs is not None:
                raise BadRequest("a required or named tool_choice cannot be combined with structured_outputs",
                                 "tool_choice")
            params = dataclasses.replace(params, structured_outputs=plan.forced)
        return ids, params, (None if plan.output.plain else ChoiceParser(plan.output))

    @grpc_errors
    async def Generate(self, request, context):
        tenant = self._tenant(context)
        if request.model and request.model not in self.model_names:
            raise BadRequest(f"model {request.model!r} does not exist; this server serves {self.model_name!r}")
        ids, params, parser = self._prepare(request)
        # engines see a fresh id: a client's id can never collide with (or name) another client's request
        stats = RequestStats(new_request_id("grpc"), len(ids))
        reply_id = request.request_id or stats.req_id
        salt = tenant_cache_salt(tenant, request.cache_salt or None)
        with self.admission.inflight():
            async for c in self.flow.generate(ids, params, stats, salt):
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
