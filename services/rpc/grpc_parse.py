"""Malformed request bytes answer INVALID_ARGUMENT with the parse error, not UNKNOWN.

grpc parses a request before any handler runs, and reports a parse failure as UNKNOWN, which a
client cannot tell from a server bug. `parse_checked(server)` is what `GrpcServer.add_service` hands
to the generated `add_<Svc>Servicer_to_server`: every method then receives raw bytes and parses
them itself, so a corrupt message is the client's error (INVALID_ARGUMENT) and never reaches code.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


async def _parse(parse, raw: bytes, context: grpc.aio.ServicerContext):
    try:
        return parse(raw) if parse is not None else raw
    except (DecodeError, ValueError, TypeError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")


def checked(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """The same handler, with the request parsed inside it (unary requests; streams pass through)."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse, out = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(raw, context):
            return await inner(await _parse(parse, raw, context), context)
        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=None, response_serializer=out)
    inner = handler.unary_stream

    async def stream(raw, context):
        async for item in inner(await _parse(parse, raw, context), context):
            yield item
    return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=out)


class _CheckedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner
        self._cache: dict[str, grpc.RpcMethodHandler | None] = {}  # one entry per method of the service

    def service(self, details: grpc.HandlerCallDetails):
        if details.method not in self._cache:
            self._cache[details.method] = checked(self._inner.service(details))
        return self._cache[details.method]


class parse_checked:  # used like a function: add_to_server(servicer, parse_checked(server))
    """A stand-in for a grpc.aio.Server that wraps the handlers a generated `add_*_to_server` adds."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_CheckedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {m: checked(h) for m, h in handlers.items()})
