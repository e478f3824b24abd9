"""The routes, mounted on the router's FastAPI app by `mount(app, api)`:

    POST   /v1/responses       the fields checked (models.py; numbers against the bounds the chat path
                               uses, under the Responses names), the conversation of previous_response_id
                               read from the store, the chat request (convert.py) prepared as
                               /v1/chat/completions prepares it and run by `RouterAPI.respond`; its result
                               made a Response (response.py) or its SSE stream Responses events
                               (stream.py); stored before it is returned when `store` is true
    GET    /v1/responses/{id}  the stored Response (an id not shaped `resp_<alphanumerics>` is a 400)
    DELETE /v1/responses/{id}  {"id", "object": "response.deleted", "deleted": true}
Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`, `param` named as this API names the
field (the chat path's `max_tokens` is `max_output_tokens` here, `messages` is `input`, `response_format`
is `text.format`): 400 for bad input, 404 for a response id not stored (expired, deleted, another
tenant's; code `previous_response_not_found` when it was the previous_response_id), 503 + Retry-After
when the store (Redis) does not answer.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from services.router.errors import error_response, exception_response
from services.router.openai_models import ChatCompletionRequest
from services.router.prepare import prepare_chat
from services.router.requests import BadRequest, Prepared
from services.router.responses_api import convert, response, stream
from services.router.responses_api.models import ResponsesRequest, check_fields
from services.router.responses_api.store import RESPONSE_ID, StoreUnavailable, store_for
from services.router.validation import check_body

# a response id in a path: anything else is a 400 before the store is asked (and the schema says so)
ResponseId = Annotated[str, Path(pattern=RESPONSE_ID.pattern)]
# chat-request field names (a param, or its prefix) as the Responses request names them
_PARAM_OF_CHAT = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                  ("max_tokens", "max_output_tokens"), ("messages", "input"), ("chat_template_kwargs", "reasoning"))


class NotStored(LookupError):
    def __init__(self, resp_id: str, param: str | None):
        super().__init__(f"{'Previous response' if param else 'Response'} with id {resp_id!r} not found.")
        self.param = param


def _param(param: str | None) -> str | None:
    for chat, ours in _PARAM_OF_CHAT:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            return ours + param[len(chat):]
    return param


def error(exc: BaseException) -> JSONResponse:
    """Any failure as an OpenAI error body, its `param` in this API's names. An unknown previous_response_id
    is a bad request (400, as OpenAI answers it); GET / DELETE of an unknown id is 404."""
    if isinstance(exc, NotStored):
        if exc.param:
            return error_response(400, str(exc), code="previous_response_not_found", param=exc.param)
        return error_response(404, str(exc), code="not_found")
    if isinstance(exc, StoreUnavailable):
        return error_response(503, str(exc), "service_unavailable", retry_after=2)
    resp = exception_response(exc)
    body = json.loads(resp.body)
    err = body["error"]
    param = _param(err.get("param"))
    if param != err.get("param"):
        err["param"] = param
        if not err["message"].startswith(f"{param}:"):
            err["message"] = f"{param}: {err['message']}"
    keep = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(body, status_code=resp.status_code, headers=keep or None)


class ResponsesAPI:
    def __init__(self, api, store):
        self.api = api  # the RouterAPI: its served model and the `respond` that runs a prepared request
        self.store = store

    def count_tokens(self, text: str) -> int:
        return len(self.api.served.tok.encode(text))

    async def create(self, body: ResponsesRequest, request: Request):
        tenant = request.state.tenant
        try:
            prep, conversation, encrypted = await self._prepare(body, tenant)
            result = await self.api.respond(prep, "chat", request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error(exc)
        resp = response.skeleton(response.new_id("resp"), body, body.model or self.api.served.names[0], prep.params)

        async def save(final: dict) -> None:
            await self.store.save(final, conversation, tenant)

        if isinstance(result, StreamingResponse):
            state = stream.ResponseEvents(resp, encrypted, self.count_tokens)
            # the same response object keeps its admission release; only its body is translated
            result.body_iterator = stream.events(result.body_iterator, state, save if body.store else None)
            return result
        final = response.from_chat(resp, result, encrypted, self.count_tokens)
        if body.store and final["status"] != "failed":
            try:
                await save(final)
            except StoreUnavailable as exc:
                return error(exc)
        return JSONResponse(final)

    async def _prepare(self, body: ResponsesRequest, tenant: str | None) -> tuple[Prepared, list[dict], bool]:
        """The prepared chat request, the conversation to store with the response, and whether reasoning
        also goes out as encrypted_content."""
        check_fields(body)
        check_body(body, "responses", self.api.served.limits)
        convert.check_metadata(body.metadata)
        encrypted = convert.check_include(body.include)
        items = convert.input_items(body.input)
        history = await self._history(body.previous_response_id, tenant)
        convert.check_call_outputs(history, items)
        conversation = history + items
        try:
            chat = ChatCompletionRequest.model_validate(convert.chat_request(body, conversation))
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise BadRequest(f"{where}: {first.get('msg', 'malformed')}", where or None) from None
        return prepare_chat(chat, self.api.served, tenant), conversation, encrypted

    async def _history(self, resp_id: str | None, tenant: str | None) -> list[dict]:
        """The stored conversation that `resp_id` continues: its input items, then its output."""
        if resp_id is None:
            return []
        record = await self.store.load(resp_id, tenant)
        if record is None:
            raise NotStored(resp_id, "previous_response_id")
        return record["conversation"] + record["response"]["output"]

    async def retrieve(self, response_id: ResponseId, request: Request):
        try:
            record = await self.store.load(response_id, request.state.tenant)
            if record is None:
                raise NotStored(response_id, None)
        except (NotStored, StoreUnavailable) as exc:
            return error(exc)
        return JSONResponse(record["response"])

    async def delete(self, response_id: ResponseId, request: Request):
        try:
            if not await self.store.delete(response_id, request.state.tenant):
                raise NotStored(response_id, None)
        except (NotStored, StoreUnavailable) as exc:
            return error(exc)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def mount(app: FastAPI, api) -> None:
    """The three routes; stored responses go to Redis when the router reads Redis (store.store_for)."""
    routes = ResponsesAPI(api, store_for(api.flow.routing, api.responses_ttl_s))
    app.state.responses_store = routes.store
    app.post("/v1/responses", summary="OpenAI Responses API (text, function tools, reasoning; SSE when stream)")(
        routes.create)
    app.get("/v1/responses/{response_id}", summary="A stored response")(routes.retrieve)
    app.delete("/v1/responses/{response_id}", summary="Delete a stored response")(routes.delete)
