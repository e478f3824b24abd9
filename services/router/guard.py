"""What the router checks before it parses a request: the API key (which names the tenant) and the
body size. A pure ASGI middleware, so an oversized or unauthenticated body is never read in full.

/tokenize and /detokenize need the key as /v1/* does. API keys are `key` (the key is its own tenant) or
`key:tenant` (several keys share one tenant), from `--api-key` (repeatable), `--api-keys-file` (one entry a
line, `#` comments) or `PDSERVE_API_KEY`.
The key comes as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic
clients); on the Anthropic routes (/v1/messages...) the 401 and 413 bodies are in Anthropic's error form.
/health, /metrics, /docs and /openapi.json stay open: probes and scrapers carry no secret, and they
reveal no request data. Every key is compared in constant time (hmac.compare_digest), all of them,
so timing tells neither whether a prefix matched nor which key did.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from services.router.anthropic.errors import error_body as anthropic_error_body
from services.router.openai_models import error_body
from services.rpc.grpc_server import Unauthenticated

PROTECTED_PREFIX = "/v1/"
ANTHROPIC_PREFIX = "/v1/messages"
PROTECTED_PATHS = frozenset(("/tokenize", "/detokenize"))  # vLLM serves these outside /v1


class ApiKeys:
    """key -> tenant; empty means authentication is off (every request is tenant None)."""

    def __init__(self, entries: Iterable[str] = ()):
        self._keys: list[tuple[bytes, str]] = []
        for entry in entries:
            key, sep, tenant = entry.strip().partition(":")
            if not key:
                raise ValueError("an API key entry is empty (expected `key` or `key:tenant`)")
            # a bare key is its own tenant; the tenant name is derived so the key never reaches logs or Redis
            self._keys.append((key.encode(), tenant if sep and tenant else _anonymous_tenant(key)))

    @classmethod
    def from_sources(cls, keys: Sequence[str] = (), keys_file: str | None = None) -> ApiKeys:
        entries = list(keys)
        if keys_file:
            for line in Path(keys_file).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    entries.append(line)
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` value, else of an `x-api-key` value;
        Unauthenticated if it matches no key."""
        if not self._keys:
            return None
        given = authorization or ""
        token = given[7:].strip().encode() if given[:7].lower() == "bearer " else (api_key or "").strip().encode()
        found = None
        for key, tenant in self._keys:  # no early exit: constant time in which key matched
            if hmac.compare_digest(token, key):
                found = tenant
        if found is None:
            how = "send `Authorization: Bearer <key>` or `x-api-key: <key>`"
            raise Unauthenticated(f"missing or wrong API key: {how}" if token
                                  else f"this server needs an API key: {how}")
        return found


def _anonymous_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_cache_salt(tenant: str | None, request_salt: str | None) -> str | None:
    """The cache salt a request runs with. With tenants, the salt always starts with the tenant, so
    one tenant's prefix blocks never hash-match another's whatever `cache_salt` a client sends."""
    if tenant is None:
        return request_salt
    return f"tenant:{tenant}" + (f"|{request_salt}" if request_salt else "")


class Guard:
    """ASGI middleware: 401 without a valid key on /v1/*, 413 for a body over `max_body_bytes`
    (by Content-Length, or counted as it arrives when the body is chunked). Sets
    `scope["state"]["tenant"]` for the endpoints."""

    def __init__(self, app, keys: ApiKeys, max_body_bytes: int):
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scope.setdefault("state", {})["tenant"] = None
        if scope["path"].startswith(PROTECTED_PREFIX) or scope["path"] in PROTECTED_PATHS:
            try:
                scope["state"]["tenant"] = self.keys.tenant(headers.get("authorization"), headers.get("x-api-key"))
            except Unauthenticated as exc:
                return await _reply(scope, send, 401, str(exc), "authentication_error", {"www-authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body_bytes:
                return await _reply(scope, send, 413, f"request body over {self.max_body_bytes} bytes")
            return await self.app(scope, receive, send)
        return await self._chunked(scope, receive, send)

    async def _chunked(self, scope, receive, send):
        """No Content-Length: read up to the limit, then hand the buffered messages to the app."""
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_body_bytes:
                return await _reply(scope, send, 413, f"request body over {self.max_body_bytes} bytes")
            if not msg.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


async def _reply(scope, send, status: int, message: str, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
    if scope["path"].startswith(ANTHROPIC_PREFIX):
        body = json.dumps(anthropic_error_body("request_too_large" if status == 413 else type_, message)).encode()
    else:
        body = json.dumps(error_body(message, type_, status)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
