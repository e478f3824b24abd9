"""What else an agent expects of the router's HTTP API.

    X-Request-Id     a client's id (up to 128 characters of [A-Za-z0-9._:-]) is echoed on the response and
                     becomes part of the request's id everywhere it is logged (router, prefill, decode),
                     with a random suffix so two clients' ids never collide in an engine; without one,
                     the response carries the id the router made
    generation_config.json   the checkpoint's sampling defaults (temperature, top_p, top_k, min_p,
                     repetition_penalty; max_new_tokens as the default max_tokens) for the fields a
                     request leaves unset
    POST /tokenize   {prompt} or {messages, tools, chat_template_kwargs, add_generation_prompt} ->
                     {count, max_model_len, tokens, token_strs}
    POST /detokenize {tokens} -> {prompt}
    GET  /version    {version}
"""

from __future__ import annotations

import json
import re
import uuid
from importlib import metadata
from pathlib import Path

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from services.router.chat_request import render_chat
from services.router.openai_models import ChatCompletionRequest
from services.router.requests import BadRequest

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty"}


class RequestIdHeader:
    """ASGI middleware: `scope["state"]["client_request_id"]` is the client's X-Request-Id (None without a
    usable one); the response echoes it, or the id the router made (`scope["state"]["request_id"]`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"), None)
        state = scope.setdefault("state", {})
        state["client_request_id"] = given if given and REQUEST_ID.match(given) else None
        state["request_id"] = state["client_request_id"] or uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", state["request_id"].encode())]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


def new_api_request_id(prefix: str, client_id: str | None) -> str:
    """`chatcmpl-<client id>-<8 hex>` with a client id, else `chatcmpl-<32 hex>`."""
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


def load_generation_defaults(model_dir: str | Path) -> dict:
    """The sampling defaults of the checkpoint's generation_config.json ({} without one)."""
    file = Path(model_dir) / "generation_config.json"
    cfg = json.loads(file.read_text()) if file.is_file() else {}
    out = {field: cfg[key] for key, field in GENERATION_FIELDS.items() if cfg.get(key) is not None}
    if isinstance(cfg.get("max_new_tokens"), int):
        out["max_tokens"] = cfg["max_new_tokens"]
    return out


def apply_generation_defaults(body, defaults: dict) -> None:
    """Fill the fields the request did not set (pydantic's `model_fields_set`) from `defaults`."""
    unset = [k for k in defaults if k not in body.model_fields_set]
    if "max_tokens" in unset and "max_completion_tokens" in body.model_fields_set:
        unset.remove("max_tokens")
    for key in unset:
        setattr(body, key, defaults[key])


def package_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = Field(default=None, min_length=1)
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class ExtraEndpoints:
    """/version, /tokenize and /detokenize, mixed into RouterAPI: it provides `served` (prepare.ServedModel),
    `_check_model` and `error` (an exception as an OpenAI error response)."""

    async def version(self) -> dict:
        return {"version": package_version()}

    async def tokenize(self, body: TokenizeRequest):
        try:
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise BadRequest("give exactly one of prompt and messages", "prompt")
            if body.prompt is not None:
                text = body.prompt
            else:
                try:
                    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                                 chat_template_kwargs=body.chat_template_kwargs,
                                                 add_generation_prompt=body.add_generation_prompt, tool_choice="none")
                except pydantic.ValidationError as e:
                    raise BadRequest(f"messages: {e.errors()[0]['msg']}", "messages") from e
                text = render_chat(chat, self.served.chat).prompt
            tok = self.served.tok
            ids = tok.encode(text)
            strs = [tok.id_to_token(t) for t in ids] if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": self.served.limits.max_model_len, "tokens": ids,
                    "token_strs": strs}
        except Exception as exc:  # noqa: BLE001
            return self.error(exc)

    async def detokenize(self, body: DetokenizeRequest):
        try:
            self._check_model(body.model)
            vocab_size = self.served.limits.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"tokens must be in [0, {vocab_size}); got {bad[:5]}", "tokens")
            return {"prompt": self.served.tok.decode(body.tokens, skip_special_tokens=False)}
        except Exception as exc:  # noqa: BLE001
            return self.error(exc)

