"""The router's OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE; tools,
tool calls and reasoning: chat_request.py, chat_output.py), /v1/models, /tokenize, /detokenize,
/version, /health, /metrics. Errors are `{"error": {"message", "type", "param", "code"}}` (errors.py).

A request is a body parsed as strict JSON (strict_json.py), made into engine work by prepare.py (validate,
render the chat template, build SamplingParams), then run here: n choices per prompt through the flow
(flow.py), collected into one response or streamed as SSE. The Anthropic Messages API (/v1/messages) and
OpenAI's Responses API (/v1/responses) are mounted beside them from services/router/anthropic/ and
services/router/responses_api/, and run their prepared requests through `respond`."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.anthropic.endpoint import mount as mount_anthropic
from services.router.chat_output import ChoiceParser, OutputOptions, openai_delta, openai_message
from services.router.chat_request import ChatSettings
from services.router.errors import error_response, exception_response
from services.router.extra_api import ExtraEndpoints, RequestIdHeader, new_api_request_id
from services.router.flow import Flow, RequestStats
from services.router.guard import ApiKeys, Guard
from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.prepare import ServedModel, check_model, prepare_chat, prepare_completion
from services.router.requests import Limits, Prepared
from services.router.responses import Formatter, sse, usage
from services.router.responses_api.endpoint import mount as mount_responses
from services.router.responses_api.store import DEFAULT_TTL_S
from services.router.strict_json import StrictJSONRoute
from services.rpc.admission import Admission
from services.rpc.bounds import seed_for_sample

log = logging.getLogger(__name__)

# chunks buffered per streaming response: a slow reader back-pressures the engines instead of growing memory
STREAM_BUFFER_CHUNKS = 64
_ID_PREFIX = {"chat": "chatcmpl", "text": "cmpl"}


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
                 chat: ChatSettings | None = None, generation_defaults: dict | None = None,
                 responses_ttl_s: float = DEFAULT_TTL_S):
        """`model_name`: the served name, or several (the first is the one responses carry);
        `responses_ttl_s`: how long /v1/responses keeps a stored response."""
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.served = ServedModel(names, flow.tokenizer, limits, chat or ChatSettings(None),
                                  dict(generation_defaults or {}))
        self.flow, self.metrics = flow, metrics
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission("router", 1024)
        self.max_body_bytes = max_body_bytes
        self.responses_ttl_s = responses_ttl_s
        self.draining = False

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
        mount_responses(app, self)
        return app

    async def _validation_error(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}",
                              param=where or None)

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    def _check_model(self, model: str | None) -> None:
        check_model(model, self.served.names)

    def _request_id(self, prefix: str, request: Request) -> str:
        req_id = new_api_request_id(prefix, request.state.client_request_id)
        log.info("%s: %s %s", req_id, request.method, request.url.path)
        return req_id

    # ---- endpoints -------------------------------------------------------------------------------
    async def health(self):
        """200 while serving; 503 once draining (SIGTERM), so a load balancer's readiness check stops sending
        new requests here while the streams in flight finish."""
        if self.draining:
            return JSONResponse({"status": "draining", "redis": self.flow.routing.redis_ok}, status_code=503)
        return {"status": "ok", "redis": self.flow.routing.redis_ok}

    async def models(self) -> dict:
        limits = self.served.limits
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "root": self.served.names[0], "max_model_len": limits.max_model_len,
                                            "vocab_size": limits.vocab_size} for name in self.served.names]}

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request):
        try:
            return await self.respond(prepare_completion(body, self.served, request.state.tenant), "text", request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return exception_response(exc)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            return await self.respond(prepare_chat(body, self.served, request.state.tenant), "chat", request)
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

    async def respond(self, prep: Prepared, kind: str, request: Request):
        """Run a prepared request's choices: the response body (a dict) or, streaming, its SSE response.
        `kind`: "chat" or "text" (completions). Failures raise; the caller answers them in its API's form."""
        fmt = Formatter(kind, self._request_id(_ID_PREFIX[kind], request), self.served.names[0], self.served.tok)
        jobs = self._jobs(prep)
        top_n = prep.top_logprobs
        out = prep.output if prep.output is not None and not prep.output.plain else None
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
