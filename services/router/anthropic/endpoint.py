"""The two routes, mounted on the router's FastAPI app by `mount(app, api)`:

    POST /v1/messages              -> a chat request prepared as /v1/chat/completions prepares it
                                      (services/router/prepare.py), run by `RouterAPI.respond`; its
                                      result or SSE stream converted to Anthropic's blocks / events
    POST /v1/messages/count_tokens -> {"input_tokens": N}, the prompt rendered exactly as for
                                      /v1/messages (same template, tools, billing header dropped)
Bodies are parsed here rather than by FastAPI so that every failure, a malformed body included,
answers in Anthropic's error form.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from services.router.anthropic import stream
from services.router.anthropic.convert import chat_completion_request, chat_request, new_message_id
from services.router.anthropic.errors import InvalidRequest, convert_error_response, error_response
from services.router.anthropic.models import CountTokensRequest, MessagesRequest
from services.router.anthropic.response import message_from_chat
from services.router.chat_request import render_chat
from services.router.errors import exception_response
from services.router.openai_models import ChatCompletionRequest
from services.router.prepare import check_model, prepare_chat
from services.router.requests import BadRequest, Prepared


def _invalid(exc: ValidationError, prefix: str = "") -> InvalidRequest:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return InvalidRequest(first.get("msg", "malformed"), prefix + where if where else None)


async def _parse(request: Request, model):
    try:
        raw = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("the body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _chat(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc, "(as a chat request) ") from None


class AnthropicAPI:
    def __init__(self, api):
        self.api = api  # the RouterAPI: its served model and the `respond` that runs a prepared request

    async def messages(self, request: Request):
        try:
            req = await _parse(request, MessagesRequest)
            prep, capped = self._prepare(chat_completion_request(req), request.state.tenant)
            resp = await self.api.respond(prep, "chat", request)
        except InvalidRequest as exc:
            return error_response(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error body
            return convert_error_response(exception_response(exc))
        if isinstance(resp, StreamingResponse):
            state = stream.MessageStream(new_message_id(), req.model, req.stop_sequences, capped)
            # the same response object keeps its admission release; only its body is translated
            resp.body_iterator = stream.with_pings(stream.events(resp.body_iterator, state))
            return resp
        return JSONResponse(message_from_chat(resp, new_message_id(), req.model, req.stop_sequences, capped))

    def _prepare(self, body: dict, tenant: str | None) -> tuple[Prepared, bool]:
        """The chat request, and whether `max_tokens` was lowered to the room the prompt leaves in the
        context. As Anthropic's API does, a `max_tokens` past the context window generates up to the
        window and stops with `model_context_window_exceeded`, instead of refusing the request; only a
        prompt that alone fills the context is refused."""
        served = self.api.served
        try:
            return prepare_chat(_chat(body), served, tenant), False
        except BadRequest as exc:
            if exc.code != "context_length_exceeded" or exc.param != "max_tokens":
                raise
            prompt = render_chat(_chat(body), served.chat).prompt
            room = served.limits.max_model_len - len(served.tok.encode(prompt))
            if room < 1:
                raise
        body["max_tokens"] = room
        return prepare_chat(_chat(body), served, tenant), True

    async def count_tokens(self, request: Request):
        try:
            req = await _parse(request, CountTokensRequest)
            chat = _chat({**chat_request(req), "max_tokens": 1})
        except InvalidRequest as exc:
            return error_response(400, str(exc))
        served = self.api.served
        try:
            check_model(chat.model, served.names)
            prompt = render_chat(chat, served.chat).prompt  # what /v1/messages would render
        except Exception as exc:  # noqa: BLE001 - every failure becomes an Anthropic error body
            return convert_error_response(exception_response(exc))
        return {"input_tokens": len(served.tok.encode(prompt))}


def _inline(node, defs: dict):
    """A JSON schema with its `$defs` references replaced by the definitions (OpenAPI resolves `$ref`
    from the document root, where pydantic's `#/$defs/...` do not exist)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _body(model) -> dict:
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _inline(schema, schema.get("$defs", {}))}}}}


def mount(app: FastAPI, api) -> None:
    routes = AnthropicAPI(api)
    # a body that is not strict JSON (services/router/strict_json.py) is refused in Anthropic's error form
    app.state.error_forms = {**(getattr(app.state, "error_forms", None) or {}), "/v1/messages": convert_error_response}
    app.post("/v1/messages", summary="Anthropic Messages API (text, tools, thinking; SSE when stream)",
             openapi_extra=_body(MessagesRequest))(routes.messages)
    app.post("/v1/messages/count_tokens", summary="Anthropic token counting",
             openapi_extra=_body(CountTokensRequest))(routes.count_tokens)
