"""Streaming client for an OpenAI-compatible `/v1/completions` (token-id prompts, SSE chunks).

One call -> one RequestRecord with wall-clock timestamps (time.perf_counter):

    t_start ──prefill──▶ t_first ──decode (chunk arrivals: itl_s)──▶ t_end

Output tokens come from the final `usage` chunk when the server sends one, else one per chunk. With
`token_ids=True` the request asks for `return_token_ids` and the record keeps the streamed ids in order.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REQUEST_TIMEOUT_S = 6 * 3600  # a 1M-token prefill on a loaded server can take minutes; never hours
BIG_BODY_TOKENS = 32_768  # encode larger bodies off the event loop so other streams keep their timing


@dataclass
class RequestRecord:
    """What happened to one request; times are perf_counter seconds (0 when it never happened)."""

    prompt_len: int
    max_tokens: int
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported in usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    overflow: bool = False  # not sent: prompt + max_tokens exceed --max-context
    cancelled: bool = False  # cut off by the end of the run (not an error)
    measured: bool = True  # started inside the measurement window (after warm-up)
    session: str = ""  # "<trace id>#<copy>" of the session copy that sent it
    depth: int = 0  # 0 for the main agent, 1 for a subagent, ...
    token_ids: list[int] | None = None  # the streamed output ids, when asked for (return_token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.overflow and not self.cancelled

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.t_start

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len


def completion_payload(model: str, prompt: list[int], max_tokens: int, token_ids: bool = False) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True
    return body


def make_session(limit: int = 0) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=30)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


async def stream_completion(http: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int],
                            max_tokens: int, record: RequestRecord | None = None,
                            token_ids: bool = False) -> RequestRecord:
    """POST one streaming completion and time it; failures land in `record.error`, never raise."""
    rec = record or RequestRecord(prompt_len=len(prompt), max_tokens=max_tokens)
    if token_ids:
        rec.token_ids = []
    payload = completion_payload(model, prompt, max_tokens, token_ids)
    if len(prompt) > BIG_BODY_TOKENS:
        body = await asyncio.to_thread(json.dumps, payload)
    else:
        body = json.dumps(payload)
    rec.t_start = time.perf_counter()  # after encoding: TTFT measures the server, not this client
    try:
        async with http.post(base_url.rstrip("/") + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return rec
            await _read_stream(resp, rec)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is None and rec.t_first == 0.0:
        rec.error = "stream ended without any token"
    rec.t_end = time.perf_counter()
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
    num_chunks = 0
    last = rec.t_start
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            rec.error = f"stream error: {_error_message(data)}"
            return
        now = time.perf_counter()
        if chunk.get("choices"):
            if rec.token_ids is not None:
                rec.token_ids += chunk["choices"][0].get("token_ids") or []
            if num_chunks == 0:
                rec.t_first = now
            else:
                rec.itl_s.append(now - last)
            last = now
            num_chunks += 1
        usage = chunk.get("usage")
        if usage:
            _apply_usage(rec, usage)
    if rec.output_tokens == 0:
        rec.output_tokens = num_chunks


def _apply_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err) if err else body[:300]
    except (json.JSONDecodeError, AttributeError):
        return body[:300]


async def server_info(http: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """`GET /v1/models` -> {"model", "max_model_len", "vocab_size"} (None where not reported)."""
    async with http.get(base_url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"GET {base_url}/v1/models answered HTTP {resp.status}: is this an OpenAI server?")
        body = await resp.json()
    models = body.get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    first = models[0]
    return {"model": first.get("id"), "max_model_len": first.get("max_model_len"),
            "vocab_size": first.get("vocab_size")}
