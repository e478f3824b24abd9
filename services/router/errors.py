"""Every failure of an OpenAI-API request as its error response: `{"error": {"message", "type", "param",
"code"}}` with the HTTP status (the Anthropic routes convert these: services/router/anthropic/errors.py).

    BadRequest (a field's check)           400, `param` names the field, `code` says which rule
    RecursionError (JSON nested too deep)  400
    Overloaded (the router's own bound)    429 + Retry-After
    NoInstance (no healthy prefill/decode) 503 + Retry-After
    an engine's gRPC status                INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
                                           DEADLINE_EXCEEDED 504, FAILED_PRECONDITION 409, other 502
    UpstreamError (an engine failed)       502
    anything else                          500, logged with its traceback
"""

from __future__ import annotations

import logging
import math

import grpc
from fastapi.responses import JSONResponse

from services.router.flow import UpstreamError
from services.router.openai_models import error_body
from services.router.requests import BadRequest
from services.router.routing import NoInstance
from services.rpc.grpc_server import Overloaded, retry_after_s

log = logging.getLogger(__name__)

_GRPC_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
              grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
              grpc.StatusCode.FAILED_PRECONDITION: 409}


def error_response(status: int, message: str, type_: str = "invalid_request_error", code=None, param=None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(error_body(message, type_, code if code is not None else status, param), status_code=status,
                        headers=headers)


def exception_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, BadRequest):
        return error_response(400, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, RecursionError):  # JSON nested past what a schema check or a template can walk
        return error_response(400, "the request is nested too deeply")
    if isinstance(exc, Overloaded):
        return error_response(429, str(exc), "rate_limit_error", retry_after=math.ceil(exc.retry_after_s))
    if isinstance(exc, NoInstance):
        return error_response(503, str(exc), "service_unavailable", retry_after=2)
    if isinstance(exc, grpc.aio.AioRpcError):
        status = _GRPC_HTTP.get(exc.code(), 502)
        return error_response(status, f"{exc.code().name}: {exc.details()}",
                              "invalid_request_error" if status == 400 else "upstream_error",
                              retry_after=math.ceil(retry_after_s(exc)) if status in (429, 503) else None)
    if isinstance(exc, UpstreamError):
        return error_response(502, str(exc), "upstream_error")
    log.exception("request failed", exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}", "internal_error")
