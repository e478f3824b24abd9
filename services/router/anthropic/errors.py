"""Anthropic's error form: `{"type": "error", "error": {"type", "message"}}` with its status codes.

The chat path answers OpenAI error bodies; `from_openai` maps them: 400 invalid_request_error (404
not_found_error for an unknown model), 401 authentication_error, 413 request_too_large, 429
rate_limit_error, 503 (no instance of a role can take the request) 529 overloaded_error, any other
5xx api_error with its status kept. Retry-After headers pass through unchanged.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                  529: "overloaded_error"}
OVERLOADED = 529
# chat-request field names that differ from the Messages field the client sent
_PARAM_OF_CHAT = {"stop": "stop_sequences", "response_format": "output_config.format",
                  "chat_template_kwargs": "thinking", "max_completion_tokens": "max_tokens"}


class InvalidRequest(ValueError):
    """A Messages request we refuse; `param` is the dotted path of the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def error_body(type_: str, message: str) -> dict:
    return {"type": "error", "error": {"type": type_, "message": message}}


def error_response(status: int, message: str, type_: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    type_ = type_ or TYPE_OF_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(type_, message), status_code=status, headers=headers)


def from_openai(status: int, body: dict) -> tuple[int, dict]:
    """(status, Anthropic body) for an OpenAI error (status, body) of the chat path."""
    err = body.get("error") if isinstance(body.get("error"), dict) else {}
    message = str(err.get("message") or "request failed")
    param = _PARAM_OF_CHAT.get(err.get("param"), err.get("param"))
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    if status == 400 and err.get("code") == "model_not_found":
        status = 404
    elif status == 503:
        status = OVERLOADED
    elif status == 401:
        return status, error_body("authentication_error", message)
    type_ = TYPE_OF_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, error_body(type_, message)


def convert_error_response(resp) -> JSONResponse:
    """An OpenAI JSONResponse of the chat path as the same failure in Anthropic's form."""
    status, body = from_openai(resp.status_code, json.loads(resp.body or b"{}"))
    keep = {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after", "www-authenticate")}
    return JSONResponse(body, status_code=status, headers=keep or None)
