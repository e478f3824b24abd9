"""The router's OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE; tools,
tool calls and reasoning: chat_request.py, chat_output.py), /v1/models, /tokenize, /detokenize,
/version, /health, /metrics. Errors are `{"error": {"message", "type", "param", "code"}}`.
Bodies are parsed as strict JSON (strict_json.py) and their numbers checked (validation.py) before use.
The Anthropic Messages API (/v1/messages) is mounted beside them from services/router/anthropic/."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.anthropic.endpoint import mount as mount_anthropic
from services.router.api_fields import check_extra_fields
from services.router.chat_output import ChoiceParser, OutputOptions, openai_delta, openai_message
from services.router.chat_request import ChatSettings, prepare_chat_request
from services.router.extra_api import ExtraEndpoints, RequestIdHeader, apply_generation_defaults, new_api_request_id
from services.router.flow import Flow, RequestStats, UpstreamError
from services.router.guard import ApiKeys, Guard, tenant_cache_salt
from services.router.openai_models import ChatCompletionRequest, CompletionRequest, error_body
from services.router.requests import BadRequest, Limits, Prepared, prepare_chat, prepare_completion
from services.router.responses import Formatter, sse, usage
from services.router.routing import NoInstance
from services.router.strict_json import StrictJSONRoute
from services.rpc.admission import Admission
from services.rpc.bounds import seed_for_sample
from services.rpc.grpc_server import Overloaded, retry_after_s

log = logging.getLogger(__name__)

_GRPC_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
              grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
              grpc.StatusCode.FAILED_PRECONDITION: 409}
# chunks buffered per streaming response: a slow reader back-pressures the engines instead of growing memory
STREAM_BUFFER_CHUNKS = 64


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


class _AdmittedStream(StreamingResponse):
    """Gives the admission slots back when the response ends, even when the client went away before
    the body generator ever started (its `finally` would then never run)."""

    def __init__(self, content, release):
        super().__init__(content, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class RouterAPI(ExtraEndpoints):
    def __init__(self, flow: Flow, limits: Limits, model_name: str | list[str], metrics, *,
                 keys: ApiKeys | None = None, admission: Admission | None = None, max_body_bytes: int = 32 << 20,
                 chat: ChatSettings | None = None, generation_defaults: dict | None = None):
        """`model_name`: the served name, or several (the first is the one responses carry)."""
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.flow, self.limits, self.model_name, self.metrics = flow, limits, self.model_names[0], metrics
        self.chat = chat or ChatSettings(None)
        self.generation_defaults = dict(generation_defaults or {})
        self.tok = flow.tokenizer
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission("router", 1024)
        self.max_body_bytes = max_body_bytes

    error = staticmethod(exception_response)

    # ---- plumbing --------------------------------------------------------------------------------
    def build(self) -> FastAPI:
        app = FastAPI(title="pdserve router", version="1.0",
                      description="OpenAI-compatible API of a disaggregated prefill/decode deployment.")
        app.router.route_class = StrictJSONRoute  # NaN, Infinity, duplicate keys, deep nesting -> 400
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_middleware(Guard, keys=self.keys, max_body_bytes=self.max_body_bytes)
        app.add_middleware(RequestIdHeader)
        app.get("/health")(self.health)
        app.get("/version")(self.version)
        app.get("/v1/models")(self.models)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/metrics", include_in_schema=False)(self.prometheus)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        mount_anthropic(app, self)
        return app

    async def _validation_error(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}",
                              param=where or None)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    def _check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            served = ", ".join(map(repr, self.model_names))
            raise BadRequest(f"model {model!r} does not exist; this server serves {served}", "model",
                             code="model_not_found")

    def _request_id(self, prefix: str, request: Request) -> str:
        req_id = new_api_request_id(prefix, request.state.client_request_id)
        log.info("%s: %s %s", req_id, request.method, request.url.path)
        return req_id

    # ---- endpoints -------------------------------------------------------------------------------
    async def health(self) -> dict:
        return {"status": "ok", "redis": self.flow.routing.redis_ok}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "root": self.model_name, "max_model_len": self.limits.max_model_len,
                                            "vocab_size": self.limits.vocab_size} for name in self.model_names]}

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request):
        try:
            self._check_model(body.model)
            check_extra_fields(body)
            apply_generation_defaults(body, self.generation_defaults)
            prep = prepare_completion(body, self.tok, self.limits)
            prep.cache_salt = tenant_cache_salt(request.state.tenant, prep.cache_salt)
            fmt = Formatter("text", self._request_id("cmpl", request), self.model_name, self.tok)
            return await self._respond(fmt, prep, 0)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return exception_response(exc)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            self._check_model(body.model)
            check_extra_fields(body)
            apply_generation_defaults(body, self.generation_defaults)
            plan = prepare_chat_request(body, self.chat)
            prep = prepare_chat(body, self.tok, self.limits, plan.prompt)
            if plan.forced is not None:
                if prep.params.structured_outputs is not None:
                    raise BadRequest("a required or named tool_choice cannot be combined with another structured "
                                     "output (response_format, structured_outputs)", "tool_choice")
                prep.params = dataclasses.replace(prep.params, structured_outputs=plan.forced)
            prep.cache_salt = tenant_cache_salt(request.state.tenant, prep.cache_salt)
            fmt = Formatter("chat", self._request_id("chatcmpl", request), self.model_name, self.tok)
            return await self._respond(fmt, prep, body.top_logprobs or 0, plan.output)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return exception_response(exc)

    # ---- running the choices -------------------------------------------------------------------------
    def _jobs(self, prep: Prepared) -> list[tuple[int, list[int], object]]:
        jobs = []
        for p, ids in enumerate(prep.prompts):
            for i in range(prep.n):
                params = prep.params
                if i and params.seed is not None:  # n seeded samples must differ from each other
                    params = type(params)(**{**params.__dict__, "seed": seed_for_sample(params.seed, i)})
                jobs.append((p * prep.n + i, ids, params))
        return jobs

    async def _respond(self, fmt: Formatter, prep: Prepared, top_n: int, out: OutputOptions | None = None):
        jobs = self._jobs(prep)
        out = out if out is not None and not out.plain else None
        self.admission.acquire(len(jobs))  # Overloaded -> 429 + Retry-After; released when the response ends
        if prep.stream:
            return _AdmittedStream(self._stream(fmt, prep, jobs, top_n, out), lambda: self.admission.release(len(jobs)))
        try:
            results = await asyncio.gather(*[self._collect(fmt, prep, job, top_n, out) for job in jobs])
        finally:
            self.admission.release(len(jobs))
        choices = [r[0] for r in results]
        u = usage(sum(len(prep.prompts[j[0] // prep.n]) for j in jobs if j[0] % prep.n == 0),
                  sum(r[1].completion_tokens for r in results), sum(r[1].cached_tokens for r in results))
        return fmt.full(choices, u)

    def _logprobs(self, fmt: Formatter, ids, lps, offset: int, top_n: int):
        return fmt.chat_logprobs(ids, lps, top_n) if fmt.kind == "chat" else fmt.completion_logprobs(ids, lps, offset)

    async def _collect(self, fmt: Formatter, prep: Prepared, job, top_n: int, out: OutputOptions | None):
        index, ids, params = job
        stats = RequestStats(f"{fmt.req_id}-{index}", len(ids))
        text, tokens, lps, finish, stop = "", [], [] if params.logprobs is not None else None, None, None
        async for c in self.flow.generate(ids, params, stats, prep.cache_salt):
            text += c.text
            tokens += c.token_ids
            if lps is not None and c.logprobs:
                lps += c.logprobs
            finish, stop = c.finish_reason or finish, c.stop_reason if c.finish_reason else stop
        choice = fmt.full_choice(index, text, self._logprobs(fmt, tokens, lps, 0, top_n), finish, stop,
                                 tokens if prep.return_token_ids else None)
        if out is not None:  # reasoning and tool calls split out of the text
            parser = ChoiceParser(out)
            choice["message"] = openai_message(parser.feed(text) + parser.finish())
            choice["finish_reason"] = parser.finish_reason(finish)
        return choice, stats

    async def _stream(self, fmt: Formatter, prep: Prepared, jobs, top_n: int, out: OutputOptions | None):
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_BUFFER_CHUNKS)
        all_stats: list[RequestStats] = []

        async def pump(job) -> None:
            index, ids, params = job
            stats = RequestStats(f"{fmt.req_id}-{index}", len(ids))
            all_stats.append(stats)
            parser = ChoiceParser(out) if out is not None else None
            try:
                offset, first = 0, True
                async for c in self.flow.generate(ids, params, stats, prep.cache_salt):
                    lp = self._logprobs(fmt, c.token_ids, c.logprobs, offset, top_n) if c.logprobs else None
                    chunk = fmt.chunk(index, c.text, lp, c.finish_reason, c.stop_reason, first,
                                      c.token_ids if prep.return_token_ids else None)
                    if parser is not None:
                        events = parser.feed(c.text) + (parser.finish() if c.finish_reason else [])
                        choice = chunk["choices"][0]
                        delta = openai_delta(events)
                        choice["delta"] = {"role": "assistant", **delta} if first else delta
                        choice["finish_reason"] = parser.finish_reason(c.finish_reason)
                    await queue.put((chunk, c.received))
                    offset, first = offset + len(c.text), False
                await queue.put(None)
            except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(j)) for j in jobs]
        try:
            done = 0
            while done < len(jobs):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    resp = exception_response(item)
                    yield sse(resp.body.decode())
                    break
                else:
                    chunk, received = item
                    yield sse(chunk)
                    if received is not None:  # resumed once the server wrote the event
                        self.metrics.token_delta_delay_seconds.observe(time.monotonic() - received)
            else:
                if prep.include_usage:
                    yield sse(fmt.usage_chunk(usage(sum(s.prompt_tokens for s in all_stats) // max(prep.n, 1),
                                                    sum(s.completion_tokens for s in all_stats),
                                                    sum(s.cached_tokens for s in all_stats) // max(prep.n, 1))))
            yield sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
