"""The two-phase flow behind every router request:

    tokens -> block hashes -> pick prefill (cached prefix + load) -> Prefill RPC -> first token
           -> pick decode (load) -> Decode.Generate stream (it pulls the KV over NIXL) -> tokens
Text is detokenized here (stop strings held back exactly as the engine does). A client that goes
away cancels the in-flight RPC, which aborts the request on that engine and frees its blocks.

Deadlines: every request has one overall deadline (`request_timeout_s` from arrival); the Prefill call
is also capped at `prefill_timeout_s`, and the decode stream must deliver something at least every
`idle_timeout_s`. Past any of them the call is cancelled and the client gets an error (an SSE error
event when streaming), never a hang. A transport-level failure (see `_TRANSPORT`) marks the instance
unhealthy in routing at once; a request that ends without finishing releases its prefill lease.

Overload: an instance at capacity (RESOURCE_EXHAUSTED, before doing any work) is skipped for another one
of its role; when every one is full the request fails with `Overloaded` (HTTP 429 / RESOURCE_EXHAUSTED,
with retry-after).

Migration: a decode that fails under a request (its stream breaks, it ends without finishing, it goes
silent past the idle timeout, it refuses the request because it is draining) does not end the client's
stream. The request starts again on another instance as the prompt plus every token already streamed
(`GenerateRequest.output_token_ids`: outputs, so max_tokens, penalties and a grammar count them as such),
through prefill, whose prefix cache and the kvstore make that cheap; the client's stream goes on with the
next token, none repeated or missing (greedy decoding continues token for token as it would have).
A prefill that fails before its first token is retried on another. At most `max_migrations` per request,
then an error event. The detokenizer and the usage figures are the request's own, across attempts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from engine.core.sampling_params import SamplingParams
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.tokenizer import Tokenizer
from engine.kv.hashing import block_hashes
from proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.router.routing import NoInstance, Routing
from services.rpc.convert import finish_from_proto, logprobs_from_proto, sampling_to_proto
from services.rpc.grpc_server import Overloaded, channel, retry_after_s
from services.rpc.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """An engine failed mid-request; the client gets an error event (never a silent hang)."""


class Migrate(UpstreamError):
    """The decode instance under a request failed or went away: the request can continue elsewhere."""


# Codes that say "this instance is gone, stopped or wedged" rather than "this request was refused".
_TRANSPORT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL)


class _Busy(Exception):
    """One instance answered RESOURCE_EXHAUSTED before doing any work: try another."""

    def __init__(self, instance_id: str, retry_after: float):
        super().__init__(instance_id)
        self.instance_id, self.retry_after = instance_id, retry_after


class _Gone(_Busy):
    """One instance refused the request UNAVAILABLE before doing any work (draining, stopping): try another;
    when none is left, the role has no instance (503), not a full one (429)."""


async def _on_any(role: str, pick, attempt):
    """Run `attempt(instance)` on instances of `role` until one is not busy; Overloaded when all are.
    `pick(exclude)` returns the next instance; `attempt` raises _Busy to move on."""
    tried: set[str] = set()
    busy = 0  # of those tried, the ones that were full (the others were gone)
    retry_after = 1.0
    while True:
        try:
            inst = await pick(frozenset(tried))
        except NoInstance:
            if not busy:
                raise
            raise Overloaded(f"every {role} instance is at capacity ({len(tried)} tried); retry shortly",
                             retry_after) from None
        try:
            return await attempt(inst)
        except _Busy as refused:
            tried.add(refused.instance_id)
            if not isinstance(refused, _Gone):
                retry_after = min(retry_after, refused.retry_after) if busy else refused.retry_after
                busy += 1


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    received: float | None = None  # decode chunks: when their gRPC message was read (monotonic)


@dataclass
class RequestStats:
    req_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    prefill_instance: str = ""
    decode_instance: str = ""


class Flow:
    def __init__(self, routing: Routing, tokenizer: Tokenizer, metrics: ServiceMetrics, *, block_size: int = 64,
                 prefill_timeout_s: float = 600.0, request_timeout_s: float = 3600.0, idle_timeout_s: float = 120.0,
                 lease_ms: int = 0, max_migrations: int = 3):
        self.routing, self.tokenizer, self.metrics = routing, tokenizer, metrics
        self.block_size = block_size
        self.prefill_timeout_s, self.request_timeout_s = prefill_timeout_s, request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.lease_ms = lease_ms
        self.max_migrations = max_migrations
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_running = 0

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return ch

    async def close(self) -> None:
        await self.routing.close()
        for ch in self._channels.values():
            await ch.close()

    async def generate(self, ids: list[int], params: SamplingParams, stats: RequestStats,
                       cache_salt: str | None = None) -> AsyncIterator[Chunk]:
        self.num_running += 1
        self.metrics.num_requests_running.set(self.num_running)
        detok = IncrementalDetokenizer(self.tokenizer, params)
        try:
            async for chunk in self._phases(ids, params, stats, cache_salt, detok):
                yield chunk
        finally:
            self.num_running -= 1
            self.metrics.num_requests_running.set(self.num_running)

    async def _phases(self, ids, params, stats, cache_salt, detok) -> AsyncIterator[Chunk]:
        g = common_pb2.GenerateRequest(request_id=stats.req_id, prompt_token_ids=ids,
                                       sampling_params=sampling_to_proto(params), cache_salt=cache_salt or "")
        emitted: list[int] = []  # every token the client has been sent
        failed: Migrate | None = None  # why the last attempt ended, while migrating
        for attempt in range(self.max_migrations + 1):
            try:
                async for chunk in self._attempt(g, params, emitted, stats, cache_salt, detok, attempt):
                    emitted.extend(chunk.token_ids)
                    yield chunk
                return
            except Migrate as exc:
                if attempt == self.max_migrations:
                    raise UpstreamError(f"{exc} (gave up after {self.max_migrations} migrations)") from exc
                failed = exc
                self.metrics.request_migrations.inc()
                log.warning("%s: %s; migrating with %d tokens streamed (%d of at most %d)", stats.req_id, exc,
                            len(emitted), attempt + 1, self.max_migrations)
            except NoInstance as exc:
                if failed is None:
                    raise
                raise UpstreamError(f"{failed}; no instance to move the request to: {exc}") from exc

    async def _attempt(self, g, params, emitted: list[int], stats, cache_salt, detok,
                       attempt: int) -> AsyncIterator[Chunk]:
        """Prefill, then decode, of the request as it stands: its prompt and the tokens already `emitted`.
        Each attempt has an engine request id of its own: the one before may still hold its id somewhere
        (a prefill lease not yet released, a decode still aborting it)."""
        del g.output_token_ids[:]
        g.output_token_ids.extend(emitted)
        g.request_id = f"{stats.req_id}.m{attempt}" if attempt else stats.req_id
        hashes = block_hashes(list(g.prompt_token_ids) + emitted, self.block_size, cache_salt)
        if params.max_tokens - len(emitted) > 1:  # it will need a decode: none healthy -> 503 before any prefill
            await self.routing.require("decode")
        first = await self._prefill(g, hashes, stats)
        yield self._chunk(first.first, detok, stats)
        if finish_from_proto(first.first.finish_reason) is not None or not first.HasField("kv"):
            return
        async for chunk in self._decode(g, first, stats, detok):
            yield chunk

    async def _prefill(self, g, hashes: list[bytes], stats: RequestStats) -> prefill_pb2.PrefillResponse:
        """Retried on another instance when the chosen one is unreachable, draining or dies before its first
        token (nothing reached the client yet), up to `max_migrations` times."""
        for attempt in range(self.max_migrations + 1):
            try:
                reply = await self._prefill_once(g, hashes, stats)
                break
            except grpc.aio.AioRpcError as exc:
                if (attempt == self.max_migrations or exc.code() != grpc.StatusCode.UNAVAILABLE
                        or not self.routing.has_live("prefill")):
                    raise
                log.warning("prefill %s unavailable (%s); trying another", stats.prefill_instance, exc.details())
        if not g.output_token_ids:  # the request's own figures (a migration's re-prefill is not the client's)
            stats.cached_tokens = reply.usage.cached_tokens
        self.metrics.prefix_cache_queries.inc(len(g.prompt_token_ids) + len(g.output_token_ids))
        self.metrics.prefix_cache_hits.inc(reply.usage.cached_tokens)
        return reply

    async def _prefill_once(self, g, hashes: list[bytes], stats: RequestStats) -> prefill_pb2.PrefillResponse:
        return await _on_any("prefill", lambda skip: self.routing.pick_prefill(hashes, len(g.prompt_token_ids), skip),
                             lambda choice: self._prefill_on(choice, g, hashes, stats))

    async def _prefill_on(self, choice, g, hashes: list[bytes], stats: RequestStats) -> prefill_pb2.PrefillResponse:
        inst = choice.instance
        stats.prefill_instance = inst.instance_id
        req = prefill_pb2.PrefillRequest(request=g, block_hashes=hashes, lease_ms=self.lease_ms)
        if choice.kvstore is not None:
            req.kvstore.CopyFrom(prefill_pb2.KVStoreHint(instance_id=choice.kvstore.instance_id,
                                                         grpc_address=choice.kvstore.grpc_address,
                                                         num_blocks=choice.kvstore_blocks))
        stub = prefill_pb2_grpc.PrefillStub(self._channel(inst.grpc_address))
        self.routing.started(inst.instance_id)
        try:
            return await stub.Prefill(req, timeout=min(self.prefill_timeout_s, self._left(stats)))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _Busy(inst.instance_id, retry_after_s(exc)) from exc
            if exc.code() in _TRANSPORT:
                self.routing.mark_unhealthy(inst)
            raise
        finally:
            self.routing.finished(inst.instance_id)

    def _left(self, stats: RequestStats) -> float:
        """Seconds left before the request's overall deadline (the gRPC calls' timeouts)."""
        return max(stats.arrival + self.request_timeout_s - time.monotonic(), 0.001)

    async def _decode(self, g, first, stats: RequestStats, detok) -> AsyncIterator[Chunk]:
        try:
            inst, call, reply = await _on_any("decode", self.routing.pick_decode,
                                              lambda inst: self._open_decode(inst, g, first, stats))
        except BaseException:  # no decode took it (all full, failed, or the client left): free the KV now
            await self._release_lease(first.kv)
            raise
        stats.decode_instance = inst.instance_id
        finished, received = False, time.monotonic()
        try:
            while not finished:
                if reply is None:
                    reply = await self._next(call, inst, stats)
                    received = time.monotonic()
                if reply is grpc.aio.EOF:
                    raise Migrate(f"decode {inst.instance_id} ended the stream without finishing")
                chunk = self._chunk(reply.delta, detok, stats)
                chunk.received = received
                reply = None
                finished = chunk.finish_reason is not None
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise self._decode_failed(inst, exc, stats) from exc
        finally:
            self.routing.finished(inst.instance_id)
            if not call.done():
                call.cancel()  # client went away, or we stopped early: abort there, free the blocks
            if not finished:
                await self._release_lease(first.kv)

    async def _open_decode(self, inst, g, first, stats: RequestStats):
        """Start Decode.Generate on `inst` and wait for its first reply: a full instance answers
        RESOURCE_EXHAUSTED before pulling any KV, so the prefill lease stays valid for the next one."""
        stub = decode_pb2_grpc.DecodeStub(self._channel(inst.grpc_address))
        # instance_id: the DP ranks of a decode group share its address; the id says which rank takes it
        call = stub.Generate(decode_pb2.DecodeRequest(request=g, kv=first.kv, first=first.first,
                                                      instance_id=inst.instance_id), timeout=self._left(stats))
        self.routing.started(inst.instance_id)
        try:
            return inst, call, await self._next(call, inst, stats)
        except BaseException as exc:
            self.routing.finished(inst.instance_id)
            call.cancel()
            if isinstance(exc, grpc.aio.AioRpcError):
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise _Busy(inst.instance_id, retry_after_s(exc)) from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE:  # draining or gone: the same KV, another decode
                    self.routing.mark_unhealthy(inst)
                    raise _Gone(inst.instance_id, 0.0) from exc
                raise self._decode_failed(inst, exc, stats) from exc
            raise

    def _decode_failed(self, inst, exc: grpc.aio.AioRpcError, stats: RequestStats) -> UpstreamError:
        """A decode failing under a request: gone, stopped, draining or wedged (a transport code) -> Migrate;
        a refusal of the request itself (INVALID_ARGUMENT, ...), or its own deadline passing, ends it."""
        message = f"decode {inst.instance_id} failed: {exc.code().name}: {exc.details()}"
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._left(stats) <= 0.001:
            return UpstreamError(f"request deadline ({self.request_timeout_s:.0f}s) passed")
        if exc.code() in _TRANSPORT or exc.code() == grpc.StatusCode.CANCELLED:
            self.routing.mark_unhealthy(inst)
            return Migrate(message)
        return UpstreamError(message)

    async def _next(self, call, inst, stats: RequestStats):
        """The next message, or UpstreamError when the decode stays silent past the idle timeout."""
        wait = min(self.idle_timeout_s, self._left(stats))
        try:
            async with asyncio.timeout(wait):  # not wait_for: it can swallow a cancellation (Python 3.11)
                return await call.read()
        except TimeoutError:
            if wait == self.idle_timeout_s:
                self.routing.mark_unhealthy(inst)  # a stopped or wedged decode
                raise Migrate(f"decode {inst.instance_id} sent nothing for {wait:.1f}s") from None
            raise UpstreamError(f"request deadline ({self.request_timeout_s:.0f}s) passed") from None

    async def _release_lease(self, kv) -> None:
        """Best effort: decode may never have pulled; do not leave the KV pinned until the lease expires."""
        if not kv.prefill_grpc_address or not kv.lease_id:
            return
        try:
            stub = prefill_pb2_grpc.PrefillStub(self._channel(kv.prefill_grpc_address))
            await asyncio.shield(stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=kv.lease_id), timeout=2.0))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    def _chunk(self, delta: common_pb2.TokenDelta, detok: IncrementalDetokenizer, stats: RequestStats) -> Chunk:
        ids = list(delta.token_ids)
        if ids and stats.first_token is None:
            stats.first_token = time.monotonic()
            self.metrics.time_to_first_token_seconds.observe(stats.first_token - stats.arrival)
        stats.completion_tokens += len(ids)
        finish = finish_from_proto(delta.finish_reason)
        text = detok.update(ids)
        stop_token = delta.stop_token_id if delta.HasField("stop_token_id") else None
        stop_reason: int | str | None = delta.stop_reason or stop_token
        if detok.stop_hit is not None:
            finish, stop_reason = "stop", detok.stop_hit
        if finish is not None:
            text += detok.flush()
            self._observe_end(stats)
        return Chunk(ids, text, logprobs_from_proto(delta.logprobs), finish, stop_reason)

    def _observe_end(self, stats: RequestStats) -> None:
        now = time.monotonic()
        self.metrics.e2e_request_latency_seconds.observe(now - stats.arrival)
        if stats.first_token is not None and stats.completion_tokens > 1:
            tpot = (now - stats.first_token) / (stats.completion_tokens - 1)
            self.metrics.time_per_output_token_seconds.observe(tpot)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
