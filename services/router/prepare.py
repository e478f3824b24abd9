"""An API request made into engine work, step by step:

    parse     the body as its request model: FastAPI with strict JSON for HTTP (strict_json.py,
              openai_models.py); a gRPC `chat` read into the same model (`chat_body`)
    validate  the model is served, every field is implemented (api_fields.py), the checkpoint's
              generation defaults fill unset fields (extra_api.py), every number is in range (validation.py)
    render    chat only: messages, tools and tool_choice checked, the chat template rendered, the output
              parsers and a forced call's grammar chosen (chat_request.py)
    build     token ids, SamplingParams with the structured output (structured.py) or the forced call,
              the tenant's cache salt (requests.py) -> `Prepared`

Each step raises BadRequest naming the field (HTTP 400, gRPC INVALID_ARGUMENT) before any engine sees the
request. The Anthropic Messages API turns its body into a chat request first (anthropic/convert.py) and
then takes the chat path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import pydantic

from engine.frontend.tokenizer import Tokenizer
from proto.pdserve.v1 import common_pb2
from services.router.api_fields import check_extra_fields
from services.router.chat_request import ChatSettings, render_chat
from services.router.extra_api import apply_generation_defaults
from services.router.guard import tenant_cache_salt
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.requests import BadRequest, Limits, Prepared, build_chat, build_completion, build_generate
from services.router.validation import check_body


@dataclass(frozen=True)
class ServedModel:
    """What requests are prepared against: the names clients may use (responses carry the first), the
    tokenizer, the limits, the chat template and parsers, the checkpoint's sampling defaults."""

    names: tuple[str, ...]
    tok: Tokenizer
    limits: Limits
    chat: ChatSettings
    generation_defaults: Mapping[str, object] = field(default_factory=dict)


def prepare_chat(body: ChatCompletionRequest, served: ServedModel, tenant: str | None) -> Prepared:
    """/v1/chat/completions (and /v1/messages, converted)."""
    validate(body, "chat", served)
    plan = render_chat(body, served.chat)
    return build_chat(body, plan, served.tok, served.limits, tenant_cache_salt(tenant, body.cache_salt))


def prepare_completion(body: CompletionRequest, served: ServedModel, tenant: str | None) -> Prepared:
    """/v1/completions: no template; the prompt is text, texts, token ids or lists of them."""
    validate(body, "completions", served)
    return build_completion(body, served.tok, served.limits, tenant_cache_salt(tenant, body.cache_salt))


def prepare_generate(request: common_pb2.GenerateRequest, served: ServedModel, tenant: str | None) -> Prepared:
    """gRPC Router.Generate: a prompt (text or ids) as given, or a `chat` rendered as /v1/chat/completions
    renders it; the sampling parameters are the message's own, checked as the engines check them."""
    if request.model and request.model not in served.names:
        raise BadRequest(f"model {request.model!r} does not exist; this server serves {served.names[0]!r}")
    if request.output_token_ids:
        raise BadRequest("output_token_ids is set by the router between its services (a migrated request); "
                         "a client gives a prompt", "output_token_ids")
    salt = tenant_cache_salt(tenant, request.cache_salt or None)
    if not request.HasField("chat"):
        return build_generate(request, served.tok, served.limits, salt)
    if request.prompt or request.prompt_token_ids:
        raise BadRequest("give either chat or a prompt, not both", "chat")
    try:
        plan = render_chat(chat_body(request.chat), served.chat)
    except RecursionError as e:  # a schema or message nested past what the checks can walk
        raise BadRequest("chat is nested too deeply", "chat") from e
    g = common_pb2.GenerateRequest()
    g.CopyFrom(request)
    g.ClearField("chat")
    g.prompt_token_ids.extend(served.tok.encode(plan.prompt))
    return build_generate(g, served.tok, served.limits, salt, plan)


# ---- validate --------------------------------------------------------------------------------------
def validate(body: ChatCompletionRequest | CompletionRequest, endpoint: str, served: ServedModel) -> None:
    """The body's own checks, in the order a client fixes them: model, fields, numbers."""
    check_model(body.model, served.names)
    check_extra_fields(body)
    apply_generation_defaults(body, served.generation_defaults)
    if endpoint == "completions":
        if body.echo:
            raise BadRequest("echo is not supported", "echo")
        if body.suffix:
            raise BadRequest("suffix is not supported", "suffix")
    check_body(body, endpoint, served.limits)


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    if model and model not in names:
        served = ", ".join(map(repr, names))
        raise BadRequest(f"model {model!r} does not exist; this server serves {served}", "model",
                         code="model_not_found")


# ---- parse (gRPC chat) -----------------------------------------------------------------------------
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


def _json_field(text: str, name: str, default=None):
    if not text:
        return default
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadRequest(f"chat.{name} is not JSON (or nested too deeply): {e}", f"chat.{name}") from e
