"""The asyncio gRPC server every pdserve service runs, and the error mapping of its handlers.

    server = GrpcServer(port=50060)
    server.add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer, "pdserve.v1.KVStore")
    port = await server.start()          # health NOT_SERVING until the service is ready
    await server.set_serving(True)
    await drain.wait_for_signal()        # SIGTERM/SIGINT (services/rpc/drain.py: then drain, then stop)
    await server.stop(grace=5.0)         # health NOT_SERVING, in-flight RPCs get `grace` seconds

Every server registers standard gRPC health checking (grpc.health.v1.Health) and reflection, so
`grpcurl -plaintext host:port list` and Kubernetes/compose health probes work unchanged.
Handlers raise plain exceptions; `@grpc_errors` turns them into status codes with the reason.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine import settings
from services.rpc.grpc_parse import parse_checked
from services.rpc.net import PORT_IN_USE_EXIT, PortInUse, bind_listener

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # a 1M-token prompt as token ids is ~5 MB; KV bytes never travel in gRPC


RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED: when to try this instance again


class Overloaded(Exception):
    """The service is at capacity; the client should retry elsewhere or later (RESOURCE_EXHAUSTED,
    with `retry-after-ms` in the trailing metadata)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthenticated(Exception):
    """Missing or wrong credentials (UNAUTHENTICATED)."""


class NotFound(Exception):
    """A named object (request, lease, reservation) does not exist (NOT_FOUND)."""


class FailedPrecondition(Exception):
    """The object exists but is in the wrong state, e.g. an expired lease (FAILED_PRECONDITION)."""


class Unavailable(Exception):
    """A dependency (peer, Redis) cannot be reached right now (UNAVAILABLE)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
)


# Details travel in the grpc-message trailer; past gRPC's metadata limit (8 KiB) the client would see
# RESOURCE_EXHAUSTED instead of the real status (a handler that quotes a huge bad argument back).
MAX_DETAILS_CHARS = 1024


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details (at most MAX_DETAILS_CHARS) for an exception raised by a handler."""
    code, details = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    for cls, c in _CODES:
        if isinstance(exc, cls):
            code, details = c, str(exc) or cls.__name__
            break
    param = getattr(exc, "param", None)  # bounds.InvalidArgument: the details name the field
    if param and not details.startswith(param):
        details = f"{param}: {details}"
    if len(details) > MAX_DETAILS_CHARS:
        details = details[: MAX_DETAILS_CHARS - 15] + " ...[truncated]"
    return code, details


def grpc_errors(fn: Callable) -> Callable:
    """Decorate a servicer method (unary coroutine or server-streaming async generator) so that
    exceptions become `context.abort(code, reason)`; unexpected ones are logged with a traceback."""

    async def _abort(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        code, details = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", fn.__qualname__, exc_info=exc)
        if isinstance(exc, Overloaded):
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(exc.retry_after_s * 1000))),))
        await context.abort(code, details)

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a gRPC status (mapped by _abort)
                await _abort(exc, context)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a gRPC status (mapped by _abort)
            await _abort(exc, context)
    return unary


class GrpcServer:
    """A grpc.aio server with health checking and reflection; one per service process."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *,
                 options: list[tuple[str, Any]] | None = None):
        opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0)]  # two services must never silently share a port
        self.host, self.port = host, port
        self.server = grpc.aio.server(options=opts + list(options or []))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self._bound = False

    def add_service(self, add_to_server: Callable[[Any, Any], None], servicer: Any, name: str) -> None:
        """`add_to_server` is the generated `add_<Svc>Servicer_to_server`; `name` e.g. 'pdserve.v1.KVStore'."""
        add_to_server(servicer, parse_checked(self.server))  # corrupt bytes -> INVALID_ARGUMENT
        self.service_names.append(name)

    def bind(self) -> int:
        """Bind the port now (before services are added, to learn an auto-picked port); idempotent."""
        if not self._bound:
            try:
                port = self.server.add_insecure_port(f"{self.host}:{self.port}")
            except RuntimeError as exc:  # grpc's way of saying the bind failed, whatever the cause: ask the OS
                bind_listener(self.host, self.port, "gRPC").close()  # raises PortInUse when it is taken
                raise OSError(f"could not bind gRPC port {self.host}:{self.port}: {exc}") from exc
            self.port, self._bound = port, True
        return self.port

    async def start(self) -> int:
        """Bind (if not yet) and start; returns the port. Health is NOT_SERVING until set_serving(True)."""
        self.bind()
        reflection.enable_server_reflection(
            self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.set_serving(False)
        await self.server.start()
        log.info("gRPC %s listening on %s:%d", ",".join(self.service_names) or "-", self.host, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING first (balancers stop sending), then let in-flight RPCs finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def switch_interval() -> float:
    """Apply PDSERVE_SWITCH_INTERVAL_MS (engine.settings.switch_interval_ms) as `sys.setswitchinterval`; the
    interval in force, seconds. An engine service steps its engine in a thread beside the event loop that serves
    its RPCs: a thread that wants the interpreter lock waits up to this interval (Python's default 5 ms) before
    the holder is asked to give it up."""
    ms = settings.switch_interval_ms()
    if ms is not None:
        sys.setswitchinterval(ms / 1000.0)
    return sys.getswitchinterval()


def retry_after_s(exc: grpc.aio.AioRpcError, default: float = 1.0) -> float:
    """The `retry-after-ms` an overloaded server sent with RESOURCE_EXHAUSTED (else `default`)."""
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return int(value) / 1000.0
    return default


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run a service's async main on uvloop (falls back to asyncio when uvloop is missing). A port it could
    not listen on returns PORT_IN_USE_EXIT (for `sys.exit`), so that a launcher can tell it apart.
    PDSERVE_SWITCH_INTERVAL_MS sets the interpreter's thread switch interval first (`switch_interval`)."""
    switch_interval()
    try:
        import uvloop  # optional at import: the fallback below keeps a service running where it is missing
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        runner = asyncio.run
    try:
        return runner(main())
    except PortInUse as exc:
        log.error("%s", exc.strerror)
        return PORT_IN_USE_EXIT


# ---- client side --------------------------------------------------------------------------------

def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])


async def check_health(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """True if the server at `address` reports SERVING for `service` ('' = the whole server)."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_health_sync(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """Blocking variant for code without an event loop (the launcher)."""
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
